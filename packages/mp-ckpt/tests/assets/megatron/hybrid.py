"""Megatron-LM's hybrid (Mamba) model on the CPU, for generate.py's hybrid cases.

megatron-core's MambaMixer needs the mamba_ssm package (CUDA and Triton kernels) for two
things: the chunked selective scan and the gated RMSNorm after it. `install_mamba_standins()`
puts CPU stand-ins for both under mamba_ssm's module names, written from the kernels'
documented semantics; everything else in the mixer (in_proj's split into z, x, B, C and
dt, the causal convolution, the head layout, the TP sharding and the checkpoint names)
stays megatron-core's own code. The mixer runs with --disable-mamba-mem-eff-path, where
megatron-core calls the scan and the norm separately (the fused kernel would do the
convolution and the projections too).

`hybrid_module(args, config)` builds megatron-core's HybridModel with Megatron's local
hybrid spec that keeps Transformer Engine's checkpoint names
(post_training.modelopt.hybrid.get_hybrid_stack_modelopt_spec with remap_te_layernorm: a
Mamba layer's norm saved as mixer.in_proj.layer_norm_weight, an attention layer's as
self_attention.linear_qkv.layer_norm_weight, an MLP layer's as
mlp.linear_fc1.layer_norm_weight), its norms (the layers' and HybridStack's final_norm)
megatron-core's torch norms in place of Transformer Engine's (not installed here).
"""

import sys
import types

import torch
import torch.nn.functional as F


class GatedRMSNorm(torch.nn.Module):
    """mamba_ssm.ops.triton.layernorm_gated.RMSNorm: y * silu(z) (the gate before the norm
    unless norm_before_gate), normalized by the root mean square over each group of
    group_size channels, times weight."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True,
                 device=None, dtype=None):  # fmt: skip
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.eps = eps
        self.group_size = group_size or hidden_size
        self.norm_before_gate = norm_before_gate

    def forward(self, x, z=None):
        dtype = x.dtype
        x = x.float()
        if z is not None and not self.norm_before_gate:
            x = x * F.silu(z.float())
        grouped = x.view(*x.shape[:-1], -1, self.group_size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        out = grouped.view(x.shape) * self.weight.float()
        if z is not None and self.norm_before_gate:
            out = out * F.silu(z.float())
        return out.to(dtype)


def chunk_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
               dt_limit=(0.0, float("inf")), return_final_states=False, initial_states=None,
               **unused):  # fmt: skip
    """mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined, one position at a time
    (the result does not depend on chunk_size): x [b, l, h, p], dt [b, l, h], A [h],
    B and C [b, l, g, n] (head i reads group i // (h / g)), D [h] or [h, p]:

        dt = softplus(dt + dt_bias) clamped to dt_limit
        state = exp(dt A) state + dt x B^T      per head, [p, n]
        y = state C + D x                        then y silu(z) when z is given
    """
    assert not unused.get("seq_idx") and not unused.get("cu_seqlens"), "one sequence per row"
    batch, length, heads, _ = x.shape
    per_group = heads // B.shape[2]
    dtype = x.dtype
    x, A = x.float(), A.float()
    dt = dt.float() + (0 if dt_bias is None else dt_bias.float())
    dt = F.softplus(dt) if dt_softplus else dt
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    B = B.float().repeat_interleave(per_group, dim=2)  # [b, l, h, n]
    C = C.float().repeat_interleave(per_group, dim=2)
    state = (torch.zeros(batch, heads, x.shape[-1], B.shape[-1]) if initial_states is None
             else initial_states.float())  # fmt: skip
    ys = []
    for t in range(length):
        decay = torch.exp(dt[:, t] * A)[..., None, None]  # [b, h, 1, 1]
        state = decay * state + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        ys.append((state * C[:, t, :, None, :]).sum(-1))
    y = torch.stack(ys, dim=1)  # [b, l, h, p]
    if D is not None:
        d = D.float()
        y = y + x * (d[:, None] if d.dim() == 1 else d)
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(dtype)
    return (y, state) if return_final_states else y


def _fused_path(*args, **kwargs):
    raise NotImplementedError("run the mixer with --disable-mamba-mem-eff-path")


def install_mamba_standins():
    """Registers the stand-ins as mamba_ssm's modules (before megatron-core imports them)."""
    names = ("mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton")
    for name in names:
        sys.modules.setdefault(name, types.ModuleType(name))
    norm = types.ModuleType("mamba_ssm.ops.triton.layernorm_gated")
    norm.RMSNorm = GatedRMSNorm
    scan = types.ModuleType("mamba_ssm.ops.triton.ssd_combined")
    scan.mamba_chunk_scan_combined = chunk_scan
    scan.mamba_split_conv1d_scan_combined = _fused_path
    sys.modules[norm.__name__] = norm
    sys.modules[scan.__name__] = scan
    sys.modules["mamba_ssm"].__version__ = "2.2.4"


def hybrid_module(args, config):
    """megatron-core's HybridModel of `args` (module docstring)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.post_training.modelopt.hybrid import model_specs
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    # Transformer Engine's norm is not installed here: the layers' and the final one's
    model_specs.Norm = hybrid_block.TENorm = WrappedTorchNorm
    spec = model_specs.get_hybrid_stack_modelopt_spec(
        local_core_attention=True, remap_te_layernorm=True
    )
    return HybridModel(
        config=config,
        hybrid_stack_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        hybrid_layer_pattern=args.hybrid_layer_pattern,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
    )
