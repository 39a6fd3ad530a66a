"""hilt.bench: measurements only. studies/ (accuracy studies), perf/ (speed benchmarks, the GPU check)
and the end-to-end report (`hilt report`). Only `hilt bench` and `hilt report` import this package;
what user commands run lives in hilt.tasks, hilt.models and hilt.data.
"""

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"  # committed benchmark results
