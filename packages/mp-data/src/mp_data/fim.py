"""Fill-in-the-middle (FIM): a sample's text cut at two random points and reordered, so
that a left-to-right model learns to write a middle given what comes before and after it
(Bavarian et al. 2022; Megatron-LM's GPTFIMDataset, whose rules these are).

    fim_sample(sample, spec, codec, rng)    the sample, FIM-transformed, at its length

A sample is split at its end-of-document tokens (spec.eod, kept in place); each document
piece is transformed on its own. With probability spec.rate a piece becomes text (its
special tokens dropped), is cut at two character positions drawn uniformly, and its three
parts are tokenized anew and joined with the sentinels in one of two orders:

    PSM  <prefix> prefix <suffix> suffix <middle> middle           (probability 1 - spm_rate)
    SPM  <prefix> <suffix> suffix <middle> prefix middle           (probability spm_rate)

With spec.split (Megatron's --fim-split-sample, e.g. a file separator in a repository-level
sample), a piece that holds that token is transformed, with probability spec.rate, fragment
by fragment, each fragment with probability spec.fragment_rate. A piece or fragment whose
text starts with spec.no_prefix is kept as it is. The joined sample is cut to the input's
length, or padded with spec.pad.

The draws come from `rng` (numpy's Generator API: binomial, integers), in Megatron's order,
so that the same draws give Megatron's result (tests/assets/megatron_fim). Where Megatron
drops an end-of-document (or split) token that follows an empty piece, and transforms the
empty piece after a trailing one (three sentinels around nothing), every such token is kept
here and empty pieces are left alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

__all__ = ["FimSpec", "TextCodec", "fim_sample"]


class TextCodec(Protocol):
    """Ids <-> text for FIM: decode drops special tokens, encode adds none."""

    def decode(self, ids: np.ndarray) -> str: ...

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class FimSpec:
    """The FIM settings of a dataset, with the sentinel ids (module docstring)."""

    rate: float
    spm_rate: float
    prefix: int
    middle: int
    suffix: int
    pad: int
    eod: int
    split: int | None = None
    fragment_rate: float | None = None
    no_prefix: str | None = None


def fim_sample(sample: np.ndarray, spec: FimSpec, codec: TextCodec, rng) -> np.ndarray:
    """`sample` (int64 ids) FIM-transformed piece by piece, cut or padded to its length."""
    joined = _join(_pieces(sample, spec.eod), spec.eod, lambda p: _fim_piece(p, spec, codec, rng))
    n = len(sample)
    if len(joined) >= n:
        return joined[:n]
    return np.concatenate([joined, np.full(n - len(joined), spec.pad, np.int64)])


def _pieces(ids: np.ndarray, token: int) -> list[np.ndarray]:
    """`ids` split at each `token` (dropped): one more piece than tokens, some maybe empty."""
    cuts = np.flatnonzero(ids == token)
    starts, ends = np.concatenate([[0], cuts + 1]), np.concatenate([cuts, [len(ids)]])
    return [ids[a:b] for a, b in zip(starts, ends, strict=True)]


def _join(pieces: list[np.ndarray], token: int, transform) -> np.ndarray:
    """The pieces, each non-empty one transformed, with `token` between them."""
    out: list[np.ndarray] = []
    for k, piece in enumerate(pieces):
        if k:
            out.append(np.array([token], np.int64))
        if len(piece):
            out.append(np.asarray(transform(piece), np.int64))
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def _fim_piece(piece: np.ndarray, spec: FimSpec, codec: TextCodec, rng) -> np.ndarray:
    """One document piece: whole, or fragment by fragment around spec.split."""
    if spec.split is None or not (piece == spec.split).any():
        return _permute(piece, spec.rate, spec, codec, rng)
    if not rng.binomial(1, spec.rate):
        return piece
    fragments = _pieces(piece, spec.split)
    return _join(fragments, spec.split,
                 lambda f: _permute(f, spec.fragment_rate, spec, codec, rng))  # fmt: skip


def _permute(ids: np.ndarray, rate: float, spec: FimSpec, codec: TextCodec, rng) -> np.ndarray:
    """With probability `rate`, `ids` as PSM or SPM (module docstring); else unchanged."""
    if not rng.binomial(1, rate):
        return ids
    text = codec.decode(ids)
    if spec.no_prefix is not None and text.startswith(spec.no_prefix):
        return ids
    first, second = sorted(int(b) for b in rng.integers(0, len(text) + 1, size=2))
    prefix, middle, suffix = (
        np.asarray(codec.encode(part), np.int64)
        for part in (text[:first], text[first:second], text[second:])
    )
    if rng.binomial(1, spec.spm_rate):
        parts = [[spec.prefix, spec.suffix], suffix, [spec.middle], prefix, middle]
    else:
        parts = [[spec.prefix], prefix, [spec.suffix], suffix, [spec.middle], middle]
    return np.concatenate([np.asarray(p, np.int64) for p in parts])
