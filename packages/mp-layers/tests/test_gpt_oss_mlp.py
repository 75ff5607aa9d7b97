"""gpt-oss's MLP: the clamped quick GEGLU (quick_geglu, glu_linear_offset,
activation_func_clamp_value), expert biases and the router bias (add_bias_linear), equal to
transformers' GptOssExperts and GptOssMLP with the same weights; the config's rules.

Hugging Face stores an expert's fc1 as gate_up_proj [E, h, 2F] with the gate and the
linear part interleaved ([..., ::2] and [..., 1::2]) and fc2 as down_proj [E, F, h]; mp's
logical tensors are linear_fc1.gate / .up [E, F, h] and linear_fc2 [E, h, F]."""

import os

import pytest
import torch
import torch.nn.functional as F

from mp_layers import ModelGroups, TransformerConfig
from mp_layers.moe.moe_layer import MoELayer
from mp_layers.transformer.mlp import MLP, activate

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
from transformers.models.gpt_oss import modeling_gpt_oss  # noqa: E402

ALONE = ModelGroups.single()
H, F_MOE, E = 64, 32, 4
GPT_OSS = dict(quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=7.0)


def hf_config(topk: int):
    config = transformers.GptOssConfig(
        hidden_size=H, intermediate_size=F_MOE, num_local_experts=E, num_experts_per_tok=topk,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    config._experts_implementation = "eager"
    return config


def mp_config(topk: int, **settings) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, num_moe_experts=E,
        moe_ffn_hidden_size=F_MOE, moe_router_topk=topk, add_bias_linear=True,
        hidden_dropout=0.0, attention_dropout=0.0, **GPT_OSS | settings,
    )  # fmt: skip


def random_hf_mlp(topk: int) -> torch.nn.Module:
    """GptOssMLP with every weight and bias drawn (its own init leaves some at zero), scaled
    so that many activations reach the clamp at 7."""
    torch.manual_seed(0)
    mlp = modeling_gpt_oss.GptOssMLP(hf_config(topk)).eval()
    with torch.no_grad():
        for name, p in mlp.named_parameters():
            p.normal_(std=0.5 if "gate_up" in name else 0.2)
    return mlp


