"""Writes lion.pt: emerging_optimizers 0.3.0's Lion (what megatron-core 0.19.2 runs for
--optimizer lion) over fixed parameters and gradients, the reference of test_lion.py.
Needs emerging-optimizers==0.3.0 (and absl-py) beside torch; nothing else of Megatron:

    python generate.py            # -> lion.pt beside this file

Two parameter groups, as Megatron builds them: matrices with weight decay 0.1 at lr 1e-2,
vectors without decay at lr 5e-3; betas (0.95, 0.98), Megatron's defaults; three steps,
each on new gradients, the last with a lower learning rate (a schedule's step). Recorded:
the initial parameters, each step's gradients, and the parameters and momenta after
each step.
"""

from __future__ import annotations

from pathlib import Path

import torch
from emerging_optimizers.scalar_optimizers.lion import Lion

STEPS = 3


def main() -> None:
    generator = torch.Generator().manual_seed(7)
    shapes = {"matrix": (16, 24), "other": (24, 8), "vector": (24,)}
    initial = {k: torch.randn(s, generator=generator) * 0.1 for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=generator) * 0.01 for k, s in shapes.items()}
             for _ in range(STEPS)]  # fmt: skip
    params = {k: torch.nn.Parameter(v.clone()) for k, v in initial.items()}
    groups = [
        {"params": [params["matrix"], params["other"]], "lr": 1e-2, "weight_decay": 0.1},
        {"params": [params["vector"]], "lr": 5e-3, "weight_decay": 0.0},
    ]
    optimizer = Lion(groups, lr=1e-2, betas=(0.95, 0.98), weight_decay=0.1)
    after = []
    for step in range(STEPS):
        if step == STEPS - 1:
            for group in optimizer.param_groups:
                group["lr"] *= 0.5
        for name, param in params.items():
            param.grad = grads[step][name].clone()
        optimizer.step()
        after.append({
            "params": {k: p.detach().clone() for k, p in params.items()},
            "exp_avg": {k: optimizer.state[p]["exp_avg"].clone() for k, p in params.items()},
        })  # fmt: skip
    torch.save({"initial": initial, "grads": grads, "after": after},
               Path(__file__).with_name("lion.pt"))  # fmt: skip


if __name__ == "__main__":
    main()
