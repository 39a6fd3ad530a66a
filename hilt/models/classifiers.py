"""The Fashion-MNIST classifiers the compute-in-memory simulator runs, written plainly so that
`hilt.cim_sim` finds and converts their Linear and Conv2d layers by name:

- ``mlp``: 784-256-256-10 with ReLU.
- ``cnn``: LeNet-like, conv 5x5 (16) - pool - conv 5x5 (32) - pool - 128 - 10.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hilt.errors import HiltError


class MLP(nn.Module):
    """784-256-256-10 multilayer perceptron with ReLU."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(28 * 28, 256)
        self.fc2 = nn.Linear(256, 256)
        self.fc3 = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class CNN(nn.Module):
    """LeNet-like CNN: two 5x5 conv layers with 2x2 max pooling, then two Linear layers."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=5, padding=2)   # 28x28 -> pool -> 14x14
        self.conv2 = nn.Conv2d(16, 32, kernel_size=5, padding=2)  # 14x14 -> pool -> 7x7
        self.fc1 = nn.Linear(32 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


WORKLOADS: dict[str, type[nn.Module]] = {"mlp": MLP, "cnn": CNN}

def check_workload(name: str) -> None:
    if name not in WORKLOADS:
        raise HiltError(f"unknown workload {name!r}; choose one of: {', '.join(sorted(WORKLOADS))}")


def build(name: str) -> nn.Module:
    """A freshly initialised workload model (uses the global torch RNG for init)."""
    check_workload(name)
    return WORKLOADS[name]()
