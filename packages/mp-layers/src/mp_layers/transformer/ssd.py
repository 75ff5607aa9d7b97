"""The selective state-space scan of Mamba-2 (Dao and Gu, 2024, "state space duality"), in
plain torch: what Megatron's mamba_chunk_scan_combined kernel computes.

Per head, with a state S [p, n] (p the head's channels, n the state size) starting at 0
(or `initial`):

    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T        y_t = S_t C_t + D x_t

Shapes: x [b, s, h, p], dt [b, s, h] (already through softplus), A and D [h] (A < 0),
B and C [b, s, g, n] for g groups of heads (head j uses group j // (h / g)). Computed in
fp32.

`chunked_scan` splits the sequence into chunks of `chunk` positions: within a chunk the
outputs come from the quadratic form y_i = sum_{j <= i} (C_i . B_j) exp(a_i - a_j) dt_j x_j
(a the cumulative sum of dt A within the chunk), a causal masked matmul as attention's;
each chunk's final state is carried to the next by a short loop over the chunks, and
reaches the outputs as C_i S_start exp(a_i). `recurrent_step` advances the state by one
position, as generation does. Both give the recurrence's values (test_mamba_mixer.py
checks them against it position by position).

Packed documents (`documents` [b, s], a document a run of equal ids; Megatron's seq_idx):
the state restarts at 0 at each document's first position, as if each document were
scanned alone. Within a chunk the pairs of two documents are masked out of the quadratic
form and out of the chunk's final state, a state carried into a chunk reaches only the
positions of its own document, and it leaves the chunk only if no document starts there
(test_mamba_mixer.py checks it against each document scanned alone).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["chunked_scan", "recurrent_step"]


def chunked_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    chunk: int,
    initial: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [b, s, h, p], the final state [b, h, p, n]), all fp32 (module docstring);
    `initial` is the state before the first document."""
    b, s, h, p = x.shape
    n = B.shape[-1]
    per_group = h // B.shape[2]
    x, dt = x.float(), dt.float()
    B, C = (t.float().repeat_interleave(per_group, dim=2) for t in (B, C))
    pad = (-s) % chunk
    if pad:  # dt = 0 past the end: no decay and no input, the final state unchanged
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        dt = F.pad(dt, (0, 0, 0, pad))
    chunks = (s + pad) // chunk
    runs = None if documents is None else _run_numbers(documents, pad).view(b, chunks, chunk)
    x = x.view(b, chunks, chunk, h, p)
    B, C = B.view(b, chunks, chunk, h, n), C.view(b, chunks, chunk, h, n)
    dt = dt.view(b, chunks, chunk, h)
    a = torch.cumsum(dt * A.float(), dim=2)  # [b, c, l, h]: log decay from the chunk's start
    # Within each chunk: exp(a_i - a_j) for j <= i, 0 above the diagonal.
    pairs = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    if runs is not None:  # and within one document
        pairs = pairs & (runs[:, :, :, None] == runs[:, :, None, :])
    gaps = (a[:, :, :, None, :] - a[:, :, None, :, :]).masked_fill(~pairs[..., None], -torch.inf)
    scores = torch.einsum("bcihn,bcjhn->bcijh", C, B) * torch.exp(gaps)
    inputs = x * dt[..., None]  # dt_j x_j
    y = torch.einsum("bcijh,bcjhp->bcihp", scores, inputs)
    # Each chunk's own contribution to its final state, then the states chunk to chunk.
    to_end = torch.exp(a[:, :, -1:, :] - a)  # [b, c, l, h]
    decay = torch.exp(a[:, :, -1, :])  # [b, c, h]: the whole chunk's decay
    if runs is not None:
        # The document of the state entering each chunk (the first one's for the first):
        # it reaches the positions of that document only, and passes the chunk only if
        # the chunk ends in it; a chunk's own inputs reach its end from its last document.
        entering = torch.cat([runs[:, :1, 0], runs[:, :-1, -1]], dim=1)  # [b, c]
        reached = runs == entering[..., None]  # [b, c, l]
        decay = decay * reached[:, :, -1, None]
        to_end = to_end * (runs == runs[:, :, -1:])[..., None]
    added = torch.einsum("bclhn,bclhp->bchpn", B * to_end[..., None], inputs)
    state = x.new_zeros(b, h, p, n) if initial is None else initial.float()
    starts = []
    for c in range(chunks):
        starts.append(state)
        state = state * decay[:, c, :, None, None] + added[:, c]
    start = torch.stack(starts, dim=1)  # [b, c, h, p, n]
    carried = torch.exp(a) if runs is None else torch.exp(a) * reached[..., None]
    y = y + torch.einsum("bcihn,bchpn->bcihp", C, start) * carried[..., None]
    y = (
        y.reshape(b, chunks * chunk, h, p)[:, :s]
        + D.float()[:, None] * x.reshape(b, chunks * chunk, h, p)[:, :s]
    )
    return y, state


def _run_numbers(documents: torch.Tensor, pad: int) -> torch.Tensor:
    """[b, s] document ids -> [b, s + pad] the number of each position's run of equal ids
    in its sample (0, 0, 1, 1, 1, 2, ...), the padding in the last run."""
    change = documents[:, 1:] != documents[:, :-1]
    runs = torch.cat([torch.zeros_like(change[:, :1]), change], dim=1).long().cumsum(dim=1)
    return torch.cat([runs, runs[:, -1:].expand(-1, pad)], dim=1)


def recurrent_step(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One position: state [b, h, p, n], x [b, h, p], dt [b, h], B and C [b, g, n] ->
    (y [b, h, p], the next state), fp32."""
    per_group = x.shape[1] // B.shape[1]
    B, C = (t.repeat_interleave(per_group, dim=1) for t in (B, C))
    x, dt = x.float(), dt.float()
    decay = torch.exp(dt * A.float())[..., None, None]
    state = state.float() * decay + (dt[..., None] * x)[..., None] * B.float()[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", state, C.float()) + D.float()[:, None] * x
    return y, state
