"""GroupedExperts: this rank's experts of a MoE layer, computed as grouped matmuls.

Shapes: E experts of inner width F over ep expert-parallel ranks and etp expert
tensor-parallel ranks; this rank holds El = E / ep experts (global indices
ep_rank El .. ep_rank El + El - 1) and Fl = F / etp of each one's inner channels:

    linear_fc1.weight [El, 2 Fl, h]   each expert's rows [gate_r; up_r] when gated ([Fl, h] else)
    linear_fc1.bias   [El, 2 Fl]      (add_bias_linear) laid out as the weight's rows
    linear_fc2.weight [El, h, Fl]
    linear_fc2.bias   [El, h]         (add_bias_linear) whole on every expert-TP rank

tokens [N, h] arrive sorted by local expert, `counts` [El] of them each, with each
copy's routing probability p [N]; the output [N, h] is this rank's partial sum over its
Fl channels (the dispatcher sums it over expert_tp) of a copy's p (fc2(act(fc1(x))) + b2),
as in Megatron's TEGroupedMLP and Hugging Face's GptOssExperts; a padded copy, of weight
0, adds nothing. p scales the activation, fc2's input: [N, Fl] is half as wide as the
output when F = h / 2, as in Qwen3-MoE and gpt-oss (Megatron's grouped MLP applies it
there too). With moe_apply_probs_on_input (Llama 4, top-1 routing) p scales the copy's
input instead, x -> p x, and the output is fc2(act(fc1(p x))) + b2 (p then stands at 1
below; a padded copy still adds nothing), as Megatron's experts compute it. The fc2 bias
must enter the sum once: as a RowParallelLinear adds its bias after the reduction,
expert-TP rank 0 adds p b2 and the others add zeros, while the bias' gradient, the same
on every expert-TP rank (the combine's backward gathers the output gradient), reaches
every rank's copy whole. Weights are drawn
expert by expert from one generator whatever the layout (every rank draws all E and keeps
its own), so a seed gives the same model at every EP and expert-TP size; biases start at 0.

The checkpoint holds the experts stacked by global index (Megatron's and Hugging Face's
per-expert tensors are their slices): linear_fc1.gate.weight and linear_fc1.up.weight
[E, F, h] (linear_fc1.weight without a gate), linear_fc2.weight [E, h, F], and with
add_bias_linear linear_fc1.gate.bias and linear_fc1.up.bias [E, F] (linear_fc1.bias),
linear_fc2.bias [E, h] (a replica on expert-TP ranks > 0).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from mp_ckpt import ShardedTensor
from mp_layers.config import TransformerConfig
from mp_layers.tensor_parallel import deferred_init, initialization
from mp_layers.tensor_parallel.partition import mark_partitioned
from mp_layers.transformer.mlp import activate
from mp_layers.transformer.output_recompute import OutputRecompute
from mp_state import RankGroup

__all__ = ["GroupedExperts", "grouped_matmul", "is_expert_key"]


class GroupedExperts(torch.nn.Module):
    def __init__(
        self, config: TransformerConfig, ep: RankGroup, etp: RankGroup, width: int | None = None
    ) -> None:  # fmt: skip
        """width: of the tokens the experts take and give (a latent MoE's moe_latent_size);
        None: hidden_size."""
        super().__init__()
        self.config = config
        self.ep, self.etp = ep, etp
        self.gated = config.gated_linear_unit
        # selective "moe_act": the activation's output (fc2's input) discarded once fc2
        # saved it (output_recompute.py)
        self.recompute_activation = config.recomputes("moe_act")
        self.width = config.hidden_size if width is None else width
        experts, f, h = config.num_moe_experts, config.moe_ffn_hidden_size, self.width
        self.num_local = experts // ep.size
        self.local_ffn = f // etp.size
        first = ep.rank * self.num_local
        rows = slice(etp.rank * self.local_ffn, (etp.rank + 1) * self.local_ffn)
        parts = 2 if self.gated else 1
        bias = config.add_bias_linear
        shapes = ((self.num_local, parts * self.local_ffn, h),
                  (self.num_local, h, self.local_ffn))  # fmt: skip
        if deferred_init.deferring():  # filled shard by shard once sharded (_ExpertDraws)
            draws = _ExpertDraws(experts, parts, f, h, first, rows,
                                 (config.hidden_init_std, config.output_layer_init_std),
                                 torch.get_rng_state())  # fmt: skip
            draws.advance()
            self.linear_fc1, self.linear_fc2 = (
                _ExpertWeights(torch.empty(shape, device="meta"), bias, config.params_dtype)
                for shape in shapes
            )
            deferred_init.attach(self.linear_fc1.weight, draws.of_fc(1))
            deferred_init.attach(self.linear_fc2.weight, draws.of_fc(2))
            self._mark_partitioned()
            return
        if initialization.draws_skipped():  # a checkpoint fills them
            self.linear_fc1, self.linear_fc2 = (
                _ExpertWeights(torch.empty(shape, dtype=config.params_dtype), bias,
                               config.params_dtype)
                for shape in shapes
            )  # fmt: skip
            self._mark_partitioned()
            return
        fc1, fc2 = [], []
        for expert in range(experts):
            w1 = torch.empty(parts * f, h).normal_(std=config.hidden_init_std)
            w2 = torch.empty(h, f).normal_(std=config.output_layer_init_std)
            if first <= expert < first + self.num_local:
                fc1.append(torch.cat([part[rows] for part in w1.chunk(parts)]))
                fc2.append(w2[:, rows])
        self.linear_fc1 = _ExpertWeights(torch.stack(fc1), bias, config.params_dtype)
        self.linear_fc2 = _ExpertWeights(torch.stack(fc2), bias, config.params_dtype)
        self._mark_partitioned()

    def _mark_partitioned(self) -> None:
        """Each expert's fc1 is split by rows over etp, its fc2 by columns (for optimizers
        that need whole matrices, mp_optim's Muon)."""
        mark_partitioned(self.linear_fc1.weight, 1, self.etp)
        mark_partitioned(self.linear_fc2.weight, 2, self.etp)

    def forward(self, tokens: torch.Tensor, counts: list[int], probs: torch.Tensor) -> torch.Tensor:
        """tokens [N, h] sorted by local expert, counts [El], probs [N] -> the weighted
        outputs [N, h] (partial over etp)."""
        grouped = self.config.moe_grouped_gemm
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        p = probs.to(tokens.dtype).unsqueeze(-1)
        if self.config.moe_apply_probs_on_input:  # Llama 4: p scales the input instead
            tokens, p = tokens * p, (p != 0).to(p.dtype)
        inner = grouped_matmul(tokens, fc1.weight.transpose(1, 2), counts, grouped)
        if fc1.bias is not None:
            inner = inner + _per_copy(fc1.bias, counts)
        kept = OutputRecompute(self.recompute_activation and self.training)
        weighted = kept.run(self._activate, inner, p)
        out = grouped_matmul(weighted, fc2.weight.transpose(1, 2), counts, grouped)
        kept.discard(out)
        if fc2.bias is not None:
            out = out + _AddedOnce.apply(_per_copy(fc2.bias, counts), self.etp.rank == 0) * p
        return out

    def _activate(self, inner: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return activate(self.config, inner) * p

    def sharded_state_dict(self, prefix: str = "") -> dict[str, ShardedTensor]:
        experts = self.config.num_moe_experts
        f, h = self.config.moe_ffn_hidden_size, self.width
        first, inner = self.ep.rank * self.num_local, self.etp.rank * self.local_ffn
        parts = ("linear_fc1.gate.", "linear_fc1.up.") if self.gated else ("linear_fc1.",)
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        pieces = {}
        for name, data in zip(parts, fc1.weight.chunk(len(parts), dim=1), strict=True):
            key = f"{prefix}{name}weight"
            pieces[key] = ShardedTensor(key, data, (experts, f, h), (first, inner, 0))
        if fc1.bias is not None:
            for name, data in zip(parts, fc1.bias.chunk(len(parts), dim=1), strict=True):
                key = f"{prefix}{name}bias"
                pieces[key] = ShardedTensor(key, data, (experts, f), (first, inner))
        key = prefix + "linear_fc2.weight"
        pieces[key] = ShardedTensor(key, fc2.weight, (experts, h, f), (first, 0, inner))
        if fc2.bias is not None:
            key = prefix + "linear_fc2.bias"
            pieces[key] = ShardedTensor(
                key, fc2.bias, (experts, h), (first, 0), replica_id=self.etp.rank
            )
        return pieces


class _ExpertWeights(torch.nn.Module):
    """One linear layer of the local experts: weight [El, out, in] and, with `bias`, bias
    [El, out] (zeros), both marked expert_parallel (reduced over expert-dp)."""

    def __init__(self, weight: torch.Tensor, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight.to(dtype))
        self.bias = None
        if bias:  # zeros, also beside a weight left on the meta device
            device = None if weight.is_meta else weight.device
            self.bias = torch.nn.Parameter(torch.zeros(weight.shape[:2], dtype=dtype,
                                                       device=device))  # fmt: skip
        for param in self.parameters():
            param.expert_parallel = True


@dataclass(frozen=True)
class _ExpertDraws:
    """The experts' weights as GroupedExperts draws them (expert by expert, each one's
    fc1 [parts F, h] then its fc2 [h, F], from the default CPU generator in
    `generator_state`), replayed a block of rows at a time (deferred_init.normal_blocks)
    so that no expert's weight is ever held whole: `advance()` moves the default
    generator past all the draws; `of_fc(n).fill_rows(...)` writes local experts of fc n."""

    experts: int
    parts: int
    f: int
    h: int
    first: int
    """The global index of this rank's first expert."""
    inner: slice
    """This rank's rows of each fc1 part and columns of fc2 (expert tensor parallelism)."""
    stds: tuple[float, float]
    generator_state: torch.Tensor
    fc: int = 0
    """Which weight fill_rows writes: 1 (fc1) or 2 (fc2)."""

    def of_fc(self, fc: int) -> _ExpertDraws:
        return dataclasses.replace(self, fc=fc)

    def advance(self) -> None:
        for _ in self._draws(self.experts, None):
            pass

    def fill_rows(self, start: int, stop: int, out: torch.Tensor,
                  through: torch.dtype | None = None) -> None:  # fmt: skip
        """out[: stop - start] = local experts [start, stop) of weight fc (the protocol
        mp_optim's FSDP sharding calls), rounded to `through` first when given."""
        if stop <= start:
            return
        generator = torch.Generator()
        generator.set_state(self.generator_state)
        wanted = range(self.first + start, self.first + stop)
        local_ffn = self.inner.stop - self.inner.start
        for expert, fc, begin, block in self._draws(wanted.stop, generator):
            if fc != self.fc or expert not in wanted:
                continue
            dest = out[expert - wanted.start]
            if fc == 2:  # rows of [h, F]: keep this rank's columns
                rows = block[:, self.inner]
                dest[begin : begin + rows.shape[0]].copy_(_rounded(rows, through))
                continue
            for part in range(self.parts):  # rows of [parts F, h]: keep each part's rows
                lo = max(begin, part * self.f + self.inner.start)
                hi = min(begin + block.shape[0], part * self.f + self.inner.stop)
                if lo < hi:
                    at = part * local_ffn + lo - part * self.f - self.inner.start
                    dest[at : at + hi - lo].copy_(_rounded(block[lo - begin : hi - begin],
                                                           through))  # fmt: skip

    def _draws(self, experts: int, generator: torch.Generator | None):
        """(expert, fc, first row, block) over the draws of experts 0 .. experts - 1."""
        for expert in range(experts):
            for fc, shape, std in ((1, (self.parts * self.f, self.h), self.stds[0]),
                                   (2, (self.h, self.f), self.stds[1])):  # fmt: skip
                for begin, block in deferred_init.normal_blocks(shape, 0.0, std, generator):
                    yield expert, fc, begin, block


def _rounded(rows: torch.Tensor, through: torch.dtype | None) -> torch.Tensor:
    return rows if through is None else rows.to(through)


def _per_copy(bias: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """bias [El, n] -> [sum(counts), n]: expert g's row repeated counts[g] times."""
    repeats = torch.tensor(counts, device=bias.device)
    return bias.repeat_interleave(repeats, dim=0, output_size=sum(counts))


class _AddedOnce(torch.autograd.Function):
    """The fc2 bias rows on expert-TP rank 0, zeros on the others; the gradient passes to
    every rank unchanged (see the module docstring)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, adds: bool) -> torch.Tensor:
        return rows if adds else torch.zeros_like(rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


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
    their capacity), else one matmul per group (also when no group has any: a rank whose
    experts received no tokens still joins the backward, with zero gradients)."""
    if grouped and x.shape[0] and _has_grouped_kernel(x, weights):
        offsets = torch.tensor(counts, dtype=torch.int32, device=x.device).cumsum(
            0, dtype=torch.int32
        )
        out = torch._grouped_mm(x.contiguous(), weights, offs=offsets)
        if out.requires_grad:
            # The kernel's backward needs a dense gradient (a sum's is a broadcast view).
            out.register_hook(torch.Tensor.contiguous)
        return out
    if len(set(counts)) == 1 and counts[0] > 0:
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
