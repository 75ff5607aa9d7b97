"""The router's auxiliary losses and how their gradient reaches the parameters.

Load balancing (Switch Transformer, Fedus et al., 2021), over the T tokens of a
micro-batch, E experts, top-k routing:

    loss = coeff * E / (k T^2) * sum_i n_i * sum_t p_t,i

n_i the tokens routed to expert i, p_t,i the scores of token t (a softmax over all
experts, or normalized sigmoids). With sequence parallelism a rank holds T / tp tokens:
n_i is summed over the tensor-parallel group and T is the whole micro-batch's, while
the scores stay local, so the ranks' losses add up to the micro-batch's loss and their
router gradients (summed over the group like every sequence-parallel weight's) to its
gradient. The per-sequence variant computes the same for each sequence of s tokens and
averages over the b sequences. The z-loss (ST-MoE, Zoph et al., 2022) is
coeff * mean_t logsumexp(logits_t)^2, its coefficient divided by tp for the same sum.

The losses never join `lm loss`: `attach` makes the router's output carry them, so that
backward adds d(loss)/d(scores) scaled by the factor an `AuxLossScale` holds when backward
runs. Each router holds one (`aux_loss_scale`, 1 until set); the training step shares its
own with every router of the model chunks (`share_aux_loss_scale`) and sets it before
each step's micro-batches: the loss scale / number of micro-batches, the same factor the
main loss gets, times cp as in Megatron. The pipeline schedules need not know about them.
Multi-token prediction's losses reach the gradients the same way, through the MTP
modules' scale of kind "mtp" (Megatron's MTPLossAutoScaler, without the cp), and the
sparse-attention indexers' losses through their scale of kind "dsa" (Megatron's
DSAIndexerLossAutoScaler, the routers' factor).
"""

from __future__ import annotations

import torch

__all__ = [
    "AuxLossScale",
    "attach",
    "load_balancing_loss",
    "share_aux_loss_scale",
    "z_loss",
]

KINDS = ("moe", "mtp", "dsa")


class AuxLossScale:
    """The factor the gradients of one kind of auxiliary loss get in backward: the
    routers' ("moe"), multi-token prediction's ("mtp") or the sparse-attention indexers'
    ("dsa"). 1 until set."""

    def __init__(self, kind: str = "moe", scale: float | torch.Tensor = 1.0) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r}: an auxiliary loss scale is one of {KINDS}")
        self.kind = kind
        self.set(scale)

    def set(self, scale: float | torch.Tensor) -> None:
        self.value = torch.as_tensor(scale, dtype=torch.float32).detach().clone()

    def __repr__(self) -> str:
        return f"AuxLossScale({self.kind!r}, {float(self.value)})"


def share_aux_loss_scale(modules, scale: AuxLossScale) -> int:
    """Makes every module of `modules` (model chunks) that holds a scale of `scale.kind`
    (routers, the multi-token prediction modules) hold `scale` instead, so that setting it
    sets theirs; returns how many do."""
    shared = 0
    for module in (m for chunk in modules for m in chunk.modules()):
        held = getattr(module, "aux_loss_scale", None)
        if isinstance(held, AuxLossScale) and held.kind == scale.kind:
            module.aux_loss_scale = scale
            shared += 1
    return shared


def load_balancing_loss(
    scores: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_tokens: int,
    topk: int,
    experts: int,
    coeff: float,
) -> torch.Tensor:
    """coeff * E / (k T^2) * sum_i n_i sum_t scores[t, i]; scores [t, E] (this rank's
    tokens), tokens_per_expert [E] (n_i over the T tokens)."""
    per_expert = scores.float().sum(dim=0)
    return (per_expert * tokens_per_expert.float()).sum() * (
        coeff * experts / (topk * total_tokens * total_tokens)
    )


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """coeff * mean over tokens of logsumexp(logits)^2; logits [t, E]."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean() * coeff


def attach(activation: torch.Tensor, loss: torch.Tensor, scale: AuxLossScale) -> torch.Tensor:
    """`activation` unchanged; in backward, `loss` receives the gradient scale.value (as
    it is then)."""
    return _AttachLoss.apply(activation, loss, scale)


class _AttachLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, activation, loss, scale):
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return activation.view_as(activation)

    @staticmethod
    def backward(ctx, grad):
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss) * ctx.scale.value.to(loss.device), None
