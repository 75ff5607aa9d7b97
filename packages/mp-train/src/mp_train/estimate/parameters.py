"""Every parameter a GPTModel of a RunConfig holds, and how a rank of each pipeline stage
holds it: mp_train.estimate's parameter count and weight memory (`mp-train estimate`
without --megatron-formula).

Symbols as in mp_train.estimate: h hidden, a heads, g query groups, d head width, f ffn
width (x 3 with a gated activation, swiglu or quick_geglu, x 2 otherwise: fc1 twice as
wide and fc2), V padded vocabulary; E routed experts of width f_moe, k of them per
token, f_shared the shared expert's width; MLA's r kv_lora_rank, r_q q_lora_rank, dn
qk_head_dim, dr qk_pos_emb_head_dim, dv v_head_dim; t/p/e tensor/pipeline/expert
parallel sizes.

A layer's parameters (each norm x 2 for LayerNorm, its bias; checked against GPTModel's
count, tests/test_estimate_families.py):

    attention    2hd(a + g) (Q, K, V, out), hda more with attention_output_gate; biases
                 d(a + 2g) with add_bias_linear or add_qkv_bias, h (out's) with
                 add_bias_linear; qk-layernorm 2d (none under qk_l2_norm, which has no
                 weights; d(a + g), split like the heads, with qk_layernorm_scope
                 "all_heads"); a sink per head with softmax_type learnable
    MLA          queries r_q(h + a(dn + dr)) (ha(dn + dr) without r_q), keys and values
                 r(h + a(dn + dv)) + h dr, out a dv h (+ h bias), the latent norms r_q and r
                 with qk_layernorm; with DeepSeek's sparse attention its indexer of n heads
                 of di channels, r_q n di (h n di without r_q) + h di + 2 di + h n (none
                 in a layer that reuses another's choice: dsa_indexer_topk_freq)
    MLP          hf x (3|2), biases f x (2|1) + h with add_bias_linear
    MoE MLP      the shared expert h f_shared x (3|2) and its gate h, the router hE (+ E
                 bias), E routed experts of h f_moe x (3|2) (+ f_moe x (2|1) + h biases)
    norms        2h (4h with sublayer_norm "both": input and output normalized)

A layer whose attention is a gated DeltaNet (experimental_attention_variant) counts it as
mp_train.estimate.linear_attention does. A hybrid model's layer (hybrid_layer_pattern)
holds one sublayer and its norm h: attention
(*), an MLP (-) or a MoE MLP (E) as above, or a Mamba mixer (M: mp_train.estimate.hybrid).
Beside the layers the final norm, the word embedding hV, the output layer hV when
untied, learned positions h x max_position_embeddings, and per multi-token prediction
module its norms enorm and hnorm, eh_proj 2h x h, one layer of the last layer's kind and
its final norm (the embedding and the output layer are the model's; GPTModel does not
build MTP modules yet: tests/test_estimate.py counts them by hand).

How a rank holds them (what GPTModel allocates): the column- and row-parallel weights, the
column-parallel biases and the sinks are split over t; the norms, the row-parallel
biases (out's, fc2's), the router, the shared expert's gate, MLA's down projections,
latent norms and sparse-attention indexer, the learned positions and a Mamba layer's
norm and out_proj bias are whole on every tensor-parallel rank; the routed experts are
split over e x expert-t, but for their fc2 biases, split over e only.
The first pipeline stage holds its layers (every virtual chunk of it), the word embedding
and the positions; the last its layers, the final norm, the output layer (with tied
embeddings and p > 1 a copy of the word embedding) and the MTP modules (and, untied, a
copy of the word embedding they embed with); one stage holds all of it once.
"""

from __future__ import annotations

import dataclasses

