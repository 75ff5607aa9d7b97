"""GPTModel: embeddings, this stage's transformer layers, the output layer and the loss.

Shapes: input_ids, position_ids, labels [b, s]; inside [s, b, h] (or
[s/tp, b, h] with sequence parallelism); logits [b, s, v/tp] (v with
parallel_output=False); loss [b, s], per token. With context parallelism s is
this rank's part of the sequence, its two load-balanced chunks
(mp_layers.context_parallel.shard_sequence gives the inputs); rotary
embeddings take the chunks' true positions, learned ones the position ids.

pre_process (the first pipeline stage) holds the word and position
embeddings, post_process (the last) the output layer and the loss; a middle
stage takes its input from the previous stage (`decoder_input`). The output
layer is column-parallel over the vocabulary and the loss never gathers it
(vocab_parallel_cross_entropy; with config.output_loss_chunk_tokens the output
layer and the loss run together a chunk of tokens at a time,
chunked_linear_cross_entropy, and the [s, b, v/tp] logits never exist). With
shared input/output embeddings the output layer uses the embedding's weight on
a one-stage model; across pipeline stages the last stage keeps a copy. With an
init seed the last stage draws its copy as the first stage draws the embedding (the
same seeded draw: equal bitwise, and drawn shard by shard under deferred_init like any
weight); without one the copy starts at zero and sync_tied_embeddings adds the first
stage's into it (Megatron's embedding group).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

from mp_ckpt import ShardedTensor
from mp_layers.config import TransformerConfig
from mp_layers.config_dsa import check_dsa_sources, shares_dsa_choice
from mp_layers.context_parallel import local_positions, shard_sequence
from mp_layers.groups import ModelGroups
from mp_layers.moe.aux_losses import attach
from mp_layers.tensor_parallel import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    chunked_linear_cross_entropy,
    vocab_parallel_cross_entropy,
)
from mp_layers.transformer.kv_cache import KVCache
from mp_layers.transformer.layer import TransformerBlock
from mp_layers.transformer.layer_hooks import building_layer
from mp_layers.transformer.multi_token_prediction import MultiTokenPrediction, roll_left
from mp_layers.transformer.packed import PackedSeqParams
from mp_layers.transformer.rope import Llama3Scaling, Rotary, RotaryEmbedding, yarn_scaling
from mp_layers.transformer.seeded_init import seeded_init
from mp_layers.transformer.sparse_attention import LightningIndexer
from mp_layers.transformer.spec import LayerSpec, get_layer_spec
from mp_state import TENSOR_PARALLEL_RNG, RankGroup, RNGStatesTracker

__all__ = ["GPTModel"]


class GPTModel(torch.nn.Module):
    def __init__(
        self,
        config: TransformerConfig,
        spec: str | LayerSpec,
        vocab_size: int,
        max_sequence_length: int,
        *,
        groups: ModelGroups,
        rng_tracker: RNGStatesTracker | None = None,
        pre_process: bool = True,
        post_process: bool = True,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool | None = None,
        layer_offset: int = 0,
        num_layers: int | None = None,
        init_seed: int | None = None,
        calculate_per_token_loss: bool = False,
    ) -> None:
        """calculate_per_token_loss: the training loss is a token sum that the step divides
        by the global batch's tokens (Megatron's); the MTP and indexer losses follow it."""
        super().__init__()
        tp_group = groups.tp
        config.check_parallel(tp_group.size, groups.cp.size, groups.ep.size, groups.expert_tp.size)
        share = (
            not config.untie_embeddings_and_output_weights
            if share_embeddings_and_output_weights is None
            else share_embeddings_and_output_weights
        )
        self.config = config
        self.groups = groups
        self.tp_group = tp_group
        self.rng_tracker = rng_tracker
        self.pre_process, self.post_process = pre_process, post_process
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = share
        self.calculate_per_token_loss = calculate_per_token_loss
        # The last stage holds a copy of the word embedding: the tied output layer's weight,
        # or the MTP modules' token embedding (Megatron's embedding group keeps it equal).
        self.embedding_on_last_stage = share or bool(config.mtp_num_layers)
        mtp_here = post_process and bool(config.mtp_num_layers)
        self._input_tensor: torch.Tensor | None = None
        init = functools.partial(torch.nn.init.normal_, std=config.embedding_init_std)
        # The output layer's: init_method_std, or under muP an untied one's the embedding's.
        output_std = config.init_method_std
        if config.use_mup and not share:
            output_std = config.embedding_init_std
        output_init = functools.partial(torch.nn.init.normal_, std=output_std)
        # The embedding and output weights may be drawn shard by shard (FSDP,
        # deferred_init) unless a copy on another stage is made equal to them after
        # construction (sync_tied_embeddings: a tied output layer, MTP's embedding on the
        # last stage). With an init seed the copy is drawn equal instead.
        one_stage = pre_process and post_process
        copied = self.embedding_on_last_stage and not one_stage
        self.copy_drawn = copied and init_seed is not None
        if pre_process or mtp_here:
            deferrable = not copied or self.copy_drawn
            with seeded_init(init_seed, "embedding"), building_layer(deferrable):
                self.embedding = VocabParallelEmbedding(
                    vocab_size, config.hidden_size, tp_group=tp_group, init_method=init,
                    sequence_parallel=config.sequence_parallel, params_dtype=config.params_dtype,
                )  # fmt: skip
            if not pre_process:
                # The first stage's embedding is the real weight: this copy is drawn as it
                # is, or starts at zero and sync_tied_embeddings adds the first stage's.
                if not self.copy_drawn:
                    torch.nn.init.zeros_(self.embedding.weight)
                self.embedding.weight.shared_embedding = True
        self.position_embeddings = None
        if pre_process and config.position_embedding_type == "learned_absolute":
            self.position_embeddings = torch.nn.Embedding(
                max_sequence_length, config.hidden_size, dtype=config.params_dtype
            )
            with seeded_init(init_seed, "position_embeddings"):
                init(self.position_embeddings.weight)
            self.position_embeddings.weight.sequence_parallel = config.sequence_parallel
        self.rotary = None
        # Multi-latent attention rotates its qk_pos_emb_head_dim channels under any
        # position_embedding_type (beside a learned table: Megatron's default).
        if config.position_embedding_type in ("rope", "yarn") or config.multi_latent_attention:
            self.rotary = RotaryEmbedding(
                config.rotary_head_dim, config.rotary_percent, config.rotary_base,
                config.rotary_seq_len_interpolation_factor,
                llama3_scaling=Llama3Scaling(
                    config.rope_scaling_factor, config.rope_scaling_low_freq_factor,
                    config.rope_scaling_high_freq_factor,
                    config.rope_scaling_original_max_position_embeddings,
                ) if config.use_rope_scaling else None,
                yarn=yarn_scaling(config), interleaved=config.rotary_interleaved,
                temperature=None if config.attn_temperature_floor_scale is None else (
                    config.attn_temperature_floor_scale, config.attn_temperature_scale),
                query_log_scale=None if config.query_log_scale_beta is None else (
                    config.query_log_scale_beta, config.query_log_scale_length),
            )  # fmt: skip
        self.window_rotary = None  # the windowed layers' own (window_rotary_base)
        if config.window_rotary_base is not None:
            self.window_rotary = RotaryEmbedding(
                config.rotary_head_dim, config.rotary_percent, config.window_rotary_base,
                interleaved=config.rotary_interleaved,
            )  # fmt: skip
        self.decoder = TransformerBlock(
            config, groups, rng_tracker, spec=get_layer_spec(spec), layer_offset=layer_offset,
            num_layers=num_layers, post_process=post_process, init_seed=init_seed,
        )  # fmt: skip
        self.mtp = None
        if mtp_here:
            self.mtp = MultiTokenPrediction(
                config, groups, rng_tracker, get_layer_spec(spec), init_seed=init_seed
            )
        for module in self.modules():  # the sparse-attention indexers' losses follow it too
            if isinstance(module, LightningIndexer):
                module.per_token_loss = calculate_per_token_loss
        if shares_dsa_choice(config):  # each layer that reuses a choice, with its source
            check_dsa_sources(config, [layer.layer_number for layer in self.decoder.layers])
        if post_process:
            # A tied copy of the first stage's embedding is drawn from the embedding's seed:
            # the [vocab, hidden] master split by rows, as VocabParallelEmbedding's.
            tied_copy = share and not (pre_process or mtp_here)
            part = "embedding" if tied_copy else "output_layer"
            deferrable = one_stage or not share or self.copy_drawn
            with seeded_init(init_seed, part), building_layer(deferrable):
                self.output_layer = ColumnParallelLinear(
                    config.hidden_size, vocab_size, tp_group=tp_group, bias=False,
                    gather_output=not parallel_output, sequence_parallel=config.sequence_parallel,
                    init_method=output_init, params_dtype=config.params_dtype,
                )  # fmt: skip
            if share and (pre_process or mtp_here):
                self.output_layer.weight = self.embedding.weight
            elif share:
                # The first stage's embedding is the real weight: this copy is drawn as it
                # is, or starts at zero and sync_tied_embeddings adds the first stage's.
                if not self.copy_drawn:
                    torch.nn.init.zeros_(self.output_layer.weight)
                self.output_layer.weight.shared_embedding = True
        if self.embedding_on_last_stage and pre_process and not post_process:
            # The first stage's half of a tie across stages: its gradient is summed with
            # the last stage's copy's over the embedding group (the pipeline's finalize).
            self.embedding.weight.shared_embedding = True
        # Megatron's mark of the weights a decoupled learning rate applies to (every copy
        # of the word embedding, and the output layer, tied or not): mp_optim groups them.
        for owner in (getattr(self, "embedding", None), getattr(self, "output_layer", None)):
            if owner is not None:
                owner.weight.is_embedding_or_output_parameter = True
        # And muP's embedding-class parameters (vector-like: base lr and eps; mp_optim).
        for owner in (getattr(self, "embedding", None), self.position_embeddings,
                      getattr(self, "output_layer", None)):  # fmt: skip
            if owner is not None:
                owner.weight.is_embedding_parameter = True

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """The pipeline schedules' hand-over: the previous stage's output [s, b, h], used
        as this stage's decoder input when forward gets none (Megatron's contract)."""
        self._input_tensor = tensor

    def forward(
        self,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | PackedSeqParams | None = None,
        labels: torch.Tensor | None = None,
        decoder_input: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        loss_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-token loss [b, s] with labels, else logits [b, s, v/tp]; hidden states [s, b, h]
        on a stage without post_process.

        kv_cache: generation. The input holds the next positions of the cache's sequences
        only (the prompts', then one at a time); positions and the attention mask come
        from the cache (position_ids and attention_mask must be None), which remembers
        the keys and values; the logits are the last position's, [b, 1, v/tp], unless
        kv_cache.all_logits.

        attention_mask: [b or 1, 1, s, s] bool (True = masked), None (causal), or a
        PackedSeqParams: the documents packed in each sample, each attended on its own with
        rotary positions restarting at its first token (position_ids still feed learned
        absolute position embeddings).

        loss_mask [b, s]: with mtp_num_layers, the tokens the MTP losses count (all when
        None); in training with labels, the MTP modules run on the last stage and their
        losses reach the gradients (the returned loss stays the language model's)."""
        if decoder_input is None and not self.pre_process:
            decoder_input = self._input_tensor
        if kv_cache is not None:
            if position_ids is not None or attention_mask is not None or labels is not None:
                raise ValueError("with a kv_cache, positions and the mask are the cache's, "
                                 "and there are no labels")  # fmt: skip
            position_ids, attention_mask = self._from_cache(kv_cache, input_ids, decoder_input)
        if self.pre_process:
            hidden = self._embed(input_ids, position_ids)
        elif decoder_input is None:
            raise ValueError(
                "a stage without pre_process needs decoder_input (or set_input_tensor)"
            )
        else:
            hidden = decoder_input
        rotary = self._rotations(self.rotary, hidden, position_ids, attention_mask, kv_cache)
        if self.window_rotary is not None:
            rotary = rotary._replace(window=self._rotations(
                self.window_rotary, hidden, position_ids, attention_mask, kv_cache))  # fmt: skip
        if rotary is not None and shares_dsa_choice(self.config):  # this forward's choices
            rotary = rotary._replace(chosen={})
        hidden = self.decoder(hidden, rotary, attention_mask, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(hidden.shape[0])
        if not self.post_process:
            return hidden
        if kv_cache is not None and not kv_cache.all_logits:
            hidden = hidden[-1:]
        if labels is not None and not self.parallel_output:
            raise ValueError("the loss needs parallel_output=True (vocabulary-parallel logits)")
        if labels is None:
            logits, _ = self.output_layer(hidden)  # [s, b, v/tp]
            return self._scale_logits(logits).transpose(0, 1).contiguous()
        if self.mtp is not None and self.training and torch.is_grad_enabled():
            hidden = self._multi_token_prediction(
                hidden, input_ids, labels, loss_mask, rotary, attention_mask
            )
        return self._token_loss(hidden, labels)

    def _token_loss(
        self, hidden: torch.Tensor, labels: torch.Tensor, detach_weight: bool = False
    ) -> torch.Tensor:
        """The output layer's cross entropy [b, s] of hidden [s, b, h] against labels [b, s];
        detach_weight: no gradient for the output layer's weight (mtp_detach_heads)."""
        weight = self.output_layer.weight.detach() if detach_weight else None
        if self.config.output_loss_chunk_tokens:
            layer, chunk = self.output_layer, self.config.output_loss_chunk_tokens
            total = layer.matmul_input(hidden)  # [s, b, h], the whole sequence
            if self.config.logit_multiplier != 1.0:  # muP: (c h) W = c (h W), no bias
                total = total * self.config.logit_multiplier
            loss = chunked_linear_cross_entropy(
                total, layer.weight if weight is None else weight, labels.t(), self.tp_group,
                chunk, fused=self.config.cross_entropy_loss_fusion,
            )  # fmt: skip
            return loss.t().contiguous()
        logits, _ = self.output_layer(hidden, weight)  # [s, b, v/tp]
        logits = self._scale_logits(logits)
        # The logits are not handed out: their memory takes their gradient in backward.
        grad_in_logits = logits.grad_fn is not None
        loss = vocab_parallel_cross_entropy(
            logits, labels.t(), self.tp_group, grad_in_logits=grad_in_logits,
            fused=self.config.cross_entropy_loss_fusion,
        )  # fmt: skip
        return loss.t().contiguous()

    def _scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits times muP's output multiplier (config.logit_multiplier), as Megatron
        scales them, after the output layer."""
        multiplier = self.config.logit_multiplier
        return logits if multiplier == 1.0 else logits * multiplier

    def _multi_token_prediction(self, hidden, input_ids, labels, loss_mask, rotary,
                                attention_mask):  # fmt: skip
        """hidden, carrying in backward the MTP modules' scaled losses (Megatron's
        process_mtp_loss): each module's masked loss over its rolled mask's token count,
        times mtp_loss_scaling_factor / mtp_num_layers (times this micro-batch's tokens
        with a per-token loss, which the step divides by the global batch's). With context
        parallelism the counts are the whole sequences' (over cp ranks, whose gradients
        are averaged): a rank's share is exact even where the sequence's end, which the
        roll masks, lies in one rank's chunk only."""
        if input_ids is None:
            raise ValueError("multi-token prediction needs the input_ids on the last stage")
        cp = self.groups.cp
        mask = torch.ones_like(labels, dtype=torch.float32) if loss_mask is None else loss_mask
        mask = mask.float()
        # With a per-token loss the step divides by the batch's tokens: scale back to them.
        tokens = _per_rank_count(mask, cp) if self.calculate_per_token_loss else None
        factor = self.config.mtp_loss_scaling_factor / self.mtp.depths
        detach = self.config.mtp_detach_heads  # the MTP losses train the modules alone
        out, ids = (hidden.detach() if detach else hidden), input_ids
        # Packed documents: a position whose rolled token comes from the next document
        # (the last k of each document at depth k) predicts nothing, as Megatron rolls
        # within each sequence of cu_seqlens.
        documents = rolled_documents = order = None
        if isinstance(attention_mask, PackedSeqParams):
            documents = rolled_documents = attention_mask.document_ids
            order = attention_mask.order
        for k in range(self.mtp.depths):
            ids, labels, mask = (roll_left(t, cp, order) for t in (ids, labels, mask))
            if documents is not None:
                rolled_documents = roll_left(rolled_documents, cp, order)
                mask = mask * (rolled_documents == documents)
            embedded = self._embed(ids, None)
            out = self.mtp.module(k)(out, embedded.detach() if detach else embedded, rotary,
                                     attention_mask)  # fmt: skip
            count = _per_rank_count(mask, cp)
            total = (self._token_loss(out, labels, detach).float() * mask).sum()
            self.mtp.record(k, total.detach() / count)
            denominator = count if tokens is None else count / tokens
            hidden = attach(hidden, total * factor / denominator, self.mtp.aux_loss_scale)
        return hidden

    def sync_tied_embeddings(self, embedding_group: RankGroup | None) -> None:
        """Makes the last stage's copy of the word embedding (the tied output weight, the
        MTP modules' embedding) equal the first stage's; nothing to do where the model was
        built with an init seed (the copy is drawn equal).

        Collective over the embedding group (first and last pipeline stage,
        state.embedding): call it on those ranks right after construction, when
        the last stage holds a copy (embedding_on_last_stage). Their gradients
        must then be all-reduced over the same group before each optimizer step
        (the pipeline's finalize step does so).
        """
        if embedding_group is None or embedding_group.size == 1:
            return
        if not self.embedding_on_last_stage:
            raise ValueError("sync_tied_embeddings: the last stage holds no copy of the "
                             "word embedding (untied, no MTP)")  # fmt: skip
        if self.copy_drawn:
            return  # drawn equal to the first stage's embedding (an init seed)
        has_embedding = self.pre_process or self.mtp is not None
        weight = self.embedding.weight if has_embedding else self.output_layer.weight
        with torch.no_grad():
            torch.distributed.all_reduce(weight, group=embedding_group.group)

    def _from_cache(self, kv_cache: KVCache, input_ids, decoder_input):
        """(position ids [b, s], attention mask) of the next positions of a generation."""
        if self.config.sequence_parallel or self.groups.cp.size > 1:
            raise ValueError(
                "generation with a KVCache runs without sequence or context parallelism "
                f"(sequence_parallel={self.config.sequence_parallel}, "
                f"context_parallel_size={self.groups.cp.size})"
            )
        s = input_ids.shape[1] if self.pre_process else decoder_input.shape[0]
        device = input_ids.device if self.pre_process else decoder_input.device
        kv_cache.check_room(s)
        return kv_cache.position_ids(s, device), kv_cache.attention_mask(s, device)

    def _rotations(self, embedding: RotaryEmbedding | None, hidden, position_ids,
                   attention_mask, kv_cache: KVCache | None) -> Rotary | None:  # fmt: skip
        """The rotations `embedding` gives this forward's positions (None without one)."""
        if embedding is None:
            return None
        if kv_cache is not None:
            # Cast once for every layer (apply_rotary_pos_emb casts to the activations' dtype).
            rotary = embedding.at(position_ids.t())
            return rotary._replace(cos=rotary.cos.to(hidden.dtype),
                                   sin=rotary.sin.to(hidden.dtype))  # fmt: skip
        if isinstance(attention_mask, PackedSeqParams):  # positions restart per document
            return embedding.at(attention_mask.positions.t())
        return self._rotary(embedding, hidden.shape[0])

    def _rotary(self, embedding: RotaryEmbedding, local_positions: int) -> Rotary:
        """The rotations of this rank's positions: of the whole sequence, then this rank's
        load-balanced chunks with context parallelism (Megatron's way: the true positions,
        whatever the position ids say)."""
        cp = self.groups.cp
        s = local_positions * (self.tp_group.size if self.config.sequence_parallel else 1)
        rotary = embedding(s * cp.size)
        if cp.size == 1:
            return rotary
        return Rotary(*(None if t is None else shard_sequence(t, cp.size, cp.rank, dim=0)
                        for t in rotary))  # fmt: skip

    def _embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        hidden = self.embedding(input_ids.t())  # [s, b, h], or [s/tp, b, h]
        if self.position_embeddings is not None:
            if position_ids is None:
                cp = self.groups.cp
                position_ids = local_positions(input_ids.shape[1] * cp.size, cp.size, cp.rank)
                position_ids = position_ids.to(input_ids.device).expand_as(input_ids)
            positions = position_ids.t()
            if self.config.sequence_parallel:
                positions = positions.chunk(self.tp_group.size)[self.tp_group.rank]
            hidden = hidden + self.position_embeddings(positions)
        if self.config.scale_word_embeddings:  # Gemma's sqrt(h), rounded to the dtype first
            hidden = hidden * torch.tensor(self.config.hidden_size**0.5, dtype=hidden.dtype)
        if self.config.embedding_multiplier != 1.0:  # muP's mup_embedding_mult, Granite's
            hidden = hidden * self.config.embedding_multiplier
        p = self.config.hidden_dropout
        if self.training and p > 0:
            sharded = self.config.sequence_parallel
            stream = (
                self.rng_tracker.fork(TENSOR_PARALLEL_RNG) if sharded else contextlib.nullcontext()
            )
            with stream:
                hidden = F.dropout(hidden, p=p, training=True)
        return hidden

    def sharded_state_dict(self, prefix: str = "") -> dict[str, ShardedTensor]:
        """Every parameter by its logical name; the tied output weight appears once."""
        pieces = self.decoder.sharded_state_dict(f"{prefix}decoder.")
        rank, size = self.tp_group.rank, self.tp_group.size
        if self.pre_process:
            key = f"{prefix}embedding.word_embeddings.weight"
            pieces[key] = ShardedTensor.from_rank(key, self.embedding.weight, 0, rank, size)
            if self.position_embeddings is not None:
                key = f"{prefix}embedding.position_embeddings.weight"
                pieces[key] = ShardedTensor.from_rank(
                    key, self.position_embeddings.weight, None, 0, 1, replica_id=rank
                )
        if self.post_process and not self.share_embeddings_and_output_weights:
            key = f"{prefix}output_layer.weight"
            pieces[key] = ShardedTensor.from_rank(key, self.output_layer.weight, 0, rank, size)
        if self.post_process and not self.pre_process and self.embedding_on_last_stage:
            # The last stage's copy of the embedding: loaded, never saved twice.
            key = f"{prefix}embedding.word_embeddings.weight"
            weight = self.output_layer.weight if self.mtp is None else self.embedding.weight
            pieces[key] = ShardedTensor.from_rank(key, weight, 0, rank, size, replica_id=1)
        if self.mtp is not None:
            pieces |= self.mtp.sharded_state_dict(f"{prefix}mtp.")
        return pieces


def _per_rank_count(mask: torch.Tensor, cp: RankGroup) -> torch.Tensor:
    """The tokens mask [b, s] counts, over the context-parallel ranks' parts of the
    sequences and divided by their number (at least one token in all)."""
    count = mask.sum()
    if cp.size > 1:
        count = count.detach().clone()
        torch.distributed.all_reduce(count, group=cp.group)
    return count.clamp(min=1) / cp.size
