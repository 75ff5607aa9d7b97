"""ChainedOptimizer: several torch optimizers, each over its own main parameters, stepped
and saved as one (Muon's matrices beside Adam's other parameters).

param_groups is every optimizer's groups in order (the same dicts, so a scheduler that
writes lr and weight_decay there reaches each); state maps each main parameter to its
own optimizer's state.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

__all__ = ["ChainedOptimizer"]


class _ChainedState(Mapping):
    """The optimizers' state dicts as one (a parameter belongs to one optimizer)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self._optimizers = optimizers
        self._owner = {
            id(p): opt for opt in optimizers for g in opt.param_groups for p in g["params"]
        }

    def __getitem__(self, param: torch.Tensor) -> dict:
        owner = self._owner.get(id(param))
        if owner is None:
            raise KeyError("the tensor is none of the chained optimizers' parameters")
        return owner.state[param]  # a defaultdict: a new parameter's state starts empty

    def __iter__(self) -> Iterator[torch.Tensor]:
        for opt in self._optimizers:
            yield from opt.state

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self._optimizers)


class ChainedOptimizer:
    """The optimizers in `optimizers`, stepped one after the other."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        if not optimizers:
            raise ValueError("ChainedOptimizer needs at least one optimizer")
        self.optimizers = optimizers
        self.state = _ChainedState(optimizers)

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def owner(self, param: torch.Tensor) -> torch.optim.Optimizer:
        """The optimizer that steps `param`."""
        return self.state._owner[id(param)]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        saved = state["optimizers"]
        if len(saved) != len(self.optimizers):
            raise ValueError(f"the state holds {len(saved)} optimizers, this chain "
                             f"{len(self.optimizers)}")  # fmt: skip
        for opt, one in zip(self.optimizers, saved, strict=True):
            opt.load_state_dict(one)
