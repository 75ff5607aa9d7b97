"""GPT pretraining's three providers, as Megatron's pretrain_gpt.py has them.

- model_provider: this rank's GPTModel chunk for its (virtual) pipeline stage;
- datasets_provider: GPT datasets (or mock ones, or packed SFT conversations
  with --sft) from mp-data, built on the ranks that read data (tensor-parallel
  rank 0 of the first and last stage, and of the middle stages when samples
  carry documents);
- forward_step: get_batch (tensor-parallel rank 0 reads the micro-batch and
  broadcasts it to its group; middle stages read nothing, or only the documents
  with reset_attention_mask), the model, and a loss masked by loss_mask,
  reported as its data-parallel sum and token count.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist

import mp_state
from mp_data import (
    BlendedMegatronDatasetBuilder,
    GPTDataset,
    GPTDatasetConfig,
    GPTFIMDataset,
    GPTFIMDatasetConfig,
    MockGPTDataset,
    SFTDataset,
    SFTTokenizer,
    fim_dataset_fields,
    get_blend_from_list,
)
from mp_layers import GPTModel, ModelGroups, PackedSeqParams, broadcast_data, shard_sequence

__all__ = ["datasets_provider", "forward_step", "get_batch", "loss_func", "model_provider"]


def model_provider(*, config, state, stage, vp_stage, padded_vocab_size, rng_tracker):
    """The GPTModel chunk holding `stage`'s layers (the same global model at any layout)."""
    gpt = config.gpt
    spec = "local" if gpt.transformer_impl == "local" else "te"
    return GPTModel(
        config.model, spec, padded_vocab_size, gpt.max_position_embeddings or gpt.seq_length,
        groups=ModelGroups.of(state), rng_tracker=rng_tracker, pre_process=stage.pre_process,
        post_process=stage.post_process, layer_offset=stage.offset, num_layers=stage.count,
        init_seed=config.training.seed,
        calculate_per_token_loss=config.optimizer.calculate_per_token_loss,
    )  # fmt: skip


def datasets_provider(run, counts: list[int]):
    """[train, valid, test] datasets for the sample counts the loop needs."""
    config = run.config
    data, state = config.data, run.state
    first = state.pp.rank == 0
    last = state.pp.rank == state.pp.size - 1

    def reads_data() -> bool:  # a middle stage needs the samples' documents only
        return state.tp.rank == 0 and (first or last or data.batches_carry_documents)

    tokenizer = run.tokenizer
    if data.sft and reads_data() and not isinstance(tokenizer, SFTTokenizer):
        # HuggingFaceTokenizer's tokenizer.json, rendering conversations in the prompt format.
        tokenizer = SFTTokenizer(tokenizer.path, data.sft_tokenizer_prompt_format)
    blend, per_split = None, None
    # Mock data reads no files: with no blend named, the config takes megatron-core's mock
    # path (MockGPTDataset, split 1,1,1), whatever data paths a YAML file may carry.
    if not data.mock_data:
        blend = get_blend_from_list(data.data_path)
        if data.train_data_path or data.valid_data_path or data.test_data_path:
            paths = (data.train_data_path, data.valid_data_path, data.test_data_path)
            per_split = [get_blend_from_list(p) for p in paths]
    fim = fim_dataset_fields(data) if data.fim_data else {}
    dataset_config = (GPTFIMDatasetConfig if fim else GPTDatasetConfig)(
        random_seed=config.training.seed, sequence_length=config.gpt.seq_length,
        blend=blend, blend_per_split=per_split,
        split=data.split if per_split is None else None, path_to_cache=data.data_cache_path,
        tokenizer=tokenizer, reset_position_ids=data.reset_position_ids,
        reset_attention_mask=data.reset_attention_mask, eod_mask_loss=data.eod_mask_loss,
        create_attention_mask=data.batches_carry_documents,
        allow_ambiguous_pad_tokens=data.allow_ambiguous_pad_tokens,
        mid_level_dataset_surplus=data.mid_level_dataset_surplus,
        num_dataset_builder_threads=data.num_dataset_builder_threads,
        context_parallel_size=config.parallel.context_parallel_size, **fim,
    )  # fmt: skip
    cls = SFTDataset if data.sft else MockGPTDataset if data.mock_data else GPTDataset
    cls = GPTFIMDataset if fim else cls
    if not config.training.multiple_validation_sets:
        return BlendedMegatronDatasetBuilder(cls, counts, reads_data, dataset_config).build()
    # Each validation dataset on its own (Megatron's --multiple-validation-sets).
    sets = per_split[1][0]
    per_split[1] = None
    train, _, test = BlendedMegatronDatasetBuilder(
        cls, counts, reads_data, dataclasses.replace(dataset_config, blend_per_split=per_split)
    ).build()  # fmt: skip
    valid = [BlendedMegatronDatasetBuilder(
        cls, counts, reads_data,
        dataclasses.replace(dataset_config, blend_per_split=[None, ([prefix], None), None]),
    ).build()[1] for prefix in sets]  # fmt: skip
    return train, (valid if all(v is not None for v in valid) else None), test


