"""SFTDataset: chat conversations from JSONL files, packed into loss-masked samples.

Megatron-LM's --sft data path, with packing and a cache:

1. SFTLowLevelDataset reads one JSONL file (sft_conversations: every line
   checked, a bad one named by file and line) and tokenizes every
   conversation with the config's SFTTokenizer (sft_tokenizer: ids, and which
   are the assistant's). The result is cached as arrays: all tokens, the
   assistant flags, where each conversation and each line starts. Its elements
   are the file's lines, so Megatron's split ("969,30,1") divides lines.
2. SFTDataset takes the conversations of one split's lines in file order,
   packs them greedily into samples of sequence_length + 1 tokens
   (sft_packing: a conversation that fits is never split; a longer one is
   truncated to a sample of its own, counted in the log), and orders the
   samples by a shuffle drawn from random_seed, one permutation per pass when
   more samples are asked than one pass holds. The sample bounds and the
   shuffle are cached too.

Both caches are IndexCache entries (index_cache: files written under temporary
names, then renamed; the description last) in `path_to_cache`, by default
cache/SFTDataset_indices/ beside the JSONL file. The file's entry is keyed by
its path, size, modification time and the tokenizer's identity (prompt format
and template included); a split's entry adds the split, sample count, seed and
sequence length. Under torch.distributed rank 0 builds them and the other ranks
load them (BlendedMegatronDatasetBuilder orders the two).
"""

from __future__ import annotations

import logging
import math
import os

import numpy as np
import torch
import torch.distributed as dist

from mp_data.gpt_config import GPTDatasetConfig, tokenizer_identity
from mp_data.index_cache import IndexCache
from mp_data.megatron_dataset import MegatronDataset
from mp_data.sft_conversations import SFTDataError, read_conversations
from mp_data.sft_packing import pack_conversations, packed_sample, padded_lengths

__all__ = ["SFTDataset", "SFTLowLevelDataset"]

log = logging.getLogger("mp_data")

_TOKEN_ARRAYS = ("tokens", "assistant", "conversation_offsets", "line_conversations",
                 "line_numbers")  # fmt: skip
_SAMPLE_ARRAYS = ("sample_bounds", "shuffle_index")


def _builds_caches() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _cache_folder(config: GPTDatasetConfig, path: str) -> str:
    if config.path_to_cache is not None:
        return config.path_to_cache
    return os.path.join(os.path.dirname(os.path.abspath(path)), "cache", "SFTDataset_indices")


