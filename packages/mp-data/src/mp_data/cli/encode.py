"""Turning a block of JSON lines into token arrays: Megatron's Encoder.encode, a block at a time.

For each line and each --json-keys key, as megatron tools/preprocess_data.py:

- the value is one text, split into sentences with --split-sentences, or a
  list of texts taken as the sentences (a file split beforehand);
- each sentence is tokenized with the tokenizer's ordinary encode call
  (special-token text is the special token, unless --special-tokens-as-text;
  a BERT tokenizer wraps each sentence in [CLS] ... [SEP]); sentences with no
  tokens are dropped;
- with --append-eod the tokenizer's eod goes after the document's last
  sentence, if the document has any token;
- the document is then one `add_document(ids, sentence lengths)` call, so a
  line whose texts give no token is still a document, an empty one.

The result is one numpy array of tokens and a few lists of lengths per key:
cheap to send back from a worker process, and written by the main process
with one add_document call per document.

A line that cannot be encoded (not UTF-8, not JSON, no such key, a value that
is not text, an id outside the vocabulary) is recorded as (line number,
reason) and left out; the caller decides whether that fails the run.
Whitespace-only lines are skipped silently (Megatron fails on them).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

from mp_data.indexed_format import DType
from mp_data.json_lines import describe_json, json_object
from mp_data.tokenizers import Tokenizer, build_tokenizer

if TYPE_CHECKING:  # NLTK is imported only with --split-sentences: half a second saved
    from mp_data.cli.sentences import SentenceSplitter

__all__ = ["BadLine", "EncodeOptions", "EncodedBlock", "EncodedKey", "Encoder", "parse_line"]


@dataclass(frozen=True)
class EncodeOptions:
    """Everything a worker needs to build its Encoder (picklable)."""

    json_keys: tuple[str, ...]
    tokenizer_type: str
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None
    null_tokenizer_eod_id: int | None = None
    append_eod: bool = False
    split_sentences: bool = False
    keep_newlines: bool = False
    lang: str = "english"
    special_tokens_as_text: bool = False

    def build_tokenizer(self) -> Tokenizer:
        return build_tokenizer(
            self.tokenizer_type,
            vocab_file=self.vocab_file,
            merge_file=self.merge_file,
            tokenizer_model=self.tokenizer_model,
            vocab_size=self.vocab_size,
            special_tokens_as_text=self.special_tokens_as_text,
            null_tokenizer_eod_id=self.null_tokenizer_eod_id,
        )


@dataclass
class EncodedKey:
    """One key's documents of a block, ready for IndexedDatasetBuilder.add_document."""

    tokens: np.ndarray
    """[T] every token of the block's documents, in the dataset's dtype."""
    sequence_lengths: list[int]
    """[S] tokens per sequence (sentence, or whole document)."""
    document_sequences: list[int]
    """[D] sequences per document (0 for an empty document)."""
    document_tokens: list[int]
    """[D] tokens per document."""


@dataclass
class EncodedBlock:
    """What one block of lines became."""

    documents: int
    tokens: int
    """Tokens of all keys."""
    keys: dict[str, EncodedKey]
    bad_lines: list[tuple[int, str]]
    """(line number, reason) of each line left out, in line order."""
    input_bytes: int


class BadLine(Exception):
    """A line that cannot be encoded; the message says why (the caller adds file:line)."""


def parse_line(
    raw: bytes, keys: tuple[str, ...], splitter: SentenceSplitter | None = None
) -> list[list[str]]:
    """The sentences of each key's text in one JSON line (`raw`, without its newline)."""
    try:
        record = json_object(raw)
    except ValueError as e:
        raise BadLine(str(e)) from None
    per_key = []
    for key in keys:
        if key not in record:
            present = ", ".join(repr(k) for k in list(record)[:8]) or "none"
            raise BadLine(f"no key {key!r} (keys present: {present})")
        value = record[key]
        if isinstance(value, str):
            per_key.append(splitter.split(value) if splitter else [value])
        elif isinstance(value, list) and all(isinstance(s, str) for s in value):
            per_key.append(value)
        else:
            if isinstance(value, list):
                item = next(s for s in value if not isinstance(s, str))
                what = f"an array with {describe_json(item)} in it"
            else:
                what = describe_json(value)
            raise BadLine(
                f"key {key!r} holds {what}; expected a string (or an array of sentence strings)"
            )
    return per_key


