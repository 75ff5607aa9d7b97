"""GPTDataset: fixed-length samples cut from an indexed dataset, Megatron's way.

Sample i is read through three cached index arrays (gpt_indices): the shuffle
index picks a sample slot, the sample index says where in the shuffled
document order it starts and ends, and the tokens are read across sequence
boundaries, sequence_length + 1 of them by default. Items, as torch tensors
of length s = sequence_length:

    tokens [s] int64, labels [s] int64 (tokens shifted by one),
    loss_mask [s] float32, position_ids [s] int64,
    attention_mask [1, s, s] bool (True = masked), only with create_attention_mask.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import torch
import torch.distributed as dist

from mp_data.built_indices import built_in_memory
from mp_data.gpt_config import GPTDatasetConfig, tokenizer_identity
from mp_data.gpt_indices import GPTIndices, build_gpt_indices, epochs_needed, separate_final_epoch
from mp_data.index_cache import IndexCache
from mp_data.indexed_dataset import IndexedDataset
from mp_data.megatron_dataset import MegatronDataset
from mp_data.split import Split

__all__ = ["GPTDataset", "ltor_masks_and_position_ids"]

_INDEX_ARRAYS = ("document_index", "sample_index", "shuffle_index")
_NO_PAD = -1
"""Pad id when the tokenizer has none (or its pad is its eod): never a real token."""


class GPTDataset(MegatronDataset):
    """Samples of `config.sequence_length` tokens from the sequences `indexed_indices`.

    num_samples=None builds one epoch; more samples than an epoch holds are
    drawn from further epochs, each shuffled anew.
    """

    def __init__(self, *args) -> None:
        """The builder's arguments (MegatronDataset)."""
        super().__init__(*args)
        config = self.config
        self._extra = int(config.add_extra_token_to_sequence)
        self._eod = config.tokenizer.eod if config.tokenizer is not None else None
        self._pad = _pad_id(config)
        self._drop_last = (
            config.drop_last_partial_validation_sequence
            if self.index_split == Split.valid
            else True
        )
        indices = self._load_or_build()
        self.document_index = indices.document_index
        self.sample_index = indices.sample_index
        self.shuffle_index = indices.shuffle_index
        self._masks_depend_on_data = (
            config.reset_position_ids or config.reset_attention_mask or config.eod_mask_loss
        )
        self._cached_masks: tuple | None = None

    @staticmethod
    def build_low_level_dataset(dataset_path: str | None, config: GPTDatasetConfig):
        """The indexed dataset at `dataset_path` (hook of BlendedMegatronDatasetBuilder)."""
        return IndexedDataset(dataset_path)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset) -> int:
        """GPT splits a dataset by sequence (BERT-style datasets split by document)."""
        return len(low_level_dataset.sequence_lengths)

    def description(self) -> dict:
        """Every setting that shapes the index arrays: the cache key."""
        c = self.config
        return {
            **self.split_description(),
            "dataset_path": self.dataset_path,
            "dataset_sequences": len(self.dataset),
            "add_extra_token_to_sequence": bool(c.add_extra_token_to_sequence),
            "drop_last_partial_sequence": bool(self._drop_last),
            "tokenizer": tokenizer_identity(c.tokenizer),
        }

    def _load_or_build(self) -> GPTIndices:
        def build() -> dict[str, np.ndarray]:
            try:
                built = build_gpt_indices(
                    self.dataset.sequence_lengths,
                    self.indices,
                    self.num_samples,
                    self.config.sequence_length,
                    self.config.random_seed,
                    add_extra_token=bool(self._extra),
                    drop_last_partial_sequence=self._drop_last,
                )
            except ValueError as err:
                where = self.dataset_path or type(self.dataset).__name__
                raise ValueError(f"{where} ({self.index_split.name} split): {err}") from None
            return vars(built)

        folder = self.config.path_to_cache
        if folder is None and not self.config.mock:
            # Megatron's default: a cache/ folder under the dataset's path prefix.
            name = f"{type(self).__name__}_indices"
            folder = os.path.join(self.dataset.path_prefix, "cache", name)
        if folder is None:
            plan = self._plan()
            if plan is None:  # the build names what is wrong
                return GPTIndices(**build())
            return GPTIndices(**built_in_memory({**self.description(), **plan}, build))
        name = f"{type(self).__name__}-{self.index_split.name}"
        cache = IndexCache(folder, name, self.description(), _INDEX_ARRAYS)
        may_build = not dist.is_initialized() or dist.get_rank() == 0
        return GPTIndices(**cache.load_or_build(build, may_build))

    def _plan(self) -> dict | None:
        """What the sample count decides of the arrays (the epochs, and whether the last
        is shuffled apart), in place of the count; None when the count cannot be had."""
        lengths = np.asarray(self.dataset.sequence_lengths)
        tokens = int(np.sum(lengths[self.indices], dtype=np.int64))
        length, count = self.config.sequence_length, self.num_samples
        try:
            epochs = epochs_needed(tokens, count, length, self._extra)
            separate = separate_final_epoch(epochs, tokens, count, length, self._extra)
        except ValueError:
            return None
        return {"num_samples": None, "epochs": epochs, "separate_final_epoch": separate}

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def tokens_of(self, idx: int) -> np.ndarray:
        """The sequence_length (+1) token ids of sample idx, padded with the pad id."""
        j = int(self.shuffle_index[idx])
        first, first_offset = map(int, self.sample_index[j])
        last, last_offset = map(int, self.sample_index[j + 1])
        end = last_offset + self._extra  # the sample's end in the last sequence it touches

        def sequence(k: int, offset: int = 0, length: int | None = None) -> np.ndarray:
            return self.dataset.get(int(self.document_index[k]), offset, length)

        if first == last:
            parts = [sequence(first, first_offset, end - first_offset)]
        else:
            parts = [sequence(first, first_offset)]
            parts += [sequence(k) for k in range(first + 1, last)]
            parts.append(sequence(last, 0, end))
        text = self._transform(np.concatenate(parts).astype(np.int64, copy=False), idx)
        missing = self.config.sequence_length + self._extra - len(text)
        if missing > 0:  # only the last sample, when it is kept partial
            text = np.concatenate([text, np.full(missing, self._pad, np.int64)])
        return text

    def _transform(self, text: np.ndarray, idx: int) -> np.ndarray:
        """Sample idx's tokens as read, before any padding: a subclass's hook (FIM)."""
        return text

    def __getitem__(self, idx: int | None) -> dict[str, torch.Tensor]:
        """Sample idx; None gives a padding sample (sample 0 with no loss)."""
        text = self.tokens_of(0 if idx is None else idx)
        if self._extra:
            tokens, labels = text[:-1], text[1:]
        else:
            tokens, labels = text, np.roll(text, -1)
            labels[-1] = self._pad
        if self._masks_depend_on_data or self._cached_masks is None:
            masks = _masks(
                tokens,
                self._eod,
                self.config.reset_position_ids,
                False,  # documents are kept apart by document_ids, without an s x s mask
                self.config.eod_mask_loss,
                self.config.create_attention_mask and not self.config.reset_attention_mask,
            )
            if not self._masks_depend_on_data:
                self._cached_masks = masks
        if self._masks_depend_on_data:
            attention_mask, loss_mask, position_ids = masks
        else:
            attention_mask, loss_mask, position_ids = self._cached_masks
            loss_mask = loss_mask.copy()
        # A pad id can only appear when the tokenizer has one or the sample was padded.
        if self._pad != _NO_PAD or (labels == _NO_PAD).any():
            padded = labels == self._pad
            loss_mask[padded] = 0.0
            tokens = np.where(tokens == self._pad, 0, tokens)
            labels = np.where(padded, 0, labels)
        if idx is None:
            loss_mask[:] = 0.0
        item = {
            "tokens": torch.from_numpy(np.ascontiguousarray(tokens)),
            "labels": torch.from_numpy(np.ascontiguousarray(labels)),
            "loss_mask": torch.from_numpy(loss_mask),
            "position_ids": torch.from_numpy(position_ids),
        }
        if self.config.create_attention_mask:
            if self.config.reset_attention_mask:  # the documents, not an s x s mask
                item["document_ids"] = torch.from_numpy(document_ids(tokens, self._eod))
            else:
                item["attention_mask"] = attention_mask
        return item