from mp_layers import TransformerConfig, dsa_choice_source, mtp_layer_kinds, shares_dsa_choice
from mp_pipeline import stage_layers
from mp_train.configuration.config import RunConfig
from mp_train.configuration.pipeline_segments import pipeline_segments
from mp_train.estimate.hybrid import mamba_parameters
from mp_train.estimate.linear_attention import gdn_parameters, layer_kinds

__all__ = ["Held", "model_parameters", "stage_layer_kinds", "stage_parameters"]


@dataclasses.dataclass(frozen=True)
class Held:
    """Parameters by how a rank holds them."""

    split: int = 0
    """divided over the tensor-parallel ranks"""
    whole: int = 0
    """whole on every tensor-parallel rank"""
    experts: int = 0
    """divided over e x expert-t (routed experts)"""
    expert_whole: int = 0
    """divided over e only (the routed experts' fc2 biases)"""

    def __add__(self, other: Held) -> Held:
        return Held(*(x + y for x, y in zip(dataclasses.astuple(self),
                                            dataclasses.astuple(other), strict=True)))  # fmt: skip

    def __mul__(self, n: int) -> Held:
        return Held(*(x * n for x in dataclasses.astuple(self)))

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))

    def on_rank(self, tp: int, ep: int, etp: int) -> tuple[float, float]:
        """(dense, expert) parameters one rank holds."""
        return self.split / tp + self.whole, self.experts / (ep * etp) + self.expert_whole / ep


def _gated(m: TransformerConfig) -> int:
    return 3 if m.gated_linear_unit else 2  # fc1 (twice as wide when gated) and fc2


def _norm(m: TransformerConfig) -> int:
    return 1 if m.normalization == "RMSNorm" else 2  # LayerNorm has a bias


def _attention(m: TransformerConfig) -> Held:
    h, a, norm = m.hidden_size, m.num_attention_heads, _norm(m)
    out_bias = h if m.add_bias_linear else 0
    if m.multi_latent_attention:
        r, dn, dr, dv = m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
        latent_norms = r * norm if m.qk_layernorm else 0
        if m.q_lora_rank is None:
            query, query_down = h * a * (dn + dr), 0
        else:
            query, query_down = m.q_lora_rank * a * (dn + dr), m.q_lora_rank * h
            latent_norms += m.q_lora_rank * norm if m.qk_layernorm else 0
        split = query + r * a * (dn + dv) + a * dv * h
        whole = query_down + h * (r + dr) + latent_norms + out_bias
        return Held(split=split, whole=whole + _indexer(m))
    d, g = m.kv_channels, m.num_query_groups
    split = 2 * h * d * (a + g)  # Q, K, V and out
    if m.attention_output_gate:
        split += h * d * a  # a gate per query channel
    if m.add_bias_linear or m.add_qkv_bias:
        split += d * (a + 2 * g)
    if m.softmax_type == "learnable":
        split += a  # one sink logit per head
    qk_norms = 2 * d * norm if m.qk_layernorm and not m.qk_l2_norm else 0  # L2: no weights
    if m.qk_layernorm and m.qk_layernorm_scope == "all_heads":  # a weight per channel
        return Held(split=split + d * (a + g), whole=out_bias)
    return Held(split=split, whole=qk_norms + out_bias)


def _layer(m: TransformerConfig, kind: str, moe: bool, *, active: bool = False) -> Held:
    """One layer of a kind of linear_attention.layer_kinds ("transformer": attention then an
    MLP, "linear": a gated DeltaNet then an MLP, "gdn": a gated DeltaNet alone),
    its norms included; `active`: the k routed experts a token passes through instead of
    all E."""
    sides = 2 if m.sublayer_norm == "both" else 1  # a sublayer's input and output norms
    norm = Held(whole=m.hidden_size * _norm(m) * sides)
    if kind == "mamba":
        split, whole = mamba_parameters(m, _norm(m))
        return Held(split=split, whole=whole)
    layer = Held()
    if kind in ("transformer", "attention"):
        layer += _attention(m) + norm
    if kind in ("linear", "gdn"):
        split, whole = gdn_parameters(m, _norm(m))
        layer += Held(split=split, whole=whole) + norm
    if kind in ("transformer", "linear", "mlp", "moe"):
        layer += _mlp(m, moe, active=active) + norm
    return layer


