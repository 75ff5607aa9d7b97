"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), the update of
megatron-core's --optimizer lion (emerging_optimizers' Lion, decoupled weight decay):

    p <- p - lr wd p
    p <- p - lr sign(lerp(m, g, 1 - beta1))
    m <- lerp(m, g, 1 - beta2)

One state tensor per parameter (`exp_avg`, the momentum m) where Adam keeps two. The
update is elementwise, so a shard of a parameter (the distributed optimizer's, FSDP's)
steps as the whole would, element for element. Each group's parameters step together
through torch's multi-tensor (foreach) operations.
"""

from __future__ import annotations

import torch

__all__ = ["Lion"]


class Lion(torch.optim.Optimizer):
    """Lion over `params`: lr, betas (beta1 for the sign's interpolation, beta2 for the
    momentum's), decoupled weight_decay."""

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.95, 0.98),
                 weight_decay: float = 0.0) -> None:  # fmt: skip
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Lion's beta{i + 1}={beta} must lie in [0, 1)")
        if lr < 0 or weight_decay < 0:
            raise ValueError(f"Lion's lr={lr} and weight_decay={weight_decay} must be >= 0")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("Lion.step takes no closure")
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            moments = []
            for p in params:
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                moments.append(state["exp_avg"])
            lr, (beta1, beta2), decay = group["lr"], group["betas"], group["weight_decay"]
            if decay:
                torch._foreach_add_(params, params, alpha=-decay * lr)
            updates = torch._foreach_lerp(moments, grads, 1 - beta1)
            torch._foreach_sign_(updates)
            torch._foreach_lerp_(moments, grads, 1 - beta2)
            torch._foreach_add_(params, updates, alpha=-lr)
        return None
