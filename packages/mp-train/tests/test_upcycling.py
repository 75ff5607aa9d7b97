"""mp's upcycling of a dense MLP into experts equals megatron-core 0.19.2's
(assets/megatron_upcycling/upcycling.pt, written by its generate.py from Megatron-LM's
upcycling_utils): every expert's linear_fc1 and linear_fc2 weights and biases, and the
router's weight, for SwiGLU copied and cut in two, GELU cut in two with pre-softmax
routing and biases, and squared ReLU cut in four. mp holds a SwiGLU MLP's gate and up
apart and the experts stacked; Megatron-LM one [gate; up] tensor per expert."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from mp_ckpt import ShardedTensor
from mp_train.loop.upcycling import expert_box, repeated_router, weight_scale

CASES = torch.load(Path(__file__).parent / "assets/megatron_upcycling/upcycling.pt",
                   weights_only=False)  # fmt: skip


def _model(settings: dict) -> types.SimpleNamespace:
    """The TransformerConfig fields weight_scale reads."""
    return types.SimpleNamespace(
        num_moe_experts=settings["experts"], moe_router_topk=settings["topk"],
        moe_router_pre_softmax=settings.get("pre_softmax", False),
        activation=settings["activation"], gated_linear_unit=settings["activation"] == "swiglu",
        quick_geglu=False,
    )  # fmt: skip


def _dense_logical(dense: dict, gated: bool) -> dict[str, torch.Tensor]:
    """Megatron-LM's dense MLP tensors under mp's logical names."""
    logical = {}
    for kind in ("weight", "bias"):
        fc1, fc2 = dense.get(f"linear_fc1.{kind}"), dense.get(f"linear_fc2.{kind}")
        if fc1 is None:
            continue
        if gated:
            logical[f"linear_fc1.gate.{kind}"], logical[f"linear_fc1.up.{kind}"] = fc1.chunk(2)
        else:
            logical[f"linear_fc1.{kind}"] = fc1
        logical[f"linear_fc2.{kind}"] = fc2
    return logical


def _megatrons_expert(converted: dict, key: str, expert: int, gated: bool) -> torch.Tensor:
    """Expert `expert`'s tensor `key` (mp's name) in Megatron-LM's converted state dict."""
    name, kind = key.rsplit(".", 1)
    fused = name.startswith("linear_fc1") and gated
    tensor = converted[f"experts.local_experts.{expert}.{'linear_fc1' if fused else name}.{kind}"]
    if fused:
        gate, up = tensor.chunk(2)
        return gate if name.endswith("gate") else up
    return tensor


def _expert_shape(name: str, kind: str, experts: int, width: int, hidden: int) -> tuple:
    """The logical shape of the experts' tensor (mp-layers' experts.py)."""
    if name == "linear_fc2":
        return (experts, hidden, width) if kind == "weight" else (experts, hidden)
    return (experts, width, hidden) if kind == "weight" else (experts, width)


@pytest.mark.parametrize("case", sorted(CASES))
def test_experts_and_router_are_megatrons(case):
    settings, dense, converted = (CASES[case][k] for k in ("settings", "dense", "converted"))
    granularity, experts = settings["granularity"], settings["experts"]
    width = settings["ffn"] // granularity
    gated = settings["activation"] == "swiglu"
    scale = weight_scale(_model(settings), granularity)
    for key, tensor in _dense_logical(dense, gated).items():
        name, kind = key.rsplit(".", 1)
        hidden = tensor.shape[0] if name == "linear_fc2" else tensor.shape[-1]
        shape = _expert_shape(name, kind, experts, width, hidden)
        piece = ShardedTensor(f"decoder.layers.0.mlp.experts.{key}", torch.empty(shape), shape,
                              (0,) * len(shape))  # fmt: skip
        got = expert_box(piece, name, kind, tensor, granularity, scale)
        for expert in range(experts):
            want = _megatrons_expert(converted, key, expert, gated)
            torch.testing.assert_close(got[expert], want, rtol=0, atol=0, msg=f"{key}[{expert}]")
    router = CASES[case]["router"]
    piece = ShardedTensor("decoder.layers.0.mlp.router.weight", router.clone(),
                          tuple(router.shape), (0, 0))  # fmt: skip
    want_router = converted["router.weight"]
    got_router = router if granularity == 1 else repeated_router(piece, granularity)
    torch.testing.assert_close(got_router, want_router, rtol=0, atol=0)


def test_quick_geglu_is_refused():
    model = _model({"experts": 4, "topk": 2, "activation": "swiglu"})
    model.quick_geglu = True
    with pytest.raises(ValueError, match="quick GeGLU is not one of them"):
        weight_scale(model, 1)
