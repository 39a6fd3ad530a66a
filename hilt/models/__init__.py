"""Single-file model definitions for the built-in workloads (SmolLM2, MiniLM, a character GPT, the Fashion-MNIST classifiers).

``TRAINED`` holds the trained classifier checkpoints that commands default to (`hilt drift`, `hilt certify`,
`hilt energy`, the report): ``WORKLOAD-METHOD.safetensors``, made by `hilt train`.
"""

from pathlib import Path

TRAINED = Path(__file__).resolve().parent / "trained"
