"""Writes upcycling.pt: megatron-core 0.19.2's upcycling of a dense MLP into experts, the
reference of test_upcycling.py. Run with megatron-core 0.19.2 installed (Python >= 3.12;
it runs on a CPU, nothing here needs CUDA or torch.distributed):

    python generate.py            # -> upcycling.pt beside this file

Megatron-LM's converter (upcycling_utils._convert_to_moe_state_dict) reads a dense model
and a MoE model: their `mlp` modules, the MoE layer's config, expert-parallel rank and
experts. It is called here on stand-ins holding what it reads: one layer each
("decoder.layers.0."), the MoE layer a MoELayer and its experts a SequentialMLP
(created without their __init__, which would need parallel state), their parameters drawn
from a fixed seed. Cases: SwiGLU copied (granularity 1) and cut in two; GELU cut in two
with pre-softmax routing and biases; squared ReLU cut in four. Each case records the
settings, the dense MLP's tensors, the MoE router's weight as drawn, and the converter's
expert tensors and router weight.
"""

from __future__ import annotations

import types
from pathlib import Path

import torch
import torch.nn.functional as F
from megatron.core.activations import squared_relu
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.upcycling_utils import _convert_to_moe_state_dict

HIDDEN = 8
CASES = {
    "swiglu-copies": dict(activation="swiglu", granularity=1, experts=4, topk=2, ffn=12),
    "swiglu-granular": dict(activation="swiglu", granularity=2, experts=8, topk=4, ffn=12),
    "gelu-granular-pre-softmax-biases": dict(
        activation="gelu", granularity=2, experts=4, topk=2, ffn=12, pre_softmax=True, bias=True
    ),
    "squared-relu-granular": dict(
        activation="squared_relu", granularity=4, experts=8, topk=4, ffn=16
    ),
}
ACTIVATIONS = {"swiglu": (F.silu, True), "gelu": (F.gelu, False),
               "squared_relu": (squared_relu, False)}  # fmt: skip


def _linear(out_features: int, in_features: int, bias: bool, generator) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(out_features, in_features, generator=generator))
    layer.bias = (
        torch.nn.Parameter(torch.randn(out_features, generator=generator)) if bias else None
    )
    return layer


def _mlp(width: int, gated: bool, bias: bool, generator) -> torch.nn.Module:
    mlp = torch.nn.Module()
    mlp.linear_fc1 = _linear(width * (2 if gated else 1), HIDDEN, bias, generator)
    mlp.linear_fc2 = _linear(HIDDEN, width, bias, generator)
    return mlp


def _model(mlp: torch.nn.Module) -> torch.nn.Module:
    """A module whose state dict reads "decoder.layers.0.mlp.*"."""
    layer = torch.nn.Module()
    layer.mlp = mlp
    decoder = torch.nn.Module()
    decoder.layers = torch.nn.ModuleList([layer])
    model = torch.nn.Module()
    model.decoder = decoder
    return model


def _case(settings: dict, generator) -> dict:
    function, gated = ACTIVATIONS[settings["activation"]]
    granularity, experts = settings["granularity"], settings["experts"]
    ffn, bias = settings["ffn"], settings.get("bias", False)
    config = types.SimpleNamespace(
        num_moe_experts=experts, gated_linear_unit=gated, moe_router_topk=settings["topk"],
        moe_router_pre_softmax=settings.get("pre_softmax", False),
        moe_ffn_hidden_size=ffn // granularity, activation_func=function, ffn_hidden_size=ffn,
    )  # fmt: skip
    dense_mlp = _mlp(ffn, gated, bias, generator)
    dense_mlp.config = config
    moe_layer = MoELayer.__new__(MoELayer)
    torch.nn.Module.__init__(moe_layer)
    moe_layer.config, moe_layer.num_local_experts = config, experts
    moe_layer.ep_group = types.SimpleNamespace(rank=lambda: 0)
    moe_layer.router = torch.nn.Module()
    moe_layer.router.weight = torch.nn.Parameter(torch.randn(experts, HIDDEN, generator=generator))
    sequential = SequentialMLP.__new__(SequentialMLP)
    torch.nn.Module.__init__(sequential)
    sequential.local_experts = torch.nn.ModuleList(
        _mlp(ffn // granularity, gated, bias, generator) for _ in range(experts)
    )
    moe_layer.experts = sequential
    dense, moe = _model(dense_mlp), _model(moe_layer)
    converted = _convert_to_moe_state_dict(moe, dense)
    prefix = "decoder.layers.0.mlp."
    return {
        "settings": settings,
        "dense": {k[len(prefix):]: v.clone() for k, v in dense.state_dict().items()},
        "router": moe_layer.router.weight.detach().clone(),
        "converted": {k[len(prefix):]: v.detach().clone() for k, v in converted.items()
                      if k.startswith(prefix)},
    }  # fmt: skip


def main() -> None:
    generator = torch.Generator().manual_seed(2025)
    out = {name: _case(settings, generator) for name, settings in CASES.items()}
    path = Path(__file__).with_name("upcycling.pt")
    torch.save(out, path)
    for name, case in out.items():
        print(name, sorted(case["converted"])[:3], "...")
    print(f"{len(out)} cases -> {path}")


if __name__ == "__main__":
    main()
