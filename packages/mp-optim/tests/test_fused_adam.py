"""The optimizer steps with torch's fused AdamW (one pass over every fp32 main parameter
and its state), or with the compiled update (torch_compile_optimizer: the clipping's
scale, AdamW and the copy into the model in one compiled kernel per parameter): their
updates against torch's single-tensor AdamW, the per-parameter reference, given the
same gradients (after clipping and loss scaling), groups and learning rates. The
compiled update also leaves the model's bf16 parameters equal to their rounded main
parameters."""

import pytest
import torch

import mp_state
from mp_optim import DistributedDataParallel, OptimizerConfig, get_optimizer
from mp_state import ParallelConfig
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank


def body(bf16: bool, compiled: bool = False):
    import mp_optim.optimizer

    torch.set_num_threads(1)
    state = mp_state.initialize(ParallelConfig())
    torch.manual_seed(0)
    dtype = torch.bfloat16 if bf16 else torch.float32
    module = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64),
                                 torch.nn.GELU(), torch.nn.Linear(64, 8)).to(dtype)  # fmt: skip
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.05, bf16=bf16,
                             torch_compile_optimizer=compiled)  # fmt: skip
    model = DistributedDataParallel(config, module, dp_group=state.dp)
    optimizer = get_optimizer(config, [model], mp_group=state.mp)
    fused = optimizer.optimizer
    assert fused.defaults["fused"], "the optimizer is torch's fused AdamW"
    # The reference: torch's single-tensor AdamW over copies of the main parameters,
    # grouped as the optimizer groups them, given each step the gradients it is given.
    mains = [p for group in fused.param_groups for p in group["params"]]
    copies = [p.detach().clone() for p in mains]
    start = [p.detach().clone() for p in mains]
    groups, at = [], 0
    for group in fused.param_groups:
        n = len(group["params"])
        groups.append({"params": copies[at : at + n], "weight_decay": group["weight_decay"]})
        at += n
    reference = torch.optim.AdamW(groups, lr=config.lr, betas=(config.adam_beta1,
                                  config.adam_beta2), eps=config.adam_eps,
                                  foreach=False, fused=False)  # fmt: skip
    real_step, real_compiled = fused.step, mp_optim.optimizer.adamw_step

    def reference_step(scale):
        for copy, main in zip(copies, mains, strict=True):
            copy.grad = main.grad.clone() * scale
        for ours, theirs in zip(fused.param_groups, reference.param_groups, strict=True):
            theirs["lr"] = ours["lr"]
        reference.step()

    def step(*args, **kwargs):
        reference_step(1.0)  # the gradients are clipped already
        return real_step(*args, **kwargs)

    def compiled_step(optimizer, views, scale, scales=None):
        assert optimizer is fused and not scales  # no separate grad_norm_group here
        reference_step(scale)  # the update clips them
        return real_compiled(optimizer, views, scale, scales)

    fused.step = step
    mp_optim.optimizer.adamw_step = compiled_step
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    for _ in range(5):
        optimizer.zero_grad()
        model(x).float().square().mean().backward()
        model.finish_grad_sync()
        assert optimizer.step().update_successful
    errors = [
        float((m - c).abs().max() / c.abs().max()) for m, c in zip(mains, copies, strict=True)
    ]
    moved = min(float((c - s).abs().max()) for c, s in zip(copies, start, strict=True))
    rounded = all(torch.equal(p, optimizer.shards[p][0].main_param.to(dtype))
                  for p in module.parameters())  # fmt: skip
    # The state is torch's fused AdamW's, whichever path stepped it (checkpoints alike).
    for main in mains:
        state = fused.state[main]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}, set(state)
        assert state["step"].dtype == torch.float32 and state["step"].shape == ()
        assert float(state["step"]) == 5.0 and state["exp_avg"].shape == main.shape
    mp_state.destroy()
    return max(errors), moved, rounded


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_the_fused_update_equals_the_single_tensor_reference(bf16):
    error, moved, rounded = run_on_ranks(body, 1, bf16, timeout=120)[0]
    assert moved > 1e-3  # every parameter took its steps
    assert error <= 1e-6, f"fused and single-tensor AdamW differ by {error:.2e} (relative)"
    assert rounded


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_the_compiled_update_equals_the_single_tensor_reference(bf16):
    error, moved, rounded = run_on_ranks(body, 1, bf16, True, timeout=180)[0]
    assert moved > 1e-3
    assert error <= 1e-6, f"compiled and single-tensor AdamW differ by {error:.2e} (relative)"
    assert rounded, "the model's parameters are not their main parameters, rounded"
