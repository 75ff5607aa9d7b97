"""DeepSeek sparse attention (DSA; DeepSeek-V3.2-Exp, DeepSeek-AI 2025): a lightning
indexer picks, for each query, the dsa_indexer_topk earlier positions the multi-latent
attention heads attend to (TransformerConfig.experimental_attention_variant "dsa";
Megatron's DSAttention and DSAIndexer).

Shapes: x [s, b, h] the layer's input (whole sequences: gathered under sequence
parallelism), q_in [s, b, rq] the query latent after q_layernorm (x without
q_lora_rank); the indexer's n heads of d channels.

    q  = linear_wq_b(q_in)                          [s, b, n, d]
    k  = k_norm(linear_wk(x))                       [s, b, d]    (a LayerNorm, one key)
    w  = linear_weights_proj(x) / sqrt(n) / sqrt(d) [s, b, n]
    score(i, j) = sum_h w[i, h] relu(q[i, h] . k[j])

The first qk_pos_emb_head_dim channels of q and k are rotated with the layer's rotary
embeddings, in halves (i, i + dr/2) by default (DeepSeek's indexer) or in interleaved
pairs (dsa_indexer_rope_interleaved); with dsa_indexer_rotate_activation both are then
multiplied by an orthonormal Hadamard matrix, which keeps q . k but for rounding. Query i
attends to the dsa_indexer_topk positions j <= i of highest score (all of them when
there are no more; within its document when the batch is packed: PackedSeqParams); the
attention itself is the layer's, under that mask.

The indexer takes x and q_in detached and the chosen positions carry no gradient, so the
language-model loss does not train it. Its own loss (dsa_indexer_loss_coeff) is, per
query, the KL divergence from the main attention's probabilities (each head's softmax of
its logits, from the detached queries and keys, summed over the heads of every
tensor-parallel rank and normalized) to the indexer's softmax over the same positions:
every earlier position, or the chosen ones with dsa_indexer_use_sparse_loss. It is
averaged over the micro-batch's queries (summed with calculate_per_token_loss) and
attached to the attention's output (moe.aux_losses.attach), whose backward gives it the
training step's factor (an AuxLossScale of kind "dsa"). The tensor-parallel ranks hold
the same indexer and compute the same loss, so their gradients agree without a reduction.

Under context parallelism a rank's queries are its two load-balanced chunks: the indexer
keys, and the attention's keys and values, are all-gathered in order (gather_sequence),
the allowed positions causal by the queries' places in the whole sequence
(causal_over_ranks), and the attention runs over them (masked_attention). Layers that
reuse another's choice (dsa_indexer_topk_freq) hold no indexer (multi_latent_attention.py).

Memory: the scores [b, s, s] and the chosen positions; the per-head products behind them
(the indexer's q . k, [b, s, n, s], and with the loss the main attention's logits of this
rank's heads, [b, heads, s, s]) are computed CHUNK_BYTES at a time, a block of queries
after another, and the indexer's recomputed in backward (Megatron's reference path
computes them whole; its fused kernels avoid them).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from mp_layers.config import TransformerConfig
from mp_layers.context_parallel.layout import local_positions
from mp_layers.moe.aux_losses import AuxLossScale, attach
from mp_layers.tensor_parallel import gather_from_sequence_parallel_region
from mp_layers.transformer.recompute import recomputing
from mp_layers.transformer.rope import Rotary, apply_rotary_pos_emb
from mp_state import RankGroup

__all__ = [
    "LightningIndexer",
    "causal_over_ranks",
    "chosen_positions",
    "gather_sequence",
    "hadamard",
    "index_scores",
    "indexer_loss",
    "masked_attention",
]

_EPS = 1e-10
"""The floor of the target's sum and of its logarithm's argument (Megatron's)."""
CHUNK_BYTES = 256 * 2**20
"""The fp32 bytes of per-head products (the indexer's q . k, the attention logits of the
loss's target) computed at once: a block of queries at a time, so that a layer keeps the
scores [b, s, t], not [b, s, n, t]."""


@functools.cache
def _hadamard_matrix(d: int) -> torch.Tensor:
    """The Sylvester Hadamard matrix of size d (a power of 2), divided by sqrt(d)."""
    m = torch.ones(1, 1, dtype=torch.float64)
    while m.shape[0] < d:
        m = torch.cat([torch.cat([m, m], 1), torch.cat([m, -m], 1)], 0)
    return m / d**0.5


def hadamard(t: torch.Tensor) -> torch.Tensor:
    """t [..., d] times the orthonormal Hadamard matrix of size d (a power of 2)."""
    return t @ _hadamard_matrix(t.shape[-1]).to(t.device, t.dtype)


class LightningIndexer(torch.nn.Module):
    """The indexer's projections (module docstring), replicated on the tensor-parallel
    ranks; `linear` builds a replicated linear layer (in, out) returning (y, bias)."""

    def __init__(self, config: TransformerConfig, linear) -> None:
        super().__init__()
        self.n, self.d = config.dsa_indexer_n_heads, config.dsa_indexer_head_dim
        self.dr = config.qk_pos_emb_head_dim
        h = config.hidden_size
        self.linear_wq_b = linear(config.q_lora_rank or h, self.n * self.d)
        self.linear_wk = linear(h, self.d)
        eps = config.dsa_indexer_k_norm_epsilon or config.layernorm_epsilon
        self.k_norm = torch.nn.LayerNorm(self.d, eps=eps, dtype=config.params_dtype)
        self.linear_weights_proj = linear(h, self.n)
        self.interleaved = config.dsa_indexer_rope_interleaved
        self.rotate = config.dsa_indexer_rotate_activation
        self.relu = config.dsa_indexer_scoring_relu
        self.k_norm_fp32 = config.dsa_indexer_k_norm_fp32
        self.loss_coeff = config.dsa_indexer_loss_coeff or 0.0
        self.sparse_loss = config.dsa_indexer_use_sparse_loss
        self.per_token_loss = False
        """Sum the loss over the queries instead of averaging it (GPTModel sets it with
        calculate_per_token_loss)."""
        self.aux_loss_scale = AuxLossScale("dsa")
        """The factor the indexer loss gets in backward (the training step shares its own:
        mp_layers.moe.share_aux_loss_scale)."""
        self.loss_total = torch.zeros(())
        """The indexer losses (times loss_coeff) since the last `take_loss`, for the log."""

    def forward(self, x: torch.Tensor, q_in: torch.Tensor, rotary: Rotary):
        """x [s, b, h], q_in [s, b, rq] -> q [s, b, n, d], k [s, b, d], w [s, b, n]."""
        s, b = x.shape[:2]
        q = self.linear_wq_b(q_in)[0].view(s, b, self.n, self.d)
        k = self.linear_wk(x)[0]
        if self.k_norm_fp32:  # the norm's parameters taken to fp32 too
            norm = self.k_norm
            k = F.layer_norm(k.float(), norm.normalized_shape, norm.weight.float(),
                             norm.bias.float(), norm.eps).to(k.dtype)  # fmt: skip
        else:
            k = self.k_norm(k)
        q, k = self._rope(q, rotary), self._rope(k[:, :, None], rotary)[:, :, 0]
        if self.rotate:
            q, k = hadamard(q), hadamard(k)
        w = self.linear_weights_proj(x)[0] * (self.n**-0.5 * self.d**-0.5)
        return q, k, w

    def attach_loss(self, output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        """output unchanged; in backward, loss_coeff x loss gets the aux_loss_scale. Counted
        for the log once per forward: not again when a recompute reruns the layer."""
        loss = loss * self.loss_coeff
        if not recomputing():
            if self.loss_total.device != loss.device:
                self.loss_total = self.loss_total.to(loss.device)
            self.loss_total += loss.detach().float()
        return attach(output, loss, self.aux_loss_scale)

    def take_loss(self) -> torch.Tensor:
        taken, self.loss_total = self.loss_total, torch.zeros_like(self.loss_total)
        return taken

    def _rope(self, t: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """Rotates the first dr channels of t [s, b, heads, d] (module docstring)."""
        rot, rest = t[..., : self.dr], t[..., self.dr :]
        if self.interleaved:  # pairs (2i, 2i + 1) regrouped as halves, as MLA's
            rot = torch.cat([rot[..., 0::2], rot[..., 1::2]], dim=-1)
        return torch.cat([apply_rotary_pos_emb(rot, rotary), rest], dim=-1)


def _query_rows(b: int, heads: int, t: int) -> int:
    """How many queries' [b, heads, t] fp32 products fit in CHUNK_BYTES (at least one)."""
    return max(1, CHUNK_BYTES // (4 * b * heads * t))


def _scores_block(q, k, w, relu: bool) -> torch.Tensor:
    logits = torch.einsum("sbnd,tbd->bsnt", q.float(), k.float())
    if relu:
        logits = torch.relu(logits)
    return torch.einsum("bsnt,sbn->bst", logits, w.float())


def index_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, relu: bool) -> torch.Tensor:
    """q [s, b, n, d], k [t, b, d], w [s, b, n] -> the indexer's scores [b, s, t], fp32,
    computed CHUNK_BYTES of per-head products at a time; where they have a graph, each
    block's products are recomputed in backward instead of kept."""
    s, b, n = q.shape[:3]
    rows = _query_rows(b, n, k.shape[0])
    if rows >= s:
        return _scores_block(q, k, w, relu)
    graph = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, w))
    blocks = []
    for a in range(0, s, rows):
        part = (q[a : a + rows], k, w[a : a + rows], relu)
        blocks.append(checkpoint(_scores_block, *part, use_reentrant=False) if graph
                      else _scores_block(*part))  # fmt: skip
    return torch.cat(blocks, dim=1)


def chosen_positions(scores: torch.Tensor, allowed: torch.Tensor, topk: int) -> torch.Tensor:
    """scores [b, s, t], allowed [b or 1, s, t] bool -> [b, s, t] bool: the topk allowed
    positions of highest score in each row (all allowed ones when there are fewer), by
    torch.topk as Megatron's and transformers' indexers choose. Among equal scores its
    choice depends on the row's length: a key that the ReLU zeroes in every indexer head
    (one in 2^n with n heads and random weights) scores exactly 0, and where such ties
    straddle the top-k boundary a cached generation step may choose otherwise than the
    whole sequence's forward, as in transformers. (A stable sort would break ties alike in
    both, but otherwise than Megatron, whose checkpoints then would not give its logits.)"""
    scores = scores.detach().masked_fill(~allowed, float("-inf"))
    top = scores.topk(min(topk, scores.shape[-1]), dim=-1).indices
    chosen = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    return chosen.scatter_(-1, top, True) & allowed


def indexer_loss(
    scores: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    softmax_scale: float,
    valid: torch.Tensor,
    tp_group: RankGroup,
    per_token: bool,
) -> torch.Tensor:
    """KL(target || indexer) per query (module docstring), averaged over the queries
    (summed: per_token). scores [b, s, t] the indexer's (with their gradient); query
    [s, b, heads, dq] and key [t, b, heads, dq] this rank's heads (detached here); valid
    [b or 1, s, t] bool, the positions both distributions cover."""
    target = _attention_target(query.detach(), key.detach(), softmax_scale, valid)
    if tp_group.size > 1:  # the other ranks' heads
        dist.all_reduce(target, group=tp_group.group)
    target = target / target.sum(dim=-1, keepdim=True).clamp_min(_EPS)
    log_p = torch.log_softmax(scores.masked_fill(~valid, float("-inf")), dim=-1)
    log_p = torch.where(valid, log_p, 0.0)
    kl = (target * (target.clamp_min(_EPS).log() - log_p)).sum(dim=-1)  # [b, s]
    return kl.sum() if per_token else kl.mean()


@torch.no_grad()
def _attention_target(query, key, softmax_scale: float, valid: torch.Tensor) -> torch.Tensor:
    """Each head's attention probabilities summed over this rank's heads, [b, s, t] fp32,
    computed CHUNK_BYTES of logits at a time (no graph: the target is a constant)."""
    s, b, heads = query.shape[:3]
    rows = _query_rows(b, heads, key.shape[0])
    blocks = []
    for a in range(0, s, rows):
        logits = torch.einsum("sbnd,tbnd->bnst", query[a : a + rows].float(), key.float())
        masked = (logits * softmax_scale).masked_fill(~valid[:, None, a : a + rows],
                                                      float("-inf"))  # fmt: skip
        blocks.append(torch.softmax(masked, dim=-1).sum(dim=1))
    return torch.cat(blocks, dim=1)


def gather_sequence(t: torch.Tensor, cp: RankGroup) -> torch.Tensor:
    """t [s/cp, ...], this context-parallel rank's two load-balanced chunks -> [s, ...], the
    whole sequence in order; its backward sums the ranks' gradients into each chunk's
    owner (an all-gather, then a reduce-scatter)."""
    gathered = gather_from_sequence_parallel_region(t, cp)
    s = gathered.shape[0]
    held = torch.cat([local_positions(s, cp.size, rank) for rank in range(cp.size)])
    return gathered[torch.argsort(held).to(t.device)]


def causal_over_ranks(s: int, cp: RankGroup, device: torch.device) -> torch.Tensor:
    """[1, s/cp, s] bool: the positions this context-parallel rank's queries (its chunks)
    may attend to in the whole sequence of s, True = allowed."""
    queries = local_positions(s, cp.size, cp.rank).to(device)
    return (queries[:, None] >= torch.arange(s, device=device)[None])[None]


def masked_attention(q, k, v, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [s, b, n, d] over k [t, b, n, d] and v [t, b, n, dv] under mask [b, 1, s, t] bool
    (True = masked) -> [s, b, n dv]: torch's SDPA, no dropout."""
    s, b, n = q.shape[:3]
    q_, k_, v_ = (x.permute(1, 2, 0, 3) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=~mask, scale=scale)
    return out.permute(2, 0, 1, 3).reshape(s, b, n * v.shape[-1])