_INT_KEYS = ["tokens", "labels", "position_ids"]


def get_batch(data_iterator, model, documents: bool = False) -> dict | None:
    """This chunk's micro-batch: tokens and positions on the first stage, labels and
    loss_mask on the last, nothing in between. documents: the samples carry
    document_ids (reset_attention_mask, sft), which every stage needs (a middle stage gets
    them alone), described for this rank as "packed" (a PackedSeqParams); otherwise
    attention is causal over each whole sample."""
    stage = _unwrap(model)
    ends = stage.pre_process or stage.post_process
    if not (ends or documents):
        return None
    tp = mp_state.current().tp
    item = next(data_iterator) if tp.rank == 0 else None
    keys = [*_INT_KEYS, "document_ids"] if documents else _INT_KEYS
    batch = broadcast_data(keys, _as(item, keys, torch.int64), torch.int64, tp)
    if not ends:
        batch = {"document_ids": batch["document_ids"]}
    else:
        batch |= broadcast_data(["loss_mask"], _as(item, ["loss_mask"], torch.float32),
                                torch.float32, tp)  # fmt: skip
        # Padding samples carry a label no token has (under a zero loss mask).
        batch["labels"] = batch["labels"].clamp(min=0)
    # Context parallelism: this rank keeps its two load-balanced chunks of every
    # sequence (of every document when the documents allow: PackedSeqParams.split),
    # positions with their tokens.
    cp = mp_state.current().cp
    if "document_ids" in batch:
        packed = PackedSeqParams.from_document_ids(batch.pop("document_ids"), cp.size, cp.rank)
        return {key: packed.shard(value) for key, value in batch.items()} | {"packed": packed}
    return {key: shard_sequence(value, cp.size, cp.rank) for key, value in batch.items()}


def forward_step(data_iterator, model, *, documents: bool = False):
    """Megatron's forward step: (per-token loss or hidden states, the loss function)."""
    batch = get_batch(data_iterator, model, documents)
    packed = None if batch is None else batch.get("packed")
    if batch is None or "tokens" not in batch:  # a middle stage
        return model(None, attention_mask=packed), functools.partial(loss_func, None)
    output = model(batch["tokens"], batch["position_ids"], packed, labels=batch["labels"],
                   loss_mask=batch["loss_mask"])  # fmt: skip
    token_sum = _unwrap(model).calculate_per_token_loss
    return output, functools.partial(loss_func, batch["loss_mask"], token_sum=token_sum)


def loss_func(loss_mask: torch.Tensor, per_token_loss: torch.Tensor, *, token_sum: bool = False):
    """(masked loss sum, its token count, {"lm loss": [sum, count] over data-parallel ranks}).

    With context parallelism each rank holds part of every sequence. For a mean loss (the
    schedule divides each micro-batch's sum by its count, and the gradients are averaged
    over dp x cp) the count is the whole sequences' (summed over the cp group) and the sum
    is scaled by cp: the gradients are those of the whole sequences' mean loss, whatever
    each rank's share of the mask. With token_sum (calculate_per_token_loss: the
    gradients are summed and divided by the counts summed over every rank), each rank
    gives its own sum and count, as in Megatron-LM: the counts then add up to the batch's
    tokens, by which the MTP and MoE losses are scaled back too.
    """
    losses = per_token_loss.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    total = torch.sum(losses * mask)
    tokens = mask.sum()
    reported = torch.stack([total.detach(), tokens.detach()])
    state = mp_state.current()
    if state.dp_cp.size > 1:
        dist.all_reduce(reported, group=state.dp_cp.group)
    if state.cp.size > 1 and not token_sum:
        tokens = tokens.detach().clone()
        dist.all_reduce(tokens, group=state.cp.group)
        total = total * state.cp.size
    return total, tokens, {"lm loss": reported}


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def _as(item, keys, dtype):
    if item is None:
        return None
    return {k: torch.as_tensor(item[k]).to(dtype) for k in keys}