def logical_from_gpt_oss(mlp: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Hugging Face's GptOssMLP tensors under mp's logical names (mlp. stripped)."""
    experts, router = mlp.experts, mlp.router
    gate_up, gate_up_bias = experts.gate_up_proj, experts.gate_up_proj_bias
    return {
        "router.weight": router.weight, "router.bias": router.bias,
        "experts.linear_fc1.gate.weight": gate_up[..., ::2].transpose(1, 2),
        "experts.linear_fc1.up.weight": gate_up[..., 1::2].transpose(1, 2),
        "experts.linear_fc1.gate.bias": gate_up_bias[:, ::2],
        "experts.linear_fc1.up.bias": gate_up_bias[:, 1::2],
        "experts.linear_fc2.weight": experts.down_proj.transpose(1, 2),
        "experts.linear_fc2.bias": experts.down_proj_bias,
    }  # fmt: skip


def load_logical(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    pieces = module.sharded_state_dict()
    assert pieces.keys() == tensors.keys(), pieces.keys() ^ tensors.keys()
    with torch.no_grad():
        for key, piece in pieces.items():
            piece.data.copy_(tensors[key].reshape(piece.global_shape)[piece.global_slices])


def test_activation_equals_gpt_oss_experts_gate():
    hf = modeling_gpt_oss.GptOssExperts(hf_config(2))
    gate_up = torch.randn(50, 2 * F_MOE) * 6  # beyond the clamp on both sides
    want = hf._apply_gate(gate_up)
    got = activate(mp_config(2), torch.cat([gate_up[:, ::2], gate_up[:, 1::2]], dim=-1))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert (gate_up.abs() > 7).any()


def test_activation_of_one_expert_equals_gpt_oss_experts():
    hf = random_hf_mlp(2).experts
    x = torch.randn(10, H)
    # Every token to expert 2 with weight 1: HF's output is that expert's MLP.
    want = hf(x, torch.full((10, 1), 2), torch.ones(10, 1))
    tensors = logical_from_gpt_oss(random_hf_mlp(2))
    w_gate, w_up = (tensors[f"experts.linear_fc1.{p}.weight"][2] for p in ("gate", "up"))
    b_gate, b_up = (tensors[f"experts.linear_fc1.{p}.bias"][2] for p in ("gate", "up"))
    inner = torch.cat([x @ w_gate.t() + b_gate, x @ w_up.t() + b_up], dim=-1)
    got = activate(mp_config(2), inner) @ tensors["experts.linear_fc2.weight"][2].t()
    torch.testing.assert_close(got + tensors["experts.linear_fc2.bias"][2], want)


def test_dense_quick_geglu_mlp_is_the_formula():
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                               ffn_hidden_size=24, **GPT_OSS)  # fmt: skip
    mlp = MLP(config, ALONE.tp)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(std=2.0)
    x = torch.randn(3, 2, 16)
    out, bias = mlp(x)
    w_gate, w_up = mlp.linear_fc1.weight.chunk(2)
    b_gate, b_up = mlp.linear_fc1.bias.chunk(2)
    gate = (x @ w_gate.t() + b_gate).clamp(max=7.0)
    up = (x @ w_up.t() + b_up).clamp(-7.0, 7.0)
    want = (gate * torch.sigmoid(1.702 * gate) * (up + 1.0)) @ mlp.linear_fc2.weight.t()
    torch.testing.assert_close(out + bias, want + mlp.linear_fc2.bias)
    assert set(mlp.sharded_state_dict()) == {
        "linear_fc1.gate.weight", "linear_fc1.up.weight", "linear_fc1.gate.bias",
        "linear_fc1.up.bias", "linear_fc2.weight", "linear_fc2.bias",
    }  # fmt: skip


@pytest.mark.parametrize("topk", [2, 4])
def test_moe_layer_with_biases_equals_gpt_oss_mlp(topk):
    hf = random_hf_mlp(topk)
    ours = MoELayer(mp_config(topk), ALONE)
    load_logical(ours, logical_from_gpt_oss(hf))
    x = torch.randn(6, 2, H)  # [s, b, h]
    with torch.no_grad():
        want, _ = hf(x.transpose(0, 1))
        got, bias = ours(x)
    assert bias is None
    torch.testing.assert_close(got, want.transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_router_bias_shifts_the_logits_and_softmax_follows_the_top_k():
    ours = MoELayer(mp_config(2), ALONE)
    hf = random_hf_mlp(2)
    load_logical(ours, logical_from_gpt_oss(hf))
    x = torch.randn(5, 1, H)
    probs, routing_map = ours.router(x)
    _, scores, indices = hf.router(x.reshape(5, H))
    want = torch.zeros(5, E).scatter(1, indices, scores)
    torch.testing.assert_close(probs, want)
    assert torch.equal(routing_map, want > 0)


def test_new_parameters_are_named_for_weight_decay_and_expert_parallelism():
    layer = MoELayer(mp_config(2), ALONE)
    named = dict(layer.named_parameters())
    assert set(named) == {
        "router.weight", "router.bias", "experts.linear_fc1.weight", "experts.linear_fc1.bias",
        "experts.linear_fc2.weight", "experts.linear_fc2.bias",
    }  # fmt: skip
    assert named["experts.linear_fc1.bias"].shape == (E, 2 * F_MOE)
    assert named["experts.linear_fc2.bias"].shape == (E, H)
    assert all(getattr(p, "expert_parallel", False) for k, p in named.items() if "experts" in k)
    assert not any(named[k].count_nonzero() for k in named if k.startswith("experts.") and
                   k.endswith("bias"))  # fmt: skip


BASE = dict(num_layers=1, hidden_size=64, num_attention_heads=2)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(quick_geglu=True, activation="swiglu"), "quick_geglu=True replaces activation"),
        (dict(quick_geglu=True, openai_gelu=True), "quick_geglu=True replaces activation"),
        (dict(glu_linear_offset=1.0), "glu_linear_offset=1.0 applies to a gated activation"),
        (dict(activation="squared_relu", activation_func_clamp_value=7.0),
         "activation_func_clamp_value=7.0 applies to a gated activation"),
        (dict(quick_geglu=True, activation_func_clamp_value=0.0),
         "activation_func_clamp_value=0.0 must be finite and > 0"),
        (dict(quick_geglu=True, activation_func_clamp_value=float("inf")),
         "activation_func_clamp_value=inf must be finite"),
        (dict(activation="swiglu", activation_func_clamp_value=7.0),
         "activation_func_clamp_value=7.0 with activation='swiglu' needs num_moe_experts"),
        (dict(activation="swiglu", activation_func_clamp_value=7.0, glu_linear_offset=1.0,
              num_moe_experts=4), "glu_linear_offset=1.0 with activation='swiglu'"),
    ],
)  # fmt: skip
def test_gated_activation_settings_are_checked(settings, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**BASE | settings)


def test_clamped_swiglu_with_experts_is_megatrons():
    config = TransformerConfig(**BASE, activation="swiglu", num_moe_experts=2,
                               add_bias_linear=False, activation_func_clamp_value=1.0)  # fmt: skip
    inner = torch.tensor([[3.0, -2.0, 5.0, -4.0]])
    want = F.silu(torch.tensor([1.0, -2.0])) * torch.tensor([1.0, -1.0])
    torch.testing.assert_close(activate(config, inner), want[None])