def _pad_id(config: GPTDatasetConfig) -> int:
    """The pad id whose labels get no loss: the tokenizer's, unless it is also its eod or
    bos (megatron-core's rule; then none) and allow_ambiguous_pad_tokens is off."""
    tokenizer = config.tokenizer
    pad = getattr(tokenizer, "pad", None)
    if pad is None:
        return _NO_PAD
    special = {getattr(tokenizer, "eod", None), getattr(tokenizer, "bos", None)} - {None}
    if int(pad) not in special:
        return int(pad)
    if not config.allow_ambiguous_pad_tokens:
        return _NO_PAD
    warnings.warn(
        f"the tokenizer's pad id {pad} is also its eod or bos, and allow_ambiguous_pad_tokens "
        "is set: those tokens get no loss, which may hurt convergence",
        stacklevel=3,
    )
    return int(pad)


def document_ids(tokens: np.ndarray, eod: int | None) -> np.ndarray:
    """The document of each token, int64 [s]: a document ends with its end-of-document
    token, and the next one starts after it (0, 0, 0, 1, 1, ...)."""
    is_eod = tokens == eod if eod is not None else np.zeros(len(tokens), dtype=bool)
    return (np.cumsum(is_eod) - is_eod).astype(np.int64)


def ltor_masks_and_position_ids(
    tokens: torch.Tensor,
    eod: int | None,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
    create_attention_mask: bool,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Megatron's left-to-right masks, vectorized: (attention_mask, loss_mask, position_ids).

    A document starts after each end-of-document token: with reset_position_ids
    its positions restart at 0, with reset_attention_mask its tokens cannot
    attend to earlier documents; eod_mask_loss gives end-of-document tokens no loss.
    """
    attention_mask, loss_mask, position_ids = _masks(
        tokens.numpy(), eod, reset_position_ids, reset_attention_mask, eod_mask_loss,
        create_attention_mask,
    )  # fmt: skip
    return attention_mask, torch.from_numpy(loss_mask), torch.from_numpy(position_ids)


def _masks(
    tokens: np.ndarray,
    eod: int | None,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
    create_attention_mask: bool,
) -> tuple[torch.Tensor | None, np.ndarray, np.ndarray]:
    # numpy for the per-sample arithmetic: on 2k-token samples a torch op costs
    # several microseconds of dispatch, which bounds the samples per second.
    s = len(tokens)
    is_eod = tokens == eod if eod is not None else np.zeros(s, dtype=bool)
    loss_mask = np.ones(s, dtype=np.float32)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    position_ids = np.arange(s, dtype=np.int64)
    if reset_position_ids:
        starts = np.zeros(s, dtype=np.int64)
        after_eod = np.flatnonzero(is_eod[:-1]) + 1
        starts[after_eod] = after_eod
        position_ids -= np.maximum.accumulate(starts)
    attention_mask = None
    if create_attention_mask:
        allowed = torch.ones(s, s, dtype=torch.bool).tril_()
        if reset_attention_mask:
            # The document of each token: end-of-document tokens strictly before it.
            document = torch.from_numpy(np.cumsum(is_eod) - is_eod)
            allowed &= document[:, None] == document[None, :]
        attention_mask = (~allowed).unsqueeze(0)
    return attention_mask, loss_mask, position_ids