class SFTLowLevelDataset:
    """The tokenized conversations of one JSONL file; its elements are the file's lines."""

    def __init__(self, path: str, config: GPTDatasetConfig) -> None:
        tokenizer = config.tokenizer
        if not hasattr(tokenizer, "tokenize_conversation"):
            raise ValueError(f"SFT data needs an SFTTokenizer (a tokenizer.json and a prompt "
                             f"format), got {type(tokenizer).__name__}")  # fmt: skip
        try:
            stat = os.stat(path)
        except OSError as error:
            raise FileNotFoundError(
                f"{path}: cannot read the SFT data ({error.strerror})"
            ) from None
        self.path = path
        self.tokenizer = tokenizer
        self.description = {
            "class": type(self).__name__,
            "dataset_path": path,
            "file_size": stat.st_size,
            "file_mtime_ns": stat.st_mtime_ns,
            "tokenizer": tokenizer_identity(tokenizer),
        }
        cache = IndexCache(_cache_folder(config, path), type(self).__name__, self.description,
                           _TOKEN_ARRAYS)  # fmt: skip
        arrays = cache.load_or_build(self._tokenize, _builds_caches())
        self.tokens = arrays["tokens"]
        self.assistant = arrays["assistant"]
        self.conversation_offsets = arrays["conversation_offsets"]
        self.line_conversations = arrays["line_conversations"]
        self.line_numbers = arrays["line_numbers"]

    def _tokenize(self) -> dict[str, np.ndarray]:
        ids, flags, conversation_lengths, line_counts, numbers = [], [], [], [], []
        for number, conversations in read_conversations(self.path):
            for messages in conversations:
                try:
                    tokens, assistant = self.tokenizer.tokenize_conversation(messages)
                except Exception as error:  # a template's own error (raise_exception) too
                    raise SFTDataError(f"{self.path}:{number}: {error}") from error
                ids.append(tokens)
                flags.append(assistant)
                conversation_lengths.append(len(tokens))
            line_counts.append(len(conversations))
            numbers.append(number)
        if not numbers:
            raise SFTDataError(f"{self.path}: no conversations (the file has no non-blank line)")
        log.info("tokenized %s: %d lines, %d conversations, %d tokens", self.path,
                 len(numbers), len(ids), sum(conversation_lengths))  # fmt: skip
        return {
            "tokens": np.concatenate(ids).astype(np.int32),
            "assistant": np.concatenate(flags).astype(bool),
            "conversation_offsets": _offsets(conversation_lengths),
            "line_conversations": _offsets(line_counts),
            "line_numbers": np.asarray(numbers, dtype=np.int64),
        }

    def __len__(self) -> int:
        return len(self.line_numbers)

    def conversations_of(self, lines: np.ndarray) -> np.ndarray:
        """The conversation ids of `lines` (element ids), in their order."""
        lines = np.asarray(lines, dtype=np.int64)
        starts = self.line_conversations[lines]
        counts = self.line_conversations[lines + 1] - starts
        # Each line's run starts..starts + count, the runs concatenated.
        shift = np.repeat(starts - (np.cumsum(counts) - counts), counts)
        return np.arange(int(counts.sum()), dtype=np.int64) + shift

    def lengths(self, conversations: np.ndarray) -> np.ndarray:
        offsets = self.conversation_offsets
        return offsets[conversations + 1] - offsets[conversations]

    def get(self, conversation: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, assistant flags) of one conversation."""
        lo, hi = self.conversation_offsets[conversation : conversation + 2]
        return self.tokens[lo:hi], self.assistant[lo:hi]


class SFTDataset(MegatronDataset):
    """Packed samples of `config.sequence_length` tokens from the lines `indexed_indices`.

    Its length is a whole number of passes over the split's samples: one, or as many as
    num_samples needs, each in its own shuffled order (GPTDataset's epochs).
    """

    def __init__(self, *args) -> None:
        """The builder's arguments (MegatronDataset)."""
        super().__init__(*args)
        config = self.config
        tokenizer = config.tokenizer
        self._eod = tokenizer.eod
        pad = getattr(tokenizer, "pad", None)
        self._pad = pad if pad is not None else (self._eod if self._eod is not None else 0)
        self.conversations = self.dataset.conversations_of(self.indices)
        self._capacity = config.sequence_length + 1
        cp = config.context_parallel_size
        self._multiple = 2 * cp if cp > 1 else 1
        raw = self.dataset.lengths(self.conversations)
        lengths = padded_lengths(raw, self._multiple)
        cache = IndexCache(_cache_folder(config, self.dataset.path),
                           f"{type(self).__name__}-{self.index_split.name}", self.description(),
                           _SAMPLE_ARRAYS)  # fmt: skip
        arrays = cache.load_or_build(lambda: self._plan(lengths), _builds_caches())
        self.sample_bounds = arrays["sample_bounds"]
        self.shuffle_index = arrays["shuffle_index"]
        if _builds_caches():
            self._log_packing(raw)

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig):
        """The tokenized JSONL file (hook of BlendedMegatronDatasetBuilder)."""
        return SFTLowLevelDataset(dataset_path, config)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: SFTLowLevelDataset) -> int:
        """Splits divide a file's lines (Megatron's SFTDataset: one line, one element)."""
        return len(low_level_dataset)

    def description(self) -> dict:
        """Every setting that shapes the sample bounds and the shuffle: the cache key."""
        description = {**self.split_description(), "low_level": self.dataset.description}
        if self._multiple > 1:
            description["conversation_multiple"] = self._multiple
        return description

    def _plan(self, lengths: np.ndarray) -> dict[str, np.ndarray]:
        bounds = pack_conversations(lengths, self._capacity)
        packs = len(bounds) - 1
        if packs == 0:
            raise ValueError(
                f"{self.dataset_path} ({self.index_split.name} split): its {len(self.indices)} "
                "lines hold no token to pack; give the split more lines (split) or the file "
                "more conversations"
            )
        # Whole passes, as GPTDataset has whole epochs: at least one, enough for num_samples.
        passes = max(1, math.ceil((self.num_samples or 0) / packs))
        rng = np.random.RandomState(self.config.random_seed)
        shuffle = np.concatenate([rng.permutation(packs) for _ in range(passes)])
        return {"sample_bounds": bounds, "shuffle_index": shuffle.astype(np.int64)}

    def _log_packing(self, lengths: np.ndarray) -> None:
        """One line per split: what was packed, how full (conversation tokens, padding
        excluded), what was truncated."""
        packs = len(self.sample_bounds) - 1
        over = lengths > self._capacity
        kept = int(np.minimum(lengths, self._capacity).sum())
        fill = kept / (packs * self._capacity) if packs else 0.0
        line = (f"SFTDataset {self.index_split.name} ({self.dataset_path}): {len(self.indices)} "
                f"lines, {len(lengths)} conversations in {packs} samples of "
                f"{self.config.sequence_length} + 1 tokens ({fill:.1%} filled)")  # fmt: skip
        if self._multiple > 1:
            padding = int((padded_lengths(lengths, self._multiple) - lengths).sum())
            line += (f"; each conversation padded to a multiple of {self._multiple} tokens "
                     f"(2 x context_parallel_size; {padding} padding tokens)")  # fmt: skip
        if over.any():
            dropped = int((lengths[over] - self._capacity).sum())
            line += (f"; {int(over.sum())} conversations longer than {self._capacity} tokens "
                     f"truncated ({dropped} tokens dropped)")  # fmt: skip
        log.info(line)

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def __getitem__(self, idx: int | None) -> dict[str, torch.Tensor]:
        """Sample idx; None gives a padding sample (sample 0 with no loss)."""
        j = int(self.shuffle_index[0 if idx is None else idx])
        lo, hi = self.sample_bounds[j : j + 2]
        parts = [self.dataset.get(int(c)) for c in self.conversations[lo:hi]]
        c = self.config
        item = packed_sample(parts, c.sequence_length, self._pad, self._eod, c.eod_mask_loss,
                             self._multiple)  # fmt: skip
        if idx is None:
            item["loss_mask"].zero_()
        return item


def _offsets(counts: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
