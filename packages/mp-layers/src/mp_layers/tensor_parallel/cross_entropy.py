"""Cross entropy over vocabulary-parallel logits, without gathering the vocabulary.

Shapes: [s, b] = sequence, batch; v = vocabulary size; v/tp = this rank's
contiguous piece of the vocabulary (the output of a ColumnParallelLinear
without gather_output).

    logits  [s, b, v/tp]
    target  [s, b]          global token ids in [0, v)
    loss    [s, b]          fp32, per token

With x the logits, m = max_j x_j and Z = sum_j exp(x_j - m) over the whole
vocabulary, the loss of target t is log Z - (x_t - m). Each rank computes its
part of each quantity and three small collectives over [s, b] combine them:
an all-reduce MAX for m (subtracting it keeps exp from overflowing whatever
the logits' magnitude), then one all-reduce SUM carrying x_t - m (non-zero
only on the rank that holds t), Z and, for label smoothing, sum_j (x_j - m).
No rank ever holds [s, b, v].

Label smoothing follows Megatron (after NeMo): a fraction `label_smoothing`
= a of the target mass is spread evenly over the v - 1 other tokens. With
K = v and e = a * K / (K - 1),

    loss = (1 - e) * (-log p_t) + e * mean_j (-log p_j),

which equals torch's F.cross_entropy(label_smoothing=e) (torch spreads its
mass over all v tokens, the target included). Megatron takes K and the mean
over each rank's vocabulary piece, which makes the loss depend on tp; here
both are global, so every tp gives the loss of tp = 1.

The gradient with respect to x_j is p_j - (1 - e) [j = t] - e / v, scaled by
the incoming gradient. Nothing of size [s, b, v/tp] is kept besides the
logits themselves: the forward sums exp(x - m) chunk by chunk and keeps
log Z, and the backward recomputes p from the logits chunk by chunk, writing
the gradient once in the logits' dtype (docs/benchmarks.md has the effect on
a training step). With `grad_in_logits` it writes the gradient over the
logits themselves, as Megatron's cross entropy does: no second [s, b, v/tp]
tensor is allocated. GPTModel, which never hands its logits out when it
computes the loss, uses it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_layers.tensor_parallel import fused_cross_entropy
from mp_layers.tensor_parallel.partition import partition_range
from mp_state import RankGroup

__all__ = ["vocab_parallel_cross_entropy"]


_CHUNK_ROWS = 64
"""Tokens whose [v/tp] row is exponentiated at once: a bounded fp32 buffer."""


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, label_smoothing, grad_in_logits, fused):
        v_local = logits.shape[-1]
        x = logits.reshape(-1, v_local)  # [n, v/tp], n = s * b
        flat_target = target.reshape(-1)
        logits_max = x.amax(dim=-1).float()
        if group.size > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group.group)

        local_target, outside = split_targets(flat_target, v_local, group.rank)
        predicted = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).float() - logits_max
        predicted = predicted.masked_fill(outside, 0.0)

        # exp(x - m) summed chunk by chunk in fp32: no [n, v/tp] temporary is kept,
        # the backward recomputes the softmax from the logits and log Z instead.
        if fused:
            sum_exp, shifted_sum = fused_cross_entropy.sum_exp(x, logits_max, label_smoothing > 0)
        else:
            sum_exp = torch.empty_like(logits_max)
            shifted_sum = torch.empty_like(logits_max) if label_smoothing > 0 else None
            sum_exp_rows(x, logits_max, sum_exp, shifted_sum)
        parts = [predicted, sum_exp] + ([shifted_sum] if shifted_sum is not None else [])
        vocab_size = v_local * group.size
        loss, log_sum_exp, smoothing = combine_and_reduce(parts, group, vocab_size, label_smoothing)

        ctx.save_for_backward(logits, logits_max + log_sum_exp, local_target, outside)
        ctx.smoothing, ctx.vocab_size = smoothing, vocab_size
        ctx.grad_in_logits, ctx.fused = grad_in_logits, fused
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, lse, local_target, outside = ctx.saved_tensors
        x = logits.reshape(-1, logits.shape[-1])
        g = grad_loss.reshape(-1, 1).float()
        # Only the rank holding the target subtracts (1 - e) at its position.
        hit = (~outside).float() * (1.0 - ctx.smoothing)
        grad = x.detach() if ctx.grad_in_logits else torch.empty_like(x)
        rows = fused_cross_entropy.write_gradient if ctx.fused else softmax_gradient_rows
        rows(x, lse, local_target, hit, g, ctx.smoothing, ctx.vocab_size, grad)
        return grad.view(logits.shape), None, None, None, None, None


def sum_exp_rows(
    x: torch.Tensor, m: torch.Tensor, sum_exp: torch.Tensor, shifted_sum: torch.Tensor | None
) -> None:
    """sum_exp[i] = sum_j exp(x[i, j] - m[i]) and, unless None, shifted_sum[i] =
    sum_j (x[i, j] - m[i]) for x [c, v/tp] in any dtype, m [c] fp32, in fp32, through a
    work space of _CHUNK_ROWS rows."""
    buffer = _chunk_buffer(x)
    for rows in chunks(x.shape[0]):
        # One pass reads the logits in their dtype and writes x - m in fp32.
        shifted = torch.sub(x[rows], m[rows].unsqueeze(-1), out=buffer[: rows.stop - rows.start])
        if shifted_sum is not None:
            shifted_sum[rows] = shifted.sum(dim=-1)
        sum_exp[rows] = shifted.exp_().sum(dim=-1)


def softmax_gradient_rows(
    x: torch.Tensor,
    lse: torch.Tensor,
    local_target: torch.Tensor,
    hit: torch.Tensor,
    grad_loss: torch.Tensor,
    smoothing: float,
    vocab_size: int,
    out: torch.Tensor,
) -> None:
    """out = (p - (1 - e) onehot(t) - e / v) * grad_loss for logits x [c, v/tp], with
    p = exp(x - lse), lse = m + log Z [c]; `hit` [c] is 1 - e where this rank holds the
    target, else 0; grad_loss [c, 1]. Written in out's dtype, a piece of _CHUNK_ROWS rows
    at a time after that piece of x is read for the last time, so out may be x itself."""
    buffer = _chunk_buffer(x)
    for rows in chunks(x.shape[0]):
        # Three passes: x - (m + log Z) into the fp32 buffer, exp in place, and the
        # product with grad_loss written in out's dtype.
        part = torch.sub(x[rows], lse[rows].unsqueeze(-1), out=buffer[: rows.stop - rows.start])
        part.exp_()
        if smoothing > 0:
            part.sub_(smoothing / vocab_size)
        part.scatter_add_(-1, local_target[rows].unsqueeze(-1), -hit[rows].unsqueeze(-1))
        torch.mul(part, grad_loss[rows], out=out[rows])


def _chunk_buffer(x: torch.Tensor) -> torch.Tensor:
    """The fp32 work space of one chunk of rows."""
    return torch.empty(min(_CHUNK_ROWS, x.shape[0]), x.shape[1], dtype=torch.float32,
                       device=x.device)  # fmt: skip


def chunks(n: int, size: int = _CHUNK_ROWS):
    """Slices of `size` rows (the last one shorter) covering n rows."""
    for begin in range(0, n, size):
        yield slice(begin, min(begin + size, n))


def split_targets(target: torch.Tensor, v_local: int, rank: int):
    """(local index [n], outside [n]): each target's index in this rank's vocabulary piece
    (0 where the piece does not hold it) and whether the piece does not hold it."""
    start, end = partition_range(v_local, rank)
    outside = (target < start) | (target >= end)
    return (target - start).masked_fill(outside, 0), outside


def combine_and_reduce(
    parts: list[torch.Tensor], group: RankGroup, vocab_size: int, label_smoothing: float
):
    """Per-token loss [n], log Z [n] and the smoothing e, from each rank's parts (x_t - m,
    sum_j exp(x_j - m), and with label smoothing sum_j (x_j - m), all [n] against the
    global maximum m), summed over the group in one all-reduce."""
    summed = torch.stack(parts)
    if group.size > 1:
        dist.all_reduce(summed, group=group.group)
    predicted, sum_exp = summed[0], summed[1]
    log_sum_exp = sum_exp.log()
    loss = log_sum_exp - predicted
    smoothing = 0.0
    if label_smoothing > 0:
        smoothing = label_smoothing * vocab_size / (vocab_size - 1)
        # mean_j log p_j = mean_j (x_j - m) - log Z
        mean_log_probs = summed[2] / vocab_size - log_sum_exp
        loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs
    return loss, log_sum_exp, smoothing


def check_label_smoothing(label_smoothing: float, vocab_size: int) -> None:
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing!r} must be in [0, 1)")
    if label_smoothing > 0 and vocab_size < 2:
        raise ValueError("label_smoothing needs a vocabulary of at least 2 tokens")


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp_group: RankGroup,
    label_smoothing: float = 0.0,
    *,
    grad_in_logits: bool = False,
    fused: bool = False,
) -> torch.Tensor:
    """Per-token loss [s, b] (fp32) of logits [s, b, v/tp] split over tp_group.

    Equals F.cross_entropy(full_logits, target, reduction="none") computed on
    the gathered [s, b, v] logits (with label smoothing, see the module
    docstring for how `label_smoothing` maps to torch's). Differentiable in
    `logits`.

    grad_in_logits: the backward overwrites the logits with their gradient
    instead of allocating one; for logits nothing else reads afterwards
    (another backward that saved them fails on the changed version rather
    than reading the gradient). Needs logits computed by autograd (not a leaf).

    fused: both passes over the logits compiled (fused_cross_entropy.py, Megatron's
    --cross-entropy-loss-fusion): equal within fp32 rounding.
    """
    check_label_smoothing(label_smoothing, logits.shape[-1] * tp_group.size)
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"target.shape={tuple(target.shape)} must be logits.shape[:-1]="
            f"{tuple(logits.shape[:-1])}"
        )
    if grad_in_logits and logits.grad_fn is None:
        raise ValueError(
            "grad_in_logits=True needs logits computed by autograd (they are overwritten by "
            "their gradient), got a tensor without grad_fn"
        )
    return _VocabParallelCrossEntropy.apply(
        logits, target, tp_group, label_smoothing, grad_in_logits, fused
    )
