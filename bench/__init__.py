"""hilt.bench: the built-in workloads and everything the command line runs on them.

models/ (single-file model definitions), data/ (Fashion-MNIST, text), tasks/ (what the CLI
runs for users), studies/ (accuracy studies), perf/ (speed benchmarks, the GPU check) and
the end-to-end report. Library packages never import this one.
"""

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"  # committed results and trained checkpoints