class Encoder:
    """Builds its tokenizer (and Punkt) once; `encode` then serves any number of blocks."""

    def __init__(self, options: EncodeOptions) -> None:
        self.options = options
        self.keys = options.json_keys
        self.tokenizer = options.build_tokenizer()
        self.splitter: SentenceSplitter | None = None
        if options.split_sentences:
            from mp_data.cli.sentences import SentenceSplitter

            self.splitter = SentenceSplitter(options.lang, options.keep_newlines)
        self.dtype = np.dtype(DType.optimal_dtype(self.tokenizer.vocab_size))
        self.eod = self.tokenizer.eod if options.append_eod else None
        if options.append_eod and self.eod is None:
            raise ValueError(
                f"--append-eod: the {options.tokenizer_type} has no end-of-document token"
            )

    def encode(self, data: bytes, first_line: int) -> EncodedBlock:
        """Encodes the lines in `data`, the first of which is line `first_line` of its file."""
        # A block allocates a million small lists (ids) with no reference cycle;
        # the cycle collector would walk them over and over: 15% of the time on
        # short documents. Reference counting frees them all the same.
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._encode(data, first_line)
        finally:
            if collecting:
                gc.enable()

    def _encode(self, data: bytes, first_line: int) -> EncodedBlock:
        documents: list[tuple[int, list[list[list[int]]]]] = []  # (line, [key][sentence] ids)
        bad: dict[int, str] = {}
        for offset, raw in enumerate(data.split(b"\n")):
            if not raw or raw.isspace():
                continue
            try:
                per_key = parse_line(raw, self.keys, self.splitter)
                documents.append((first_line + offset, [self._tokenize(t) for t in per_key]))
            except BadLine as e:
                bad[first_line + offset] = str(e)
        keys = self._assemble(documents)
        out_of_range = self._out_of_range(keys, documents)
        if out_of_range:
            bad.update(out_of_range)
            documents = [d for d in documents if d[0] not in bad]
            keys = self._assemble(documents)
        for part in keys.values():
            part.tokens = part.tokens.astype(self.dtype)  # in range: checked above
        return EncodedBlock(
            documents=len(documents),
            tokens=sum(part.tokens.size for part in keys.values()),
            keys=keys,
            bad_lines=sorted(bad.items()),
            input_bytes=len(data),
        )

    def _tokenize(self, sentences: list[str]) -> list[list[int]]:
        # Sentence by sentence, as Megatron: measured with TOKENIZERS_PARALLELISM
        # off, tokenize_batch is no faster on long documents and 10% slower on
        # short ones.
        try:
            return [self.tokenizer.tokenize(sentence) for sentence in sentences]
        except (ValueError, TypeError) as e:
            raise BadLine(_tokenizer_error(sentences, e)) from None

    def _assemble(self, documents) -> dict[str, EncodedKey]:
        keys = {}
        for k, key in enumerate(self.keys):
            sequences: list[list[int]] = []
            document_sequences, document_tokens = [], []
            for _, per_key in documents:
                kept = [ids for ids in per_key[k] if ids]
                if kept and self.eod is not None:
                    kept[-1] = [*kept[-1], self.eod]
                sequences.extend(kept)
                document_sequences.append(len(kept))
                document_tokens.append(sum(map(len, kept)))
            lengths = [len(ids) for ids in sequences]
            tokens = np.fromiter(chain.from_iterable(sequences), np.int64, sum(lengths))
            keys[key] = EncodedKey(tokens, lengths, document_sequences, document_tokens)
        return keys

    def _out_of_range(self, keys: dict[str, EncodedKey], documents) -> dict[int, str]:
        """Lines with an id outside 0..vocab_size-1, which no tokenizer of ours should give.

        NullTokenizer rejects such ids itself (a BadLine above); this guards
        the dtype conversion against any tokenizer that does not.
        """
        limit = self.tokenizer.vocab_size
        found: dict[int, str] = {}
        for k, part in enumerate(keys.values()):
            if not part.tokens.size or (part.tokens.min() >= 0 and part.tokens.max() < limit):
                continue
            for line, per_key in documents:
                wrong = [i for ids in per_key[k] for i in ids if not 0 <= i < limit]
                if wrong:
                    found.setdefault(
                        line,
                        f"token id {wrong[0]} is outside the vocabulary 0..{limit - 1} "
                        f"of the {self.options.tokenizer_type}",
                    )
        return found


def _tokenizer_error(sentences: list[str], error: Exception) -> str:
    for sentence in sentences:
        try:
            sentence.encode("utf-8")
        except UnicodeEncodeError as e:
            # JSON can escape a lone surrogate ("\ud800"), which is no character.
            return f"the text has a lone surrogate {sentence[e.start]!r}, not valid Unicode"
    return f"the tokenizer rejects the text: {error}"
