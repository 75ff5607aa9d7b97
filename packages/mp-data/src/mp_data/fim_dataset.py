"""GPTFIMDataset: GPTDataset's samples, fill-in-the-middle transformed (mp_data.fim;
Megatron-LM's --fim-data and GPTFIMDataset, with its config's names).

The tokenizer must have a text form (a Hugging Face-backed one: HuggingFaceTokenizer,
GPT2BPETokenizer, ...), and its vocabulary the five FIM tokens (fim_extra_tokens: prefix,
middle, suffix, pad, eod) and the split token when given; each missing one is named.
Pieces are decoded without their special tokens and their parts encoded without added
ones (no beginning-of-sequence token in the middle of a sample).

Sample idx of a split draws from its own generator, seeded by (random_seed, the split,
the dataset's file name, idx): a sample is the same whatever order the loader's workers
read it in, after a resume, and wherever the files were moved or mounted (the folder is
not part of the seed; datasets of one blend that share a file name share their draws,
as every dataset does in Megatron-LM). Megatron-LM draws from one stream per dataset,
seeded alike for all, so its samples depend on the order they are read in.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass

import numpy as np

from mp_data.fim import FimSpec, fim_sample
from mp_data.gpt_config import GPTDatasetConfig
from mp_data.gpt_dataset import GPTDataset

__all__ = ["FIM_TOKEN_ROLES", "GPTFIMDataset", "GPTFIMDatasetConfig"]

FIM_TOKEN_ROLES = ("prefix", "middle", "suffix", "pad", "eod")
"""The keys of fim_extra_tokens (Megatron's)."""


@dataclass(kw_only=True)
class GPTFIMDatasetConfig(GPTDatasetConfig):
    fim_rate: float
    """Probability that a document piece of a sample is FIM-transformed."""

    fim_spm_rate: float
    """Probability that a transformed piece is in SPM order rather than PSM."""

    fim_extra_tokens: dict[str, str]
    """The tokens of the roles prefix, middle, suffix, pad and eod."""

    fim_split_sample: str | None = None
    """A token around which a piece is split into fragments, each transformed on its own."""

    fim_fragment_rate: float | None = None
    """Probability that a fragment is transformed (with fim_split_sample)."""

    fim_no_prefix: str | None = None
    """A piece or fragment whose text starts with this is kept as it is."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mock:
            raise ValueError("FIM reads text: mock data has none (Megatron refuses it too)")
        missing = [role for role in FIM_TOKEN_ROLES if not self.fim_extra_tokens.get(role)]
        if missing:
            raise ValueError(f"fim_extra_tokens has no {', '.join(missing)} token")
        for name in ("fim_rate", "fim_spm_rate", "fim_fragment_rate"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}={value} must be in [0, 1]")
        if (self.fim_split_sample is None) != (self.fim_fragment_rate is None):
            raise ValueError(
                f"fim_split_sample={self.fim_split_sample!r} and fim_fragment_rate="
                f"{self.fim_fragment_rate!r}: give both (fragments and their rate) or neither"
            )


class GPTFIMDataset(GPTDataset):
    """GPTDataset whose samples are FIM-transformed (module docstring)."""

    def __init__(self, *args) -> None:
        """The builder's arguments (MegatronDataset)."""
        super().__init__(*args)
        self._codec = _Codec(self.config.tokenizer)
        self._spec = _spec(self.config, self._codec)
        self._stream = zlib.crc32(os.path.basename(str(self.dataset_path)).encode())

    def _transform(self, text: np.ndarray, idx: int) -> np.ndarray:
        seed = [self.config.random_seed, self.index_split.value, self._stream, idx]
        return fim_sample(text, self._spec, self._codec, np.random.default_rng(seed))


class _Codec:
    """A Hugging Face-backed tokenizer as FIM's TextCodec."""

    def __init__(self, tokenizer) -> None:
        backend = getattr(tokenizer, "backend", None)
        if backend is None:
            raise ValueError(
                f"FIM needs a tokenizer with a text form (HuggingFaceTokenizer, "
                f"GPT2BPETokenizer, ...): {type(tokenizer).__name__} has none"
            )
        self.name = getattr(tokenizer, "path", type(tokenizer).__name__)
        self.backend = backend

    def decode(self, ids: np.ndarray) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def id_of(self, token: str, flag: str) -> int:
        found = self.backend.token_to_id(token)
        if found is None:
            raise ValueError(f"{flag} {token!r} is not a token of the tokenizer {self.name}")
        return found


def _spec(config: GPTFIMDatasetConfig, codec: _Codec) -> FimSpec:
    ids = {role: codec.id_of(config.fim_extra_tokens[role], f"--fim-{role}-token")
           for role in FIM_TOKEN_ROLES}  # fmt: skip
    split = config.fim_split_sample
    return FimSpec(
        rate=config.fim_rate, spm_rate=config.fim_spm_rate, **ids,
        split=None if split is None else codec.id_of(split, "--fim-split-sample"),
        fragment_rate=config.fim_fragment_rate, no_prefix=config.fim_no_prefix,
    )  # fmt: skip
