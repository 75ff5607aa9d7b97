"""LowPrecisionAdamW (Megatron's precision-aware optimizer): fp32 moments step as torch's
fused AdamW exactly; bf16 moments are the fp32 update rounded back, every step; the chunks
and load_state_dict change nothing; OptimizerConfig's rules are Megatron's."""

import pytest
import torch

import mp_optim.low_precision_adam as low
from mp_optim import OptimizerConfig
from mp_optim.low_precision_adam import LowPrecisionAdamW

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
BF16 = dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
FP32 = dict(exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32)


def parameters(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in ((7, 5), (5,), (3, 4, 2))]


def groups(params: list[torch.Tensor]) -> list[dict]:
    return [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0}]


def run(make, steps: int = 6) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    params = [p.requires_grad_() for p in parameters()]
    optimizer = make(groups(params))
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()
    return [p.detach() for p in params], optimizer


def test_fp32_moments_step_as_torch_fused_adamw():
    ours, optimizer = run(lambda g: LowPrecisionAdamW(g, **FP32, **HYPER))
    theirs, reference = run(lambda g: torch.optim.AdamW(g, fused=True, **HYPER))
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
    for p, q in zip(optimizer.state, reference.state, strict=True):
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[p][name], reference.state[q][name]), name


def test_bf16_moments_are_the_fp32_update_rounded_back():
    """Against torch's single-tensor AdamW given the widened bf16 moments each step."""
    params = [p.requires_grad_() for p in parameters()]
    optimizer = LowPrecisionAdamW(groups(params), **BF16, **HYPER)
    copies = [p.detach().clone().requires_grad_() for p in params]
    reference = torch.optim.AdamW(groups(copies), foreach=False, fused=False, **HYPER)
    generator = torch.Generator().manual_seed(1)
    for _ in range(6):
        for p, c in zip(params, copies, strict=True):
            p.grad = torch.randn(p.shape, generator=generator)
            c.grad = p.grad.clone()
            theirs = reference.state[c]
            for name in ("exp_avg", "exp_avg_sq") if theirs else ():  # ours before its step
                theirs[name].copy_(optimizer.state[p][name].float())
        optimizer.step()
        reference.step()
        for p, c in zip(params, copies, strict=True):
            state, theirs = optimizer.state[p], reference.state[c]
            assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
            torch.testing.assert_close(p.detach(), c.detach(), rtol=1e-6, atol=1e-7)
            for name in ("exp_avg", "exp_avg_sq"):  # rounded: within one bf16 step
                torch.testing.assert_close(state[name], theirs[name].bfloat16(), rtol=8e-3,
                                           atol=0)  # fmt: skip
            c.data.copy_(p.detach())  # each step starts from ours


def test_bf16_moments_follow_the_fp32_trajectory_closely():
    ours, optimizer = run(lambda g: LowPrecisionAdamW(g, **BF16, **HYPER), steps=20)
    theirs, _ = run(lambda g: LowPrecisionAdamW(g, **FP32, **HYPER), steps=20)
    start = parameters()
    for a, b, s in zip(ours, theirs, start, strict=True):
        moved = (b - s).abs().max()
        assert moved > 0.05 and (a - b).abs().max() < 0.02 * moved
    moments = [t for state in optimizer.state.values() for k, t in state.items() if k != "step"]
    assert all(t.dtype == torch.bfloat16 for t in moments) and len(moments) == 6


@pytest.mark.parametrize("limit", [7, 40])
def test_pieces_change_nothing(monkeypatch, limit):
    """Parameters cut into ranges (7: the 35 and 24 elements' in 5 and 4) or batched
    together (40: the first two) step exactly as whole, each counting one step."""
    whole, _ = run(lambda g: LowPrecisionAdamW(g, **BF16, **HYPER))
    monkeypatch.setitem(low.CHUNK_ELEMENTS, "cpu", limit)
    cut, optimizer = run(lambda g: LowPrecisionAdamW(g, **BF16, **HYPER))
    for a, b in zip(whole, cut, strict=True):
        assert torch.equal(a, b)
    assert {float(s["step"]) for s in optimizer.state.values()} == {6.0}
    params = [p.requires_grad_() for p in parameters()]
    for p in params:
        p.grad = torch.zeros_like(p)
    states = [LowPrecisionAdamW(groups(params), **BF16, **HYPER).init_moments(p) for p in params]
    sizes = [sum(t.numel() for t in piece["param"]) for piece in low._pieces(params, states, limit)]
    assert sizes == ([7] * 5 + [5, 7, 7, 7, 3] if limit == 7 else [40, 24])


def test_state_dict_round_trip_keeps_the_moments_dtypes():
    ours, optimizer = run(lambda g: LowPrecisionAdamW(g, **BF16, **HYPER))
    params = [p.clone().requires_grad_() for p in ours]
    again = LowPrecisionAdamW(groups(params), **BF16, **HYPER)
    again.load_state_dict(optimizer.state_dict())
    for p, q in zip(optimizer.state, again.state, strict=True):
        for name in ("exp_avg", "exp_avg_sq"):
            assert again.state[q][name].dtype == torch.bfloat16
            assert torch.equal(again.state[q][name], optimizer.state[p][name])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(exp_avg_dtype="bf16"), "exp_avg_dtype='bf16' needs use_precision_aware_optimizer"),
        (dict(use_precision_aware_optimizer=True), "needs the distributed optimizer"),
        (dict(use_precision_aware_optimizer=True, use_distributed_optimizer=True,
              optimizer="sgd"), "adam only"),
        (dict(use_precision_aware_optimizer=True, use_distributed_optimizer=True,
              exp_avg_sq_dtype="fp16"), "need a scale per tensor"),
        (dict(use_precision_aware_optimizer=True, use_distributed_optimizer=True,
              main_params_dtype="fp16"), "fp16 main parameters"),
        (dict(use_precision_aware_optimizer=True, use_distributed_optimizer=True,
              main_grads_dtype="bf16"), "main_grads_dtype='bf16' needs bf16=True"),
        (dict(use_precision_aware_optimizer=True, use_distributed_optimizer=True,
              exp_avg_dtype="int8"), "exp_avg_dtype='int8' must be one of"),
    ],
)  # fmt: skip
def test_megatrons_rules(fields, message):
    with pytest.raises(ValueError, match=message):
        OptimizerConfig(lr=1e-3, **fields)


def test_bf16_main_grads_reduce_in_bf16():
    config = OptimizerConfig(lr=1e-3, bf16=True, use_precision_aware_optimizer=True,
                             use_distributed_optimizer=True, main_grads_dtype="bf16")  # fmt: skip
    assert config.grad_reduce_in_bf16 and not config.grad_reduce_in_fp32
    fsdp = OptimizerConfig(lr=1e-3, use_precision_aware_optimizer=True, use_megatron_fsdp=True,
                           data_parallel_sharding_strategy="optim_grads_params",
                           exp_avg_dtype="bf16")  # fmt: skip
    assert fsdp.moment_dtypes == {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.float32}
