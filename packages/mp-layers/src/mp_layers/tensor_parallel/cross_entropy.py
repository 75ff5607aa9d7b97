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
the incoming gradient; the backward keeps softmax p [s, b, v/tp] from the
forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_layers.tensor_parallel.partition import partition_range
from mp_state import RankGroup

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, label_smoothing):
        # fp32 whatever the logits' dtype: exp and log need the range.
        x = logits.float()
        logits_max = x.amax(dim=-1)
        if group.size > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group.group)
        # A new tensor: the caller's logits stay untouched.
        shifted = x - logits_max.unsqueeze(-1)

        vocab_per_rank = shifted.shape[-1]
        vocab_size = vocab_per_rank * group.size
        start, end = partition_range(vocab_per_rank, group.rank)
        outside = (target < start) | (target >= end)
        local_target = (target - start).masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        predicted = predicted.masked_fill(outside, 0.0)

        shifted_sum = shifted.sum(dim=-1) if label_smoothing > 0 else None
        # In place: `shifted` is not needed after this, and at [s*b, v/tp] in fp32
        # every extra copy costs hundreds of megabytes of memory traffic.
        exp = shifted.exp_()
        parts = [predicted, exp.sum(dim=-1)]
        if shifted_sum is not None:
            parts.append(shifted_sum)
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

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        ctx.smoothing, ctx.vocab_size, ctx.logits_dtype = smoothing, vocab_size, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        # (softmax - (1 - e) * onehot(target) - e / v) * grad_loss, built in one new
        # tensor; the saved softmax stays intact for a retain_graph second backward.
        g = grad_loss.unsqueeze(-1)
        grad = softmax * g
        if ctx.smoothing > 0:
            grad.sub_(g * (ctx.smoothing / ctx.vocab_size))
        # Only the rank holding the target subtracts (1 - e) at its position.
        hit = (~outside).to(grad.dtype) * (1.0 - ctx.smoothing)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(hit.unsqueeze(-1) * g))
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp_group: RankGroup,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Per-token loss [s, b] (fp32) of logits [s, b, v/tp] split over tp_group.

    Equals F.cross_entropy(full_logits, target, reduction="none") computed on
    the gathered [s, b, v] logits (with label smoothing, see the module
    docstring for how `label_smoothing` maps to torch's). Differentiable in
    `logits`.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing!r} must be in [0, 1)")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"target.shape={tuple(target.shape)} must be logits.shape[:-1]="
            f"{tuple(logits.shape[:-1])}"
        )
    if label_smoothing > 0 and logits.shape[-1] * tp_group.size < 2:
        raise ValueError("label_smoothing needs a vocabulary of at least 2 tokens")
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group, label_smoothing)
