"""GPT-2 and BERT ids against independent re-implementations of the originals.

The product code configures Hugging Face's tokenizers; the references below
re-state, in a few lines of Python each, the algorithms (OpenAI's GPT-2
encoder, Google's BERT FullTokenizer) plus what megatron-core 0.19's
transformers-backed tokenizers add around them: the text is first cut at
every special token written in it (each becoming its id), and BERT wraps the
result in [CLS] ... [SEP] and makes words over 100 characters [UNK]. A mixed
text must give the same ids both ways, with special tokens matched and with
special_tokens_as_text.

One limit, stated: Python's `re` has no \\p{L}, so the GPT-2 reference uses
[^\\W\\d_] for letters and \\d for numbers, which agree with Unicode's classes
except on numeric symbols such as "²" or "Ⅻ"; the text avoids those (checked).
"""

import itertools
import re
import unicodedata
from pathlib import Path

import pytest

from mp_data.tokenizers import BertWordPieceCase, BertWordPieceLowerCase, GPT2BPETokenizer

ASSETS = Path(__file__).parent / "assets" / "tokenizers"
GPT2_VOCAB, GPT2_MERGES = ASSETS / "gpt2" / "vocab.json", ASSETS / "gpt2" / "merges.txt"
BERT_VOCAB = ASSETS / "bert-uncased" / "vocab.txt"

TEXT = """\
The quick brown fox jumps over the lazy dog. It's 12:45pm; we'll see what they've done!
  Leading spaces,\ttabs\t\tand   runs of  spaces   \n\n\nBlank lines; trailing\x20\x20\x20
Contractions: I'm, you're, he'd, she'll, don't, can't, it's, 'tis, O'Neil's.
Numbers 3.14159, 1,000,000 and 2024-06-01; 0x1F; 42nd; version_2 snake_case __dunder__
Punctuation!!! ??? ... --- *** ((nested [brackets] {braces})) <tags> "quotes" `code` ~tilde~
Accents: naïve café résumé Ångström Zürich São Paulo façade coöperate élan
Greek: Αλφα βήτα γάμμα. Cyrillic: Привет, мир! Arabic: مرحبا بالعالم Hebrew: שלום
CJK: 東京は日本の首都です。中文分词测试。한국어 텍스트. Kana: ひらがな カタカナ
Emoji: 🤗🚀 👍🏽 family 👨‍👩‍👧 flags 🇫🇷 and symbols © ® ™ € £ ¥ § ¶ • … – —
Unaffable unbelievable antidisestablishmentarianism supercalifragilisticexpialidocious
<|endoftext|> [CLS] [SEP] [MASK] <s></s> ##hash @user #tag https://example.com/a?b=c&d=e
Control\x00chars\x07and\u200bzero\ufeffwidth \u00a0nbsp\u3000ideographic space\r\nCRLF
Combining: e\u0301 a\u0308 n\u0303 — precomposed: é ä ñ. Mixed CaSe WoRdS ALLCAPS lowercase
"""
LONG_WORDS = ["a" * 150, "b" * 250, "x" * 99 + "y" * 101]  # around the 100 and 200 limits


def test_text_avoids_what_the_gpt2_reference_cannot_classify():
    numeric_symbols = [c for c in TEXT if unicodedata.category(c) in ("No", "Nl")]
    assert not numeric_symbols


# OpenAI's GPT-2 encoder ----------------------------------------------------------

