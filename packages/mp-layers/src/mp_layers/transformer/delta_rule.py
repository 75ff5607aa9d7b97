"""The gated delta rule (Yang, Kautz and Hatamizadeh 2024), chunk by chunk: the token mixer
of gated DeltaNet layers (gated_delta_net.py).

Per head, a state S [dk, dv] (S_0 = 0, or a given state), and at each position t with a
query q_t and key k_t [dk] (L2-normalized), a value v_t [dv], a log-decay g_t <= 0 and a
write strength beta_t in (0, 1):

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T
    o_t = S_t^T q_t / sqrt(dk)

`recurrent_delta_rule` runs that loop, position by position (the reference of the tests).
`chunked_delta_rule` computes the same over chunks of C positions with matrix products
(the WY / UT form of the DeltaNet papers): within a chunk, with the decays between
positions i >= j, D_ij = exp(G_i - G_j) (G the cumulative sum of g from the chunk's
start), the corrections u of the writes solve the unit lower-triangular system

    (I + strictly_lower(diag(beta) K K^T * D)) [U | W] = [diag(beta) V | diag(beta) K exp(G)]

so that, from the chunk's initial state S, u = U - W S, the outputs are
(Q exp(G)) S + (Q K^T * D) u for the positions of the chunk, and the next state is
exp(G_C) S + (K exp(G_C - G))^T u. Everything runs in fp32 (fp64 for fp64 inputs).

Packed documents (document ids [b, s]): each document is mixed as if alone: the products
D and K K^T keep only pairs of one document, and the state a chunk starts from reaches
only the positions of the document that was running when the chunk began.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["chunked_delta_rule", "recurrent_delta_rule"]


def recurrent_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """q, k [b, s, h, dk], v [b, s, h, dv], g, beta [b, s, h] -> (outputs [b, s, h, dv],
    the final state [b, h, dk, dv]), in fp32 (or fp64), position by position."""
    dtype = _at_least_fp32(v)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    b, s, h, dk = k.shape
    state = k.new_zeros(b, h, dk, v.shape[-1]) if initial is None else initial.to(dtype)
    q = q * dk**-0.5
    out = []
    for t in range(s):
        state = state * g[:, t].exp()[..., None, None]
        read = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta = (v[:, t] - read) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(out, dim=1), state


def chunked_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    chunk: int = 64, initial: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """As recurrent_delta_rule, over chunks of `chunk` positions (module docstring).
    documents [b, s]: each position's document id, a document a run of equal ids (an id
    may come back for another document); a document's first position starts from a zero
    state (not with an initial state)."""
    if documents is not None and initial is not None:
        raise ValueError("chunked_delta_rule takes an initial state or documents, not both")
    b, s, h, dk = k.shape
    dv = v.shape[-1]
    pad = -s % chunk
    n = (s + pad) // chunk
    # [b, h, n, C, ...]; the padding positions write nothing (beta 0) and keep the state
    dtype = _at_least_fp32(v)
    q, k, v = (F.pad(x.to(dtype), (0, 0, 0, 0, 0, pad)).transpose(1, 2) for x in (q, k, v))
    g, beta = (F.pad(x.to(dtype), (0, 0, 0, pad)).transpose(1, 2) for x in (g, beta))
    q, k, v = (x.reshape(b, h, n, chunk, -1) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, chunk), beta.reshape(b, h, n, chunk)
    q = q * dk**-0.5
    cum = g.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    carry = None  # [b, 1, n, C]: the position continues the document running at the chunk's start
    if documents is not None:
        documents = F.pad((documents[:, 1:] != documents[:, :-1]).cumsum(1), (1, 0))  # runs
        docs = torch.cat([documents, documents[:, -1:].expand(b, pad)], dim=1)  # the last's
        docs = docs.reshape(b, 1, n, chunk)
        same = docs[..., :, None] == docs[..., None, :]
        decay = decay * same
        before = torch.cat([docs[..., :1, :1], docs[..., :-1, -1:]], dim=2)  # [b, 1, n, 1]
        carry = (docs == before).to(dtype)
    kb, vb = k * beta[..., None], v * beta[..., None]
    system = (kb @ k.transpose(-1, -2)) * decay
    system = system.tril(-1) + torch.eye(
        chunk, dtype=dtype, device=k.device
    )  # unit lower triangular
    read_decay = cum.exp() if carry is None else cum.exp() * carry
    solved = torch.linalg.solve_triangular(
        system, torch.cat([vb, kb * read_decay[..., None]], dim=-1), upper=False,
        unitriangular=True,
    )  # fmt: skip
    u_new, w = solved.split([dv, dk], dim=-1)
    q_read = q * read_decay[..., None]
    attend = (q @ k.transpose(-1, -2)) * decay
    last = cum[..., -1:]  # [b, h, n, 1]
    write = (last - cum).exp()
    if documents is not None:
        write = write * same[..., -1, :]  # only the document running at the chunk's end
        state_decay = last.exp() * carry[..., -1:]
    else:
        state_decay = last.exp()
    k_write = k * write[..., None]
    state = k.new_zeros(b, h, dk, dv) if initial is None else initial.to(dtype)
    out = []
    for i in range(n):
        u = u_new[:, :, i] - w[:, :, i] @ state
        out.append(q_read[:, :, i] @ state + attend[:, :, i] @ u)
        state = state * state_decay[:, :, i, :, None] + k_write[:, :, i].transpose(-1, -2) @ u
    out = torch.stack(out, dim=2).reshape(b, h, n * chunk, dv)[:, :, :s]
    return out.transpose(1, 2), state


def _at_least_fp32(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)
