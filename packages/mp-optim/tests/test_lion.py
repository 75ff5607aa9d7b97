"""Lion: emerging_optimizers 0.3.0's update, which megatron-core's --optimizer lion runs
(assets/lion/lion.pt, written by assets/lion/generate.py with it installed), and through
MixedPrecisionOptimizer a shard steps as the whole parameter does."""

from pathlib import Path

import pytest
import torch

from mp_optim import OptimizerConfig
from mp_optim.lion import Lion

FIXTURE = torch.load(Path(__file__).parent / "assets" / "lion" / "lion.pt")


def test_lion_takes_megatrons_steps():
    """Two groups (decayed matrices at lr 1e-2, undecayed vector at 5e-3), three steps,
    the last at half the learning rate: the parameters bitwise as emerging_optimizers'
    Lion leaves them, the momenta within 1e-9 (its update is compiled, and the
    interpolation rounds in another order: measured 1.2e-10 on momenta of about 1e-3)."""
    params = {k: torch.nn.Parameter(v.clone()) for k, v in FIXTURE["initial"].items()}
    optimizer = Lion([
        {"params": [params["matrix"], params["other"]], "lr": 1e-2, "weight_decay": 0.1},
        {"params": [params["vector"]], "lr": 5e-3, "weight_decay": 0.0},
    ], lr=1e-2, betas=(0.95, 0.98))  # fmt: skip
    for step, (grads, want) in enumerate(zip(FIXTURE["grads"], FIXTURE["after"], strict=True)):
        if step == len(FIXTURE["grads"]) - 1:
            for group in optimizer.param_groups:
                group["lr"] *= 0.5
        for name, param in params.items():
            param.grad = grads[name].clone()
        optimizer.step()
        for name, param in params.items():
            torch.testing.assert_close(param.detach(), want["params"][name], rtol=0, atol=0)
            torch.testing.assert_close(optimizer.state[param]["exp_avg"],
                                       want["exp_avg"][name], rtol=0, atol=1e-9)  # fmt: skip
        moved = (params["matrix"] - FIXTURE["initial"]["matrix"]).abs()
        assert moved.min() > 0  # every element moved (sign updates of lr each)


def test_lion_refuses_betas_outside_zero_one():
    with pytest.raises(ValueError, match=r"Lion's beta2=1\.0 must lie in"):
        Lion([torch.nn.Parameter(torch.zeros(2))], lr=1e-3, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match=r"lion_beta1=1.5 must be in \[0, 1\)"):
        OptimizerConfig(lr=1e-3, optimizer="lion", lion_beta1=1.5)
