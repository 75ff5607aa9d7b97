"""The output layer and the vocabulary-parallel cross entropy, a chunk of tokens at a time.

Shapes: [s, b] = sequence, batch; n = s * b tokens; h = hidden; v/tp = this
rank's contiguous piece of the vocabulary (the output layer is a
ColumnParallelLinear over v).

    hidden  [s, b, h]     the output layer's input as its matmul sees it: the
                          whole sequence (gathered under sequence parallelism)
    weight  [v/tp, h]     the output layer's local weight
    target  [s, b]        global token ids in [0, v)
    loss    [s, b]        fp32, per token

The loss is vocab_parallel_cross_entropy's (its docstring has the formula,
label smoothing included) of the logits hidden @ weight^T, but the logits
[n, v/tp] are never held whole: the forward computes them for c =
`chunk_tokens` tokens at a time and keeps, per token, this rank's maximum m_r,
sum_j exp(x_j - m_r), the target logit and (for label smoothing) sum_j (x_j -
m_r). After the last chunk the ranks combine them with the same two
collectives over [n] as the unchunked loss: an all-reduce MAX gives m, then
one all-reduce SUM carries x_t - m, Z = sum_r exp(m_r - m) sum_j exp(x_j - m_r)
and sum_j (x_j - m) = sum_r (sum_j (x_j - m_r) + (v/tp) (m_r - m)).

The forward saves only the input, the weight, m + log Z and the targets. The
backward recomputes each chunk's logits, forms the softmax gradient g in fp32
and, in the matmul dtype, adds g @ W to the input gradient and g^T @ x to the
weight gradient. The weight gradient accumulates in the weight's dtype: fp32
for fp32 weights (and under autocast); for bf16 or fp16 weights each chunk's
product is added by one addmm (GEMMs accumulate in fp32 and round the running
sum once per chunk), because an fp32 accumulator of [v/tp, h] would take as
much memory as the bf16 logits of 2h tokens, which is what this saves.

Memory: [c, v/tp] logits in the matmul dtype (the backward writes their
gradient over them) and vocab_parallel_cross_entropy's fp32 work space of 64
rows, instead of [n, v/tp] logits. Time: one more [n, h] x [h, v/tp] GEMM (the
backward's recomputation), a third more of the output layer's FLOPs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_layers.tensor_parallel import fused_cross_entropy
from mp_layers.tensor_parallel.cross_entropy import (
    check_label_smoothing,
    chunks,
    combine_and_reduce,
    softmax_gradient_rows,
    split_targets,
    sum_exp_rows,
)
from mp_state import RankGroup

__all__ = ["chunked_linear_cross_entropy"]


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, group, label_smoothing, chunk_tokens, fused):
        device_type = hidden.device.type
        dtype = (
            torch.get_autocast_dtype(device_type)
            if torch.is_autocast_enabled(device_type)
            else hidden.dtype
        )
        x = hidden.reshape(-1, hidden.shape[-1]).to(dtype)  # [n, h]
        w = weight.to(dtype)  # [v/tp, h]
        n, v_local = x.shape[0], w.shape[0]
        local_target, outside = split_targets(target.reshape(-1), v_local, group.rank)

        local_max = torch.empty(n, dtype=torch.float32, device=x.device)
        sum_exp, target_logit = torch.empty_like(local_max), torch.empty_like(local_max)
        shifted_sum = torch.empty_like(local_max) if label_smoothing > 0 else None
        with torch.autocast(device_type, enabled=False):
            for rows in chunks(n, chunk_tokens):
                logits = torch.mm(x[rows], w.t())  # [c, v/tp]
                target_logit[rows] = logits.gather(-1, local_target[rows].unsqueeze(-1))[:, 0]
                local_max[rows] = logits.amax(dim=-1)
                if fused:
                    e, shifted = fused_cross_entropy.sum_exp(
                        logits, local_max[rows], shifted_sum is not None
                    )
                    sum_exp[rows] = e
                    if shifted is not None:
                        shifted_sum[rows] = shifted
                else:
                    shifted = shifted_sum[rows] if shifted_sum is not None else None
                    sum_exp_rows(logits, local_max[rows], sum_exp[rows], shifted)
                del logits

        logits_max = local_max.clone()
        if group.size > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group.group)
            # Rebase this rank's sums from its own maximum onto the global one.
            offset = local_max - logits_max
            sum_exp.mul_(offset.exp())
            if shifted_sum is not None:
                shifted_sum.add_(offset, alpha=v_local)
        predicted = (target_logit - logits_max).masked_fill(outside, 0.0)
        parts = [predicted, sum_exp] + ([shifted_sum] if shifted_sum is not None else [])
        loss, log_sum_exp, smoothing = combine_and_reduce(
            parts, group, v_local * group.size, label_smoothing
        )

        ctx.save_for_backward(hidden, weight, logits_max + log_sum_exp, local_target, outside)
        ctx.smoothing, ctx.vocab_size = smoothing, v_local * group.size
        ctx.dtype, ctx.chunk_tokens, ctx.fused = dtype, chunk_tokens, fused
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, lse, local_target, outside = ctx.saved_tensors
        dtype, device_type = ctx.dtype, hidden.device.type
        x = hidden.reshape(-1, hidden.shape[-1]).to(dtype)
        w = weight.to(dtype)
        n = x.shape[0]
        g = grad_loss.reshape(-1, 1).float()
        hit = (~outside).float() * (1.0 - ctx.smoothing)

        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = torch.empty_like(x) if want_x else None
        grad_w = torch.zeros_like(weight) if want_w else None
        gradient_rows = fused_cross_entropy.write_gradient if ctx.fused else softmax_gradient_rows
        with torch.autocast(device_type, enabled=False):
            for rows in chunks(n, ctx.chunk_tokens):
                logits = torch.mm(x[rows], w.t())  # recomputed, [c, v/tp]
                # The loss's gradient in the logits' place, in the matmul dtype.
                gradient_rows(
                    logits,
                    lse[rows],
                    local_target[rows],
                    hit[rows],
                    g[rows],
                    ctx.smoothing,
                    ctx.vocab_size,
                    out=logits,
                )
                if want_x:
                    torch.mm(logits, w, out=grad_x[rows])
                if want_w and grad_w.dtype == dtype:
                    grad_w.addmm_(logits.t(), x[rows])
                elif want_w:  # fp32 weights under autocast: add the product in fp32
                    grad_w.add_(logits.t() @ x[rows])
                del logits
        if want_x:
            grad_x = grad_x.view(hidden.shape)
        return grad_x, grad_w, None, None, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    tp_group: RankGroup,
    chunk_tokens: int,
    label_smoothing: float = 0.0,
    *,
    fused: bool = False,
) -> torch.Tensor:
    """Per-token loss [s, b] (fp32) of the logits hidden [s, b, h] @ weight[v/tp, h]^T.

    Equals vocab_parallel_cross_entropy(F.linear(hidden, weight), target,
    tp_group, label_smoothing) with its gradients in hidden and weight, without
    holding more than `chunk_tokens` tokens' logits at once (see the module
    docstring). `hidden` is the output layer's input after its tensor-parallel
    mapping (ColumnParallelLinear.matmul_input), whose backward sums the ranks'
    input gradients. Under autocast the matmuls run in its dtype, as F.linear's do.
    fused: each chunk's passes over its logits compiled (fused_cross_entropy.py).
    """
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r} must be a positive integer")
    check_label_smoothing(label_smoothing, weight.shape[0] * tp_group.size)
    if hidden.dim() < 2 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden.shape={tuple(hidden.shape)} must end with weight.shape[1] "
            f"(weight.shape={tuple(weight.shape)})"
        )
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"target.shape={tuple(target.shape)} must be hidden.shape[:-1]="
            f"{tuple(hidden.shape[:-1])}"
        )
    if hidden.dtype != weight.dtype and not torch.is_autocast_enabled(hidden.device.type):
        raise ValueError(
            f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype "
            "outside autocast"
        )
    return _ChunkedLinearCrossEntropy.apply(
        hidden, weight, target, tp_group, label_smoothing, chunk_tokens, fused
    )