def _mlp(m: TransformerConfig, moe: bool, *, active: bool) -> Held:
    """A dense or MoE MLP, without its norm."""
    h, gated = m.hidden_size, _gated(m)
    if not moe:
        f = m.ffn_hidden_size
        bias = Held(split=f * (gated - 1), whole=h) if m.add_bias_linear else Held()
        return Held(split=h * f * gated) + bias
    E = m.moe_router_topk if active else m.num_moe_experts
    shared = h * (m.moe_shared_expert_intermediate_size or 0) * gated
    router = h * m.num_moe_experts + (m.num_moe_experts if m.add_bias_linear else 0)
    gate = h if m.moe_shared_expert_gate else 0
    f = m.moe_ffn_hidden_size
    width = m.moe_latent_size or h  # the routed experts' input and output
    latent = 0  # a latent MoE's fc1_latent_proj and fc2_latent_proj, whole on every rank
    if m.moe_latent_size is not None:
        latent = 2 * h * width + ((width + h) if m.add_bias_linear else 0)
    expert = Held(experts=width * f * gated)
    if m.add_bias_linear:  # fc1's [(2|1) f] split like its weight, fc2's [width] per expert
        expert += Held(experts=f * (gated - 1), expert_whole=width)
    return Held(split=shared, whole=router + gate + latent) + expert * E


def _mtp_module(m: TransformerConfig, *, active: bool = False) -> Held:
    """One multi-token prediction module: enorm, hnorm and its final norm, eh_proj
    (column-parallel 2h -> h, no bias) and its layers (mp_layers.mtp_layer_kinds: one of
    the model's last layer's kind, or a hybrid model's pattern's)."""
    h = m.hidden_size
    module = Held(split=2 * h * h, whole=3 * h * _norm(m))
    last = layer_kinds(m)[-1]  # a transformer layer is shaped as the last (a DeltaNet's too)
    for kind, moe in mtp_layer_kinds(m):
        module += _layer(m, last if kind == "transformer" else kind, moe, active=active)
    return module


def _mtp_modules(m: TransformerConfig) -> int:
    """The multi-token prediction modules that hold weights: one applied at every depth
    with mtp_use_repeated_layer."""
    return 1 if m.mtp_num_layers and m.mtp_use_repeated_layer else (m.mtp_num_layers or 0)


def _positions(config: RunConfig) -> int:
    if config.model.position_embedding_type != "learned_absolute":
        return 0
    return config.model.hidden_size * (config.gpt.max_position_embeddings or config.gpt.seq_length)


def _indexer(m: TransformerConfig) -> int:
    """A sparse-attention layer's lightning indexer, replicated (0 without DSA)."""
    if m.experimental_attention_variant != "dsa":
        return 0
    h, n, di = m.hidden_size, m.dsa_indexer_n_heads, m.dsa_indexer_head_dim
    return (m.q_lora_rank or h) * n * di + h * di + 2 * di + h * n


def _shared_choices(m: TransformerConfig, layers) -> Held:
    """The indexers the layers of these 0-based numbers lack: those that reuse another
    layer's choice (dsa_indexer_topk_freq), counted in _attention, taken back."""
    if not shares_dsa_choice(m):
        return Held()
    shared = sum(dsa_choice_source(m, layer) != layer for layer in layers)
    return Held(whole=-shared * _indexer(m))


