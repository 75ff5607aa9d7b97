"""A small pipeline stage for tests and examples.

`TanhStack` applies tanh(layer(h)) for each of its layers. Like a GPT stage,
the first stage reads the micro-batch given to forward(). Later stages read
what the schedule hands them through set_input_tensor().
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["TanhStack"]


class TanhStack(torch.nn.Module):
    def __init__(self, layers: Iterable[torch.nn.Module], first: bool) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.first = first
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        self.input_tensor = tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x if self.first else self.input_tensor
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h
