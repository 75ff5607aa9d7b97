"""The two passes of the vocabulary-parallel cross entropy over the logits, compiled
(Megatron's --cross-entropy-loss-fusion, its native implementation).

cross_entropy.py reads the logits [n, v/tp] twice: the forward sums exp(x - m) row by
row, the backward writes (softmax - target) x grad_loss. Unfused, each pass is a
sequence of elementwise kernels over pieces of 64 rows through an fp32 work space
(subtract, exp, sum; subtract, exp, scatter, multiply): on a GPU with a 128k
vocabulary that is 512 kernels and about ten reads and writes of each logit per
iteration. Compiled (torch.compile, inductor), each pass is one kernel per piece that
reads the logits once in their dtype and, in the backward, writes the gradient once:
no fp32 work space.

    sum_exp(x, m, shifted)       -> sum_j exp(x_ij - m_i), and sum_j (x_ij - m_i) or None
    write_gradient(x, lse, t, hit, g, e, v, out)
                                 out = (exp(x - lse) - e / v - hit [j = t]) * g

Both take pieces of _ROWS rows, so that whatever inductor allocates per call stays
bounded; `out` may be `x` itself (each piece is read before it is written). The
results equal the unfused passes' within fp32 rounding (the sums are reduced in
another order).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["sum_exp", "write_gradient"]

_ROWS = 1024
"""Rows of logits per compiled call."""


def sum_exp(
    x: torch.Tensor, m: torch.Tensor, shifted: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """sum_j exp(x_ij - m_i) [n] (fp32) for logits x [n, v/tp] in any dtype and m [n] fp32;
    with `shifted`, sum_j (x_ij - m_i) too (label smoothing)."""
    exp_sums, shifted_sums = [], []
    for rows in _pieces(x.shape[0]):
        e, s = _compiled_sum_exp()(x[rows], m[rows], shifted)
        exp_sums.append(e)
        shifted_sums.append(s)
    exp_sum = torch.cat(exp_sums)
    return exp_sum, torch.cat(shifted_sums) if shifted else None


def write_gradient(
    x: torch.Tensor,
    lse: torch.Tensor,
    local_target: torch.Tensor,
    hit: torch.Tensor,
    grad_loss: torch.Tensor,
    smoothing: float,
    vocab_size: int,
    out: torch.Tensor,
) -> None:
    """out = (exp(x - lse) - e / v - hit [j = t]) * grad_loss in out's dtype: the
    arguments of cross_entropy.softmax_gradient_rows."""
    offset = smoothing / vocab_size
    in_place = out.data_ptr() == x.data_ptr()  # one input, not two aliasing ones
    for rows in _pieces(x.shape[0]):
        args = (x[rows], lse[rows], local_target[rows], hit[rows], grad_loss[rows], offset)
        if in_place:
            _compiled_gradient_in_place()(*args)
        else:
            _compiled_gradient()(*args, out[rows])


def _sum_exp(x, m, shifted: bool):
    centered = x.float() - m.unsqueeze(-1)
    return centered.exp().sum(-1), centered.sum(-1) if shifted else None


def _softmax_gradient(x, lse, target, hit, grad_loss, offset):
    p = (x.float() - lse.unsqueeze(-1)).exp() - offset
    columns = torch.arange(x.shape[-1], device=x.device)
    return (p - torch.where(columns == target.unsqueeze(-1), hit.unsqueeze(-1), 0.0)) * grad_loss


def _gradient(x, lse, target, hit, grad_loss, offset, out):
    out.copy_(_softmax_gradient(x, lse, target, hit, grad_loss, offset))


def _gradient_in_place(x, lse, target, hit, grad_loss, offset):
    x.copy_(_softmax_gradient(x, lse, target, hit, grad_loss, offset))


@functools.cache
def _compiled_sum_exp():
    return torch.compile(_sum_exp, dynamic=None)


@functools.cache
def _compiled_gradient():
    return torch.compile(_gradient, dynamic=None)


@functools.cache
def _compiled_gradient_in_place():
    return torch.compile(_gradient_in_place, dynamic=None)


def _pieces(n: int):
    for begin in range(0, n, _ROWS):
        yield slice(begin, min(begin + _ROWS, n))
