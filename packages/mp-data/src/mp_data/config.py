"""DataConfig: the training run's data settings, with Megatron-LM's argument names.

GPTDatasetConfig (gpt_config.py) describes one dataset build; this is what a
user sets on the command line or in YAML (--data-path, --split,
--tokenizer-type, ...), from which the training loop builds the datasets,
the tokenizer and the loaders.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal, get_args

from mp_data.fim_config import FimDataConfig, check_fim
from mp_data.gpt_config import check_builder_settings

__all__ = ["DataConfig"]

SFTPromptFormat = Literal["default", "nemotron-h-aligned", "nemotron-nano-v2", "identity"]
"""The prompt formats of mp_data.SFT_PROMPT_FORMATS."""


@dataclass(kw_only=True)
class DataConfig(FimDataConfig):
    data_path: list[str] | None = None
    """Datasets as [weight] prefix pairs or prefixes (Megatron's blend), each the path of a
    .bin/.idx pair without the extension."""

    split: str | None = "969, 30, 1"
    """Train, validation, test proportions of data_path's documents."""

    train_data_path: list[str] | None = None
    """Training datasets of their own (instead of data_path + split)."""

    valid_data_path: list[str] | None = None
    """Validation datasets of their own."""

    test_data_path: list[str] | None = None
    """Test datasets of their own."""

    data_args_path: str | None = None
    """A text file holding data_path (weights and prefixes separated by whitespace), for a
    blend too long for the command line; instead of data_path."""

    per_split_data_args_path: str | None = None
    """A JSON file {"train": ..., "valid": ..., "test": ...}, each a list of weights and
    prefixes (or one whitespace-separated string); instead of train/valid/test_data_path."""

    data_cache_path: str | None = None
    """Where the dataset indices are cached (default: beside the data)."""

    mock_data: bool = False
    """Synthetic token sequences instead of data files (data paths are not read); the
    three splits are even (split 1,1,1), as megatron-core's mock data."""

    tokenizer_type: str | None = None
    """GPT2BPETokenizer, HuggingFaceTokenizer, NullTokenizer, ... (mp_data.TOKENIZER_TYPES)."""

    tokenizer_model: str | None = None
    """A tokenizer file or directory (HuggingFaceTokenizer)."""

    vocab_file: str | None = None
    """The vocabulary (GPT2BPETokenizer's vocab.json)."""

    merge_file: str | None = None
    """The BPE merges (GPT2BPETokenizer's merges.txt)."""

    vocab_size: int | None = None
    """The vocabulary size of NullTokenizer (and of mock data without a tokenizer): ids
    0 .. vocab_size - 1, the last one its end-of-document id unless
    null_tokenizer_eod_id names another (megatron.core's NullTokenizer)."""

    null_tokenizer_eod_id: int | None = None
    """NullTokenizer's end-of-document id; None: vocab_size - 1."""

    null_tokenizer_pad_id: int = -1
    """NullTokenizer's pad id (labels equal to it get no loss: choose an id the data does
    not hold); -1: none."""

    allow_ambiguous_pad_tokens: bool = False
    """Keep the tokenizer's pad id even when it is also its eod or bos, so those tokens get
    no loss (Megatron's flag, for a tokenizer whose pad is wrongly shared); off, such a pad
    is not used."""

    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this times the tensor-parallel size."""

    pad_vocab_size: bool = True
    """Pad the vocabulary by make_vocab_size_divisible_by when padded_vocab_size is not
    given (Megatron's); False needs padded_vocab_size (the embedding's rows as given)."""

    padded_vocab_size: int | None = None
    """The embedding table's rows as given (Megatron's --padded-vocab-size): at least the
    tokenizer's vocabulary and divisible by the tensor-parallel size; None: the vocabulary
    padded by make_vocab_size_divisible_by."""

    mid_level_dataset_surplus: float = 0.005
    """The extra fraction of samples each dataset of a blend builds, so that the blend never
    runs short of one (Megatron's)."""

    num_dataset_builder_threads: int = 1
    """Threads per rank that build the datasets of a blend's prefixes (Megatron's): rank 0
    builds them all, then the other ranks, which read the indices rank 0 cached; the
    datasets are the same with any number."""

    dataloader_type: Literal["single", "cyclic"] = "single"
    """single: one pass in order; cyclic: reshuffled every epoch."""

    num_workers: int = 2
    """Data-loader worker processes."""

    reset_position_ids: bool = False
    """Restart position ids after each end-of-document token."""

    reset_attention_mask: bool = False
    """Block attention across end-of-document tokens."""

    eod_mask_loss: bool = False
    """No loss on end-of-document tokens."""

    create_attention_mask_in_dataloader: bool = True
    """Build attention masks in the data loader (Megatron's default). Only what holds
    more than causality is built: with reset_attention_mask each sample's document ids
    (an s x s mask is never materialized; attention runs document by document). False
    forbids reset_attention_mask (documents would see each other)."""

    sft: bool = False
    """Supervised fine-tuning data (Megatron's --sft): data_path (or train/valid/test_data_path)
    names JSONL files of chat conversations, {"messages": [{"role": ..., "content": ...}, ...]}
    a line, rendered with sft_tokenizer_prompt_format and packed into seq_length samples,
    loss on the assistant's tokens only, conversations kept apart by their document_ids
    (docs/sft.md). Needs tokenizer_type HuggingFaceTokenizer (or Megatron's SFTTokenizer)
    and transformers (pip install 'mp-data[sft]')."""

    sft_tokenizer_prompt_format: SFTPromptFormat = "nemotron-h-aligned"
    """How sft renders a conversation: default, the tokenizer's own chat template
    (tokenizer_config.json); nemotron-h-aligned (Megatron's default), nemotron-nano-v2 or
    identity, Megatron's named formats."""

    def __post_init__(self) -> None:
        if self.dataloader_type not in ("single", "cyclic"):
            raise ValueError(
                f"dataloader_type={self.dataloader_type!r} must be one of single, cyclic"
            )
        if self.num_workers < 0:
            raise ValueError(f"num_workers={self.num_workers} must be >= 0")
        if self.make_vocab_size_divisible_by < 1:
            raise ValueError(
                f"make_vocab_size_divisible_by={self.make_vocab_size_divisible_by} must be >= 1"
            )
        if self.padded_vocab_size is not None and self.padded_vocab_size < 1:
            raise ValueError(f"padded_vocab_size={self.padded_vocab_size} must be >= 1")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"vocab_size={self.vocab_size} must be >= 1")
        if not self.pad_vocab_size and self.padded_vocab_size is None:
            raise ValueError("pad_vocab_size=False leaves the embedding's rows unknown: give "
                             "padded_vocab_size")  # fmt: skip
        check_builder_settings(self.mid_level_dataset_surplus, self.num_dataset_builder_threads)
        self._check_null_tokenizer_ids()
        if self.reset_attention_mask and not self.create_attention_mask_in_dataloader:
            raise ValueError(
                "reset_attention_mask=True needs create_attention_mask_in_dataloader=True: the "
                "per-document attention mask is built by the data loader"
            )
        formats = get_args(SFTPromptFormat)
        if self.sft_tokenizer_prompt_format not in formats:
            raise ValueError(f"sft_tokenizer_prompt_format={self.sft_tokenizer_prompt_format!r} "
                             f"must be one of {', '.join(formats)}")  # fmt: skip
        if self.sft and self.mock_data:
            raise ValueError("sft=True reads JSONL conversations; mock_data=True has none: "
                             "give one of them")  # fmt: skip
        check_fim(self)
        self._read_data_args()
        if self.data_path and self.train_data_path:
            raise ValueError("data_path and train_data_path are exclusive: give one")

    def _read_data_args(self) -> None:
        """data_path from data_args_path; the per-split paths from per_split_data_args_path."""
        if self.data_args_path is not None:
            if self.data_path:
                raise ValueError("data_path and data_args_path are exclusive: give one")
            self.data_path = _read_text(self.data_args_path, "data_args_path").split()
            if not self.data_path:
                raise ValueError(f"data_args_path {self.data_args_path}: the file is empty")
        if self.per_split_data_args_path is None:
            return
        path = self.per_split_data_args_path
        if self.train_data_path or self.valid_data_path or self.test_data_path:
            raise ValueError("per_split_data_args_path and train/valid/test_data_path are "
                             "exclusive: give one")  # fmt: skip
        try:
            splits = json.loads(_read_text(path, "per_split_data_args_path"))
        except json.JSONDecodeError as error:
            raise ValueError(f"per_split_data_args_path {path}, line {error.lineno}: not "
                             f"JSON ({error.msg})") from None  # fmt: skip
        if not isinstance(splits, dict):
            raise ValueError(f"per_split_data_args_path {path}: expected a JSON object with "
                             "train, valid and test")  # fmt: skip
        for split in ("train", "valid", "test"):
            if split not in splits:
                raise ValueError(f"per_split_data_args_path {path}: no {split!r} key")
            value = splits[split]
            paths = value.split() if isinstance(value, str) else value
            if not isinstance(paths, list) or not all(isinstance(p, str | int | float)
                                                      for p in paths):  # fmt: skip
                raise ValueError(f"per_split_data_args_path {path}: {split!r} must be a list "
                                 "of weights and prefixes or one string of them")  # fmt: skip
            setattr(self, f"{split}_data_path", [str(p) for p in paths] or None)

    def _check_null_tokenizer_ids(self) -> None:
        given = [f"{name}={value}" for name, value, unset in (
            ("null_tokenizer_eod_id", self.null_tokenizer_eod_id, None),
            ("null_tokenizer_pad_id", self.null_tokenizer_pad_id, -1),
        ) if value != unset]  # fmt: skip
        if given and self.tokenizer_type not in (None, "NullTokenizer"):
            raise ValueError(
                f"{' and '.join(given)} set NullTokenizer's ids; tokenizer_type="
                f"{self.tokenizer_type} has its own"
            )
        if self.null_tokenizer_pad_id < -1:
            raise ValueError(
                f"null_tokenizer_pad_id={self.null_tokenizer_pad_id} must be an id, or -1 (none)"
            )

    @property
    def batches_carry_documents(self) -> bool:
        """The samples carry document_ids (the loader splits them into documents, which
        attention keeps apart): with reset_attention_mask, and always with sft (one
        document per conversation, as Megatron's SFT samples always carry cu_seqlens)."""
        return self.sft or (self.reset_attention_mask and self.create_attention_mask_in_dataloader)

    @property
    def has_data(self) -> bool:
        """Some source of training samples is configured."""
        return bool(self.mock_data or self.data_path or self.train_data_path)


def _read_text(path: str, field: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as error:
        raise FileNotFoundError(f"{field} {path}: cannot read it ({error.strerror})") from None