def model_parameters(config: RunConfig, V: int) -> dict:
    """{"total", "active", "experts"}: every parameter of the model (MTP modules
    included), those one token passes through, and the routed experts'."""
    m = config.model
    layers = Held()
    active = Held()
    for kind, moe in zip(layer_kinds(m), m.moe_layer_pattern(), strict=True):
        layers += _layer(m, kind, moe)
        active += _layer(m, kind, moe, active=True)
    layers += _shared_choices(m, range(m.num_layers))
    active += _shared_choices(m, range(m.num_layers))
    beside = Held(whole=_norm(m) * m.hidden_size + _positions(config))
    beside += Held(split=m.hidden_size * V * (2 if m.untie_embeddings_and_output_weights else 1))
    mtp = _mtp_module(m) * _mtp_modules(m)
    mtp_active = _mtp_module(m, active=True) * _mtp_modules(m)
    total = layers + beside + mtp
    return {
        "total": total.total,
        "active": (active + beside + mtp_active).total,
        "experts": total.experts + total.expert_whole,
    }


def stage_layer_kinds(config: RunConfig, stage: int) -> list[tuple[str, bool]]:
    """(kind, whether MoE) of each layer of pipeline stage `stage` (all its virtual
    chunks), the kinds of mp_layers.hybrid_layer_kinds."""
    m = config.model
    pattern = list(zip(layer_kinds(m), m.moe_layer_pattern(), strict=True))
    kinds = []
    for layers in _stage_chunks(config, stage):
        kinds += pattern[layers.offset : layers.offset + layers.count]
    return kinds


def stage_chunk_layers(config: RunConfig, stage: int) -> list[int]:
    """How many decoder layers each virtual chunk of pipeline stage `stage` holds, in chunk
    order: uneven where segments place them (a chunk of the embedding or the loss alone
    holds none)."""
    return [layers.count for layers in _stage_chunks(config, stage)]


def _stage_chunks(config: RunConfig, stage: int) -> list:
    m, parallel = config.model, config.parallel
    vpp = parallel.virtual_pipeline_model_parallel_size
    chunks = []
    for chunk in range(vpp or 1):
        chunks.append(stage_layers(
            m.num_layers, parallel.pipeline_model_parallel_size, stage,
            virtual_pipeline_model_parallel_size=vpp, vp_stage=chunk,
            num_layers_in_first_pipeline_stage=parallel.decoder_first_pipeline_num_layers,
            num_layers_in_last_pipeline_stage=parallel.decoder_last_pipeline_num_layers,
            segments=pipeline_segments(config),
        ))  # fmt: skip
    return chunks


def stage_parameters(config: RunConfig, V: int, stage: int) -> Held:
    """The parameters of pipeline stage `stage` (each of its virtual chunks), by how one
    of its ranks holds them."""
    m = config.model
    pp = config.parallel.pipeline_model_parallel_size
    held = Held()
    for kind, moe in stage_layer_kinds(config, stage):
        held += _layer(m, kind, moe)
    chunks = _stage_chunks(config, stage)
    held += _shared_choices(m, [i for c in chunks for i in range(c.offset, c.offset + c.count)])
    h = m.hidden_size
    if stage == 0:
        held += Held(whole=_positions(config))
    if stage == pp - 1:
        held += Held(whole=_norm(m) * h)  # the final norm
        held += _mtp_module(m) * _mtp_modules(m)
    return held + Held(split=stage_embeddings(config, V, stage))


def stage_embeddings(config: RunConfig, V: int, stage: int) -> int:
    """The word-embedding and output-layer weights stage `stage` holds (split over the
    tensor-parallel ranks)."""
    m = config.model
    pp = config.parallel.pipeline_model_parallel_size
    embedding, untied = m.hidden_size * V, m.untie_embeddings_and_output_weights
    copies = 1 if stage == 0 else 0
    if stage == pp - 1:
        # The output layer: its own weight when untied, a copy of the embedding when tied
        # across stages; MTP embeds with a copy of the word embedding on the last stage.
        mtp = m.mtp_num_layers or 0
        copies += (1 if untied or pp > 1 else 0) + (1 if mtp and untied and pp > 1 else 0)
    return embedding * copies
