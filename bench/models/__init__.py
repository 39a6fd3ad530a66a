"""Single-file model definitions for the built-in workloads (SmolLM2, MiniLM, a character GPT, the Fashion-MNIST classifiers)."""
