"""GPTDatasetConfig: what data a GPT run reads and how samples are cut, Megatron's names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from mp_data.split import parse_and_normalize_split, split_matrix

__all__ = ["GPTDatasetConfig", "TokenizerLike", "tokenizer_identity"]


class TokenizerLike(Protocol):
    """All a dataset needs of a tokenizer: vocab_size, eod, and (optionally) pad."""

    vocab_size: int
    eod: int


def tokenizer_identity(tokenizer: Any) -> str | None:
    """A string that changes when the tokenization would: part of the cache key."""
    if tokenizer is None:
        return None
    identity = getattr(tokenizer, "identity", None)
    if identity is not None:
        return str(identity)
    pad = getattr(tokenizer, "pad", None)
    name = type(tokenizer).__name__
    return f"{name}(vocab_size={tokenizer.vocab_size}, eod={tokenizer.eod}, pad={pad})"


MOCK_SPLIT = "1,1,1"
"""The split megatron-core gives mock data when no blend is configured."""


@dataclass(kw_only=True)
class GPTDatasetConfig:
    random_seed: int
    """Seed of the document and sample shuffles."""

    sequence_length: int
    """Tokens per sample (the model's input length)."""

    blend: tuple[list[str], list[float] | None] | None = None
    """Dataset prefixes and their weights (None: weights from sizes), split by `split`."""

    blend_per_split: list[tuple[list[str], list[float] | None] | None] | None = None
    """One blend each for train, valid and test; excludes `blend` and `split`."""

    split: str | None = None
    """How each dataset of `blend` is divided into train, valid, test, e.g. "969,30,1".

    With neither blend nor blend_per_split it is set to "1,1,1" (megatron-core's
    mock path replaces any value given)."""

    path_to_cache: str | None = None
    """Folder for the index arrays; None: a cache/ folder beside each dataset."""

    mock: bool = False
    """Use generated data instead of files (MockGPTDataset), split by `split`.

    Set automatically, as in megatron-core, when neither blend nor
    blend_per_split is given; the split is then "1,1,1"."""

    tokenizer: Any = None
    """Needs vocab_size, eod and, optionally, pad and identity."""

    mid_level_dataset_surplus: float = 0.005
    """Extra fraction of samples each blended dataset builds, so blending never runs short."""

    num_dataset_builder_threads: int = 1
    """Threads that build the datasets of a blend's prefixes on each rank (Megatron's
    --num-dataset-builder-threads); the datasets are the same with any number."""

    reset_position_ids: bool = False
    """Restart position ids after every end-of-document token."""

    reset_attention_mask: bool = False
    """Stop attention across end-of-document tokens (needs create_attention_mask): the
    samples carry "document_ids" instead of an s x s mask."""

    context_parallel_size: int = 1
    """The run's context-parallel size: above 1, SFT samples pad each conversation to a
    multiple of 2 x context_parallel_size tokens (Megatron's SFTDataset), so that context
    parallelism can split every conversation into its own chunks
    (mp_layers.PackedSeqParams, split "document")."""

    eod_mask_loss: bool = False
    """Give end-of-document tokens no loss."""

    create_attention_mask: bool = True
    """Return what attention needs beyond causality: with reset_attention_mask each
    sample's "document_ids" ([s] int64, the document of each token: attention stays within
    a document), else an explicit causal [1, s, s] attention mask."""

    add_extra_token_to_sequence: bool = True
    """Read sequence_length + 1 tokens per sample, so the last token also has a label."""

    drop_last_partial_validation_sequence: bool = True
    """Drop (else pad) the last, incomplete validation sample."""

    allow_ambiguous_pad_tokens: bool = False
    """Keep the tokenizer's pad id even when it is also its eod or bos (Megatron's
    --allow-ambiguous-pad-tokens): labels equal to it get no loss, those special tokens
    included. False: such a pad is not used, so the data's special tokens keep their loss."""

    split_matrix: list[tuple[float, float] | None] | None = field(init=False, default=None)
    """Derived from `split`: the (start, end) fraction of each split."""

    def __post_init__(self) -> None:
        if isinstance(self.sequence_length, bool) or self.sequence_length < 1:
            raise ValueError(f"sequence_length={self.sequence_length} must be >= 1")
        if isinstance(self.context_parallel_size, bool) or self.context_parallel_size < 1:
            raise ValueError(f"context_parallel_size={self.context_parallel_size} must be >= 1")
        check_builder_settings(self.mid_level_dataset_surplus, self.num_dataset_builder_threads)
        if self.blend_per_split is not None and any(self.blend_per_split):
            if self.blend is not None:
                raise ValueError("blend and blend_per_split are exclusive: give one of them")
            if len(self.blend_per_split) != 3:
                raise ValueError(
                    f"blend_per_split has {len(self.blend_per_split)} entries; it needs 3 "
                    "(train, valid, test; None for a split without data)"
                )
            if self.split is not None:
                raise ValueError(f"split={self.split!r} is meaningless with blend_per_split")
        elif self.blend is None and not self.mock:
            # megatron-core's BlendedMegatronDatasetConfig: no data named means
            # mock data, split evenly whatever `split` said.
            self.mock = True
            self.split = MOCK_SPLIT
            self.split_matrix = split_matrix(parse_and_normalize_split(self.split))
        else:
            if self.split is None:
                raise ValueError("split is required with blend or mock, e.g. split='969,30,1'")
            self.split_matrix = split_matrix(parse_and_normalize_split(self.split))
        for blend_name, blend in [("blend", self.blend)] + [
            (f"blend_per_split[{i}]", b) for i, b in enumerate(self.blend_per_split or [])
        ]:
            _check_blend(blend_name, blend)
        if self.tokenizer is None:
            raise ValueError("tokenizer is required (vocab_size, eod and, optionally, pad)")
        if self.reset_attention_mask and not self.create_attention_mask:
            raise ValueError("reset_attention_mask=True needs create_attention_mask=True")


def _check_blend(name: str, blend) -> None:
    if blend is None:
        return
    prefixes, weights = blend
    if not prefixes:
        raise ValueError(f"{name} lists no dataset prefixes")
    if weights is None:
        return
    if len(weights) != len(prefixes):
        raise ValueError(f"{name}: {len(weights)} weights for {len(prefixes)} datasets")
    negative = [w for w in weights if w < 0]
    if negative:
        raise ValueError(f"{name}: weights must be >= 0, got {negative}")
    if sum(weights) <= 0:
        raise ValueError(f"{name}: weights sum to {sum(weights)}; at least one must be positive")


def check_builder_settings(mid_level_dataset_surplus: float, num_dataset_builder_threads: int):
    """The blend builder's settings, as GPTDatasetConfig and mp_data.DataConfig take them."""
    if mid_level_dataset_surplus < 0:
        raise ValueError(f"mid_level_dataset_surplus={mid_level_dataset_surplus} must be >= 0")
    threads = num_dataset_builder_threads
    if isinstance(threads, bool) or threads < 1:
        raise ValueError(f"num_dataset_builder_threads={threads} must be >= 1")
