"""bench: real workloads (models, data), benchmark harnesses, reports and plots."""