GPT2_PATTERN = re.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+"""
)


def bytes_to_unicode() -> dict[int, str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def bpe(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    parts = list(word)
    while len(parts) > 1:
        pairs = set(itertools.pairwise(parts))
        best = min(pairs, key=lambda p: ranks.get(p, float("inf")))
        if best not in ranks:
            break
        merged, i = [], 0
        while i < len(parts):
            if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                merged.append(parts[i] + parts[i + 1])
                i += 2
            else:
                merged.append(parts[i])
                i += 1
        parts = merged
    return parts


class ReferenceGPT2:
    def __init__(self, gpt2: GPT2BPETokenizer) -> None:
        self.encoder = gpt2.vocab
        lines = GPT2_MERGES.read_text(encoding="utf-8").split("\n")[1:-1]  # as Megatron reads
        self.ranks = {tuple(line.split()): rank for rank, line in enumerate(lines)}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}

    def encode(self, text: str, special_tokens_as_text: bool = False) -> list[int]:
        if special_tokens_as_text:
            return self._encode_ordinary(text)
        return with_special_tokens(text, {"<|endoftext|>": 50256}, self._encode_ordinary)

    def _encode_ordinary(self, text: str) -> list[int]:
        ids = []
        for word in GPT2_PATTERN.findall(text):
            mapped = "".join(self.byte_encoder[b] for b in word.encode("utf-8"))
            ids += [self.encoder[token] for token in bpe(mapped, self.ranks)]
        return ids

    def decode(self, ids: list[int]) -> str:
        decoder = {i: token for token, i in self.encoder.items()}
        chars = "".join(decoder[i] for i in ids)
        return bytes(self.byte_decoder[c] for c in chars).decode("utf-8", errors="replace")


def with_special_tokens(text: str, special: dict[str, int], encode) -> list[int]:
    """encode() of the text between the special tokens written in `text`, their ids in between."""
    pattern = "(" + "|".join(re.escape(token) for token in special) + ")"
    ids = []
    for i, part in enumerate(re.split(pattern, text)):
        ids += [special[part]] if i % 2 else encode(part) if part else []
    return ids


@pytest.fixture(scope="module")
def gpt2_pair():
    gpt2 = GPT2BPETokenizer(GPT2_VOCAB, GPT2_MERGES)
    return gpt2, ReferenceGPT2(gpt2)


@pytest.mark.parametrize("as_text", [False, True])
def test_gpt2_equals_the_reference_line_by_line(gpt2_pair, as_text):
    _, reference = gpt2_pair
    gpt2 = GPT2BPETokenizer(GPT2_VOCAB, GPT2_MERGES, special_tokens_as_text=as_text)
    for line in [*TEXT.splitlines(keepends=True), TEXT, *LONG_WORDS]:
        ids = gpt2.tokenize(line)
        assert ids == reference.encode(line, special_tokens_as_text=as_text), repr(line)
        assert gpt2.detokenize(ids) == reference.decode(ids) == line
    assert (50256 in gpt2.tokenize(TEXT)) is not as_text


def test_gpt2_decodes_partial_characters_like_the_reference(gpt2_pair):
    gpt2, reference = gpt2_pair
    ids = gpt2.tokenize("🤗 東京 👨‍👩‍👧")
    for cut in range(len(ids) + 1):
        assert gpt2.detokenize(ids[:cut]) == reference.decode(ids[:cut])


# Google's BERT FullTokenizer --------------------------------------------------------


def _is_punctuation(char: str) -> bool:
    cp = ord(char)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(char).startswith("P")


def _is_cjk(cp: int) -> bool:
    ranges = [(0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
              (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF),
              (0x2F800, 0x2FA1F)]  # fmt: skip
    return any(lo <= cp <= hi for lo, hi in ranges)


def reference_bert(text: str, vocab: dict[str, int], lower_case: bool) -> list[int]:
    cleaned = []
    for char in text:
        category = unicodedata.category(char)
        if char in " \t\n\r" or category == "Zs":
            cleaned.append(" ")
        elif ord(char) in (0, 0xFFFD) or category in ("Cc", "Cf"):
            continue
        else:
            cleaned.append(f" {char} " if _is_cjk(ord(char)) else char)
    words = []
    for word in "".join(cleaned).split():
        if lower_case:
            word = unicodedata.normalize("NFD", word.lower())
            word = "".join(c for c in word if unicodedata.category(c) != "Mn")
        piece = ""
        for char in word:
            if _is_punctuation(char):
                words += [piece, char] if piece else [char]
                piece = ""
            else:
                piece += char
        if piece:
            words.append(piece)
    ids = []
    for word in words:
        pieces, start = [], 0
        while start < len(word) and len(word) <= 100:
            end = len(word)
            while end > start and ("##" * (start > 0) + word[start:end]) not in vocab:
                end -= 1
            if end == start:
                break
            pieces.append(vocab["##" * (start > 0) + word[start:end]])
            start = end
        ids += pieces if start == len(word) else [vocab["[UNK]"]]
    return ids


@pytest.mark.parametrize("as_text", [False, True])
@pytest.mark.parametrize("cls", [BertWordPieceLowerCase, BertWordPieceCase])
def test_bert_equals_the_reference_line_by_line(cls, as_text):
    bert = cls(BERT_VOCAB, special_tokens_as_text=as_text)
    file_vocab = {t: i for t, i in bert.vocab.items() if i < 30522}
    lower_case = cls is BertWordPieceLowerCase
    special = {t: file_vocab[t] for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")}
    if not lower_case:
        special |= {f"<extra_id_{i}>": 30522 + i for i in range(100)}

    def ordinary(text):
        return reference_bert(text, file_vocab, lower_case)

    cls_id, sep_id = file_vocab["[CLS]"], file_vocab["[SEP]"]
    for line in [*TEXT.splitlines(), TEXT, " ".join(LONG_WORDS), "a <extra_id_7> b", ""]:
        inner = ordinary(line) if as_text else with_special_tokens(line, special, ordinary)
        assert bert.tokenize(line) == [cls_id, *inner, sep_id], repr(line)
    # transformers' 100-character limit (Megatron's legacy tokenizer had 200).
    assert bert.tokenize(LONG_WORDS[0]) == [cls_id, bert.vocab["[UNK]"], sep_id]
    assert len(bert.tokenize("x" * 100)) > 3
