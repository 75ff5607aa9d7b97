"""GroupedExperts: this rank's experts of a MoE layer, computed as grouped matmuls.

Shapes: E experts of inner width F over ep expert-parallel ranks and etp expert
tensor-parallel ranks; this rank holds El = E / ep experts (global indices
ep_rank El .. ep_rank El + El - 1) and Fl = F / etp of each one's inner channels:

    weight1 [El, 2 Fl, h]   fc1, each expert's rows [gate_r; up_r] for swiglu ([Fl, h] else)
    weight2 [El, h, Fl]     fc2

tokens [N, h] arrive sorted by local expert, `counts` [El] of them each; the output
[N, h] is this rank's partial sum over its Fl channels (the dispatcher sums it over
expert_tp). Weights are drawn expert by expert from one generator whatever the layout
(every rank draws all E and keeps its own), so a seed gives the same model at every EP
and expert-TP size.

The checkpoint holds the experts stacked by global index (Megatron's and Hugging Face's
per-expert tensors are their slices): linear_fc1.gate.weight and linear_fc1.up.weight
[E, F, h] (linear_fc1.weight without swiglu), linear_fc2.weight [E, h, F].
"""

from __future__ import annotations

import torch

from mp_ckpt import ShardedTensor
from mp_layers.config import TransformerConfig
from mp_layers.transformer.mlp import activate
from mp_state import RankGroup

__all__ = ["GroupedExperts", "grouped_matmul", "is_expert_key"]


class GroupedExperts(torch.nn.Module):
    def __init__(self, config: TransformerConfig, ep: RankGroup, etp: RankGroup) -> None:
        super().__init__()
        self.config = config
        self.ep, self.etp = ep, etp
        self.gated = config.activation == "swiglu"
        experts, f, h = config.num_moe_experts, config.moe_ffn_hidden_size, config.hidden_size
        self.num_local = experts // ep.size
        self.local_ffn = f // etp.size
        first = ep.rank * self.num_local
        rows = slice(etp.rank * self.local_ffn, (etp.rank + 1) * self.local_ffn)
        fc1, fc2 = [], []
        for expert in range(experts):
            w1 = torch.empty((2 if self.gated else 1) * f, h).normal_(std=config.init_method_std)
            w2 = torch.empty(h, f).normal_(std=config.output_layer_init_std)
            if first <= expert < first + self.num_local:
                fc1.append(torch.cat([part[rows] for part in w1.chunk(2 if self.gated else 1)]))
                fc2.append(w2[:, rows])
        self.weight1 = torch.nn.Parameter(torch.stack(fc1).to(config.params_dtype))
        self.weight2 = torch.nn.Parameter(torch.stack(fc2).to(config.params_dtype))
        for weight in (self.weight1, self.weight2):
            weight.expert_parallel = True

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        grouped = self.config.moe_grouped_gemm
        inner = grouped_matmul(tokens, self.weight1.transpose(1, 2), counts, grouped)
        return grouped_matmul(
            activate(self.config, inner), self.weight2.transpose(1, 2), counts, grouped
        )

    def sharded_state_dict(self, prefix: str = "") -> dict[str, ShardedTensor]:
        experts = self.config.num_moe_experts
        f, h = self.config.moe_ffn_hidden_size, self.config.hidden_size
        first, inner = self.ep.rank * self.num_local, self.etp.rank * self.local_ffn
        parts = (
            {"linear_fc1.gate.weight": 0, "linear_fc1.up.weight": 1}
            if self.gated
            else {"linear_fc1.weight": 0}
        )
        pieces = {}
        for name, index in parts.items():
            data = self.weight1.chunk(len(parts), dim=1)[index]
            pieces[prefix + name] = ShardedTensor(
                prefix + name, data, (experts, f, h), (first, inner, 0)
            )
        key = prefix + "linear_fc2.weight"
        pieces[key] = ShardedTensor(key, self.weight2, (experts, h, f), (first, 0, inner))
        return pieces


def is_expert_key(key: str) -> bool:
    """Whether a checkpoint key names routed experts' weights (replicated over the expert
    data-parallel ranks, where every other weight is replicated over the data-parallel
    ones)."""
    return ".mlp.experts." in key or key.startswith("mlp.experts.")


def grouped_matmul(
    x: torch.Tensor, weights: torch.Tensor, counts: list[int], grouped: bool
) -> torch.Tensor:
    """Rows of x in groups of counts[g], group g times weights[g]: [N, k] x [G, k, n] -> [N, n].

    grouped: torch's grouped matmul kernel (on CPUs, and on CUDA for bf16 from compute
    capability 9.0, with rows of a multiple of 16 bytes). Otherwise, or where it is
    missing: one batched matmul when every group has as many rows (experts padded to
    their capacity), else one matmul per group."""
    if grouped and _has_grouped_kernel(x, weights):
        offsets = torch.tensor(counts, dtype=torch.int32, device=x.device).cumsum(
            0, dtype=torch.int32
        )
        out = torch._grouped_mm(x.contiguous(), weights, offs=offsets)
        if out.requires_grad:
            # The kernel's backward needs a dense gradient (a sum's is a broadcast view).
            out.register_hook(torch.Tensor.contiguous)
        return out
    if len(set(counts)) == 1:
        return torch.bmm(x.view(len(counts), counts[0], -1), weights).flatten(0, 1)
    return torch.cat([rows @ w for rows, w in zip(x.split(counts), weights, strict=True)])


def _has_grouped_kernel(x: torch.Tensor, weights: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    if any(n * x.element_size() % 16 for n in weights.shape[1:]):
        return False
    if x.device.type == "cpu":
        return True
    return (
        x.device.type == "cuda"
        and x.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
    )
