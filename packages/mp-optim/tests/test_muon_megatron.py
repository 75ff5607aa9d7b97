"""Muon against Megatron-LM's own (megatron-core 0.19.2's TensorParallelMuon over
emerging-optimizers 0.3.0), recorded in assets/megatron_muon/reference.pt by its
generate.py: the Newton-Schulz iteration for every coefficient set, the scale factors,
three steps of the optimizer in six settings (split QKV included), and two steps at TP2
in each tensor-parallel mode."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mp_optim.muon import MatrixLayout, Muon, _matmul_precision, newton_schulz, scale_factor
from mp_state import RankGroup
from mp_state.testing import run_on_ranks

REFERENCE = Path(__file__).parent / "assets" / "megatron_muon" / "reference.pt"


@pytest.fixture(scope="module")
def reference() -> dict:
    return torch.load(REFERENCE, weights_only=True)


def test_newton_schulz_equals_megatrons(reference):
    for case in reference["newton_schulz"]:
        with _matmul_precision(case["precision"]):
            out = newton_schulz(case["x"], case["steps"], case["coefficient_type"])
        what = (case["coefficient_type"], case["steps"], case["precision"], case["x"].shape)
        if case["precision"] == "highest":
            # the same fp32 operations in the same order: bit for bit
            assert torch.equal(out, case["out"]), what
        else:
            # bf16 iterations: the CPU's bf16 matmul kernel sums in its own order (AVX2
            # and AVX-512 BF16 machines differ in up to two thirds of the elements, by
            # one bf16 step of the value), so within two of those steps
            torch.testing.assert_close(out, case["out"], rtol=2**-7, atol=2**-8, msg=str(what))


def test_scale_factors_equal_megatrons(reference):
    for case in reference["scale_factor"]:
        assert scale_factor(case["out"], case["in"], case["mode"]) == case["value"], case


def muon_of(kwargs: dict, params: list[torch.Tensor], **extra) -> Muon:
    """Muon with the oracle's constructor arguments."""
    return Muon(
        params, lr=kwargs["lr"], momentum=kwargs["momentum"], nesterov=kwargs["nesterov"],
        weight_decay=kwargs["weight_decay"],
        decoupled_weight_decay=kwargs["use_decoupled_weight_decay"],
        num_ns_steps=kwargs["num_ns_steps"], coefficient_type=kwargs["coefficient_type"],
        scale_mode=kwargs["scale_mode"], extra_scale_factor=kwargs["extra_scale_factor"],
        matmul_precision=kwargs["fp32_matmul_prec"], split_qkv=kwargs["split_qkv"], **extra,
    )  # fmt: skip


def test_three_steps_equal_megatrons(reference):
    for case in reference["muon_steps"]:
        kwargs = case["kwargs"]
        params = {name: value.clone() for name, value in case["params"].items()}
        optimizer = muon_of(kwargs, list(params.values()))
        for name in case["is_qkv"]:
            rows = tuple(kwargs["qkv_split_shapes"])
            optimizer.layouts[id(params[name])] = MatrixLayout(qkv_rows=rows)
        for grads, after in zip(case["grads"], case["params_after"], strict=True):
            for name, p in params.items():
                p.grad = grads[name].clone()
            optimizer.step()
            for name, p in params.items():
                assert torch.equal(p, after[name]), (case["name"], name)
        for name, p in params.items():
            buffer = optimizer.state[p]["momentum_buffer"]
            assert torch.equal(buffer, case["momentum_after"][name]), (case["name"], name)


def tp_steps(cases: list[dict]) -> list[list[list[torch.Tensor]]]:
    """On a rank of 2: each case's parameter block after each step."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    group = RankGroup("tp", (0, 1), rank, dist.group.WORLD)
    out = []
    for case in cases:
        dim = case["partition_dim"]
        param = case["full_param"].chunk(2, dim=dim)[rank].clone()
        optimizer = muon_of(case["kwargs"], [param], tp_mode=case["tp_mode"])
        optimizer.layouts[id(param)] = MatrixLayout(partition_dim=dim, group=group)
        steps = []
        for grad in case["grads_full"]:
            param.grad = grad.chunk(2, dim=dim)[rank].clone()
            optimizer.step()
            steps.append(param.clone())
        out.append(steps)
    return out


@pytest.mark.multirank
def test_tensor_parallel_steps_equal_megatrons(reference):
    cases = reference["muon_tp"]
    ranks = run_on_ranks(tp_steps, 2, cases)
    for i, case in enumerate(cases):
        for step, want in enumerate(case["params_after_per_rank"]):
            for rank in range(2):
                got = ranks[rank][i][step]
                assert torch.equal(got, want[rank]), (case["name"], step, rank)
