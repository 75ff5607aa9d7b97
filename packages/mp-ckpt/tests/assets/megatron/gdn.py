"""Megatron-LM's gated DeltaNet layers (Qwen3-Next's; experimental_attention_variant
"gated_delta_net") on the CPU, for generate.py's qwen3_next cases.

megatron-core's GatedDeltaNet calls three kernels of the flash-linear-attention package
(FLA, CUDA and Triton): the causal convolution, the L2 norm of queries and keys, and the
chunked gated delta rule. `install_fla_standins()` puts CPU stand-ins for them under FLA's
module names, written from their documented semantics (the rule position by position, so
that mp's chunked form is checked against an independent computation); everything else in
the layer (in_proj's split into q, k, v, z, beta and alpha, the gates, the head layout, the
output norm and gate, the TP sharding and the checkpoint names) stays megatron-core's own.

`gdn_decoder_spec(config)` builds the layer specs megatron-core's
get_transformer_block_with_experimental_attention_variant_spec would (it asserts
Transformer Engine): megatron-core's local GPT layer specs (MoE or dense, qk-layernorm and
the attention output gate from the config), the attention of the linear_attention_freq
layers replaced by GatedDeltaNet with local linear layers and a torch norm, its input norm
saved under Transformer Engine's name, self_attention.in_proj.layer_norm_weight (the TE
spec fuses it into in_proj).
"""

import copy
import sys
import types

import torch
import torch.nn.functional as F
from block_spec import local_block_spec


def causal_conv1d(x, weight, bias=None, activation=None, initial_state=None,
                  output_final_state=False, cu_seqlens=None, **unused):  # fmt: skip
    """fla.modules.convolution.causal_conv1d: x [b, s, d], weight [d, w]: the depthwise
    convolution of each channel over itself and the w - 1 positions before it (zeros
    before the start), then the activation; returns (y [b, s, d], None)."""
    assert initial_state is None and not output_final_state and cu_seqlens is None
    width = weight.shape[-1]
    padded = F.pad(x.transpose(1, 2), (width - 1, 0))
    y = F.conv1d(padded, weight[:, None, :], bias, groups=x.shape[-1]).transpose(1, 2)
    if activation in ("silu", "swish"):
        y = F.silu(y)
    return y, None


def l2norm(x, eps=1e-6, **unused):
    """fla.modules.l2norm.l2norm: x / sqrt(sum(x^2) + eps) over the last dimension."""
    return (x.float() * torch.rsqrt(x.float().pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False,
                           cu_seqlens=None, **unused):  # fmt: skip
    """fla.ops.gated_delta_rule.chunk_gated_delta_rule, one position at a time (the result
    does not depend on the chunk): q, k [b, s, h, dk], v [b, s, h, dv], g (log-decay) and
    beta [b, s, h]; per head S = exp(g) S + beta k (v - exp(g) S^T k)^T, o = S^T q scale
    (scale 1/sqrt(dk) by default); returns (o, the final state or None)."""
    assert cu_seqlens is None, "one sequence per row"
    dtype = v.dtype
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    b, s, h, dk = k.shape
    scale = dk**-0.5 if scale is None else scale
    state = (torch.zeros(b, h, dk, v.shape[-1]) if initial_state is None
             else initial_state.float())  # fmt: skip
    out = []
    for t in range(s):
        state = state * g[:, t].exp()[..., None, None]
        read = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        state = state + k[:, t, :, :, None] * ((v[:, t] - read) * beta[:, t, :, None])[:, :, None]
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t] * scale))
    return torch.stack(out, dim=1).to(dtype), (state if output_final_state else None)


def install_fla_standins():
    """Registers the stand-ins as FLA's modules (before megatron-core imports them)."""
    for name in ("fla", "fla.modules", "fla.ops"):
        sys.modules.setdefault(name, types.ModuleType(name))
    rule = chunk_gated_delta_rule
    parts = {"fla.modules.convolution": {"causal_conv1d": causal_conv1d},
             "fla.modules.l2norm": {"l2norm": l2norm},
             "fla.ops.gated_delta_rule": {"chunk_gated_delta_rule": rule}}  # fmt: skip
    for name, members in parts.items():
        module = types.ModuleType(name)
        for member, value in members.items():
            setattr(module, member, value)
        sys.modules[name] = module


def gdn_decoder_spec(config, normalization: str):
    """The decoder's layer specs (module docstring)."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_linear_attention_pattern,
    )
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.ssm.gated_delta_net.common import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    block = local_block_spec(config, normalization)
    linear = ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm, out_proj=RowParallelLinear
        ),
    )
    pattern = get_linear_attention_pattern(config)
    for i, is_linear in enumerate(pattern):
        if is_linear:  # (the dense and MoE layer specs are shared by their layers)
            layer = block.layer_specs[i] = copy.deepcopy(block.layer_specs[i])
            layer.submodules.self_attention = linear
            keys = dict(layer.submodules.sharded_state_dict_keys_map)
            keys["input_layernorm."] = "self_attention.in_proj.layer_norm_"
            layer.submodules.sharded_state_dict_keys_map = keys
    return block
