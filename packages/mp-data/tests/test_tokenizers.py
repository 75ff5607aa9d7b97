"""Tokenizers: known GPT-2 and BERT ids, Megatron's special ids, build_tokenizer, bad input.

The vocabularies are the real GPT-2 and bert-base-uncased files under
assets/tokenizers/ (see its README). test_tokenizer_reference.py checks the
same tokenizers against independent re-implementations on a wider text.
"""

import json
import shutil
import sys
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from mp_data.tokenizers import (
    TOKENIZER_TYPES,
    BertWordPieceCase,
    BertWordPieceLowerCase,
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    NullTokenizer,
    Tokenizer,
    build_tokenizer,
    vocab_size_with_padding,
)

ASSETS = Path(__file__).parent / "assets" / "tokenizers"
GPT2_VOCAB, GPT2_MERGES = ASSETS / "gpt2" / "vocab.json", ASSETS / "gpt2" / "merges.txt"
BERT_VOCAB = ASSETS / "bert-uncased" / "vocab.txt"


@pytest.fixture(scope="module")
def gpt2() -> GPT2BPETokenizer:
    return GPT2BPETokenizer(GPT2_VOCAB, GPT2_MERGES)


@pytest.fixture(scope="module")
def bert() -> BertWordPieceLowerCase:
    return BertWordPieceLowerCase(BERT_VOCAB)


def test_tokenizers_is_hugging_faces_package():
    # mp_data.tokenizers must not shadow the library its modules import.
    from mp_data.tokenizers import gpt2 as module

    assert module.tokenizers is tokenizers
    assert "mp_data" not in Path(tokenizers.__file__).parts
    assert hasattr(tokenizers, "Tokenizer")
    assert sys.modules["mp_data.tokenizers"].__file__.endswith("__init__.py")


# GPT-2 ------------------------------------------------------------------------

GPT2_KNOWN = [
    ("Hello world", [15496, 995]),
    (" Hello", [18435]),
    ("hello world", [31373, 995]),
    ("The quick brown fox", [464, 2068, 7586, 21831]),
    ("Hello, my dog is cute", [15496, 11, 616, 3290, 318, 13779]),
    ("\n", [198]),
    ("\n\n", [628]),  # one pre-token when nothing follows ...
    ("a\n\nb", [64, 198, 198, 65]),  # ... two when a word does (GPT-2's \s+(?!\S))
    ("  ", [220, 220]),  # GPT-2 has no multi-space tokens
    # The literal text is the special token, as in megatron-core 0.19 (transformers).
    ("<|endoftext|>", [50256]),
    ("Hello <|endoftext|> world", [15496, 220, 50256, 995]),
    ("", []),
]


@pytest.mark.parametrize(("text", "ids"), GPT2_KNOWN)
def test_gpt2_known_ids(gpt2, text, ids):
    assert gpt2.tokenize(text) == ids
    assert gpt2.detokenize(ids) == text


def test_gpt2_special_tokens_as_text(gpt2):
    plain = GPT2BPETokenizer(GPT2_VOCAB, GPT2_MERGES, special_tokens_as_text=True)
    assert plain.tokenize("<|endoftext|>") == [27, 91, 437, 1659, 5239, 91, 29]
    assert plain.tokenize("Hello world") == gpt2.tokenize("Hello world")
    assert plain.detokenize(plain.tokenize("a<|endoftext|>b")) == "a<|endoftext|>b"
    # The ids of some texts differ, so cached dataset indices must not be shared.
    assert plain.identity != gpt2.identity
    built = build_tokenizer("GPT2BPETokenizer", vocab_file=GPT2_VOCAB, merge_file=GPT2_MERGES,
                            special_tokens_as_text=True)  # fmt: skip
    assert built.identity == plain.identity


def test_gpt2_special_ids_and_sizes(gpt2):
    assert (gpt2.vocab_size, gpt2.eod, gpt2.eos, gpt2.bos) == (50257, 50256, 50256, 50256)
    assert gpt2.pad is None
    assert gpt2.vocab["<|endoftext|>"] == 50256 and gpt2.inv_vocab[15496] == "Hello"
    assert len(gpt2.vocab) == len(gpt2.inv_vocab) == 50257
    assert vocab_size_with_padding(gpt2.vocab_size) == 50304
    assert isinstance(gpt2, Tokenizer)


def test_gpt2_round_trips_unicode_and_repairs_split_characters(gpt2):
    text = "naïve café, 東京 🤗\ttabs  and   spaces\r\n"
    assert gpt2.detokenize(gpt2.tokenize(text)) == text
    (emoji_ids,) = [gpt2.tokenize("🤗")]
    assert len(emoji_ids) > 1  # 4 UTF-8 bytes, several tokens
    # Half a character is not UTF-8: replaced, as Megatron's errors='replace' does.
    assert gpt2.detokenize(emoji_ids[:1]) == "\ufffd"


def test_gpt2_batch_equals_one_by_one(gpt2):
    texts = ["Hello world", "", " x\n\ny", "<|endoftext|> tail"]
    assert gpt2.tokenize_batch(texts) == [gpt2.tokenize(t) for t in texts]


def test_gpt2_detokenize_rejects_ids_outside_the_vocabulary(gpt2):
    with pytest.raises(ValueError, match=r"id 50257 is outside the vocabulary 0\.\.50256"):
        gpt2.detokenize([15496, 50257])
    with pytest.raises(ValueError, match="id -1"):
        gpt2.detokenize([-1])


def test_gpt2_accepts_numpy_ids(gpt2):
    np = pytest.importorskip("numpy")
    assert gpt2.detokenize(np.array([15496, 995], dtype=np.int32)) == "Hello world"


# BERT -------------------------------------------------------------------------


def test_bert_known_ids(bert):
    # The transformers docs' example: every encoded text is [CLS] ... [SEP].
    assert bert.tokenize("Hello, my dog is cute") == [101, 7592, 1010, 2026, 3899, 2003, 10140,
                                                      102]  # fmt: skip
    assert bert.tokenize("hello world") == [101, 7592, 2088, 102]
    assert bert.tokenize("Héllo") == bert.tokenize("hello")  # lowercased, accent stripped
    assert bert.tokenize("") == [101, 102]


def test_bert_special_ids_follow_megatron_core(bert):
    # megatron-core 0.19: [SEP] is eos and eod, [CLS] is bos; nothing is appended.
    assert (bert.pad, bert.cls, bert.sep, bert.mask) == (0, 101, 102, 103)
    assert (bert.bos, bert.eos, bert.eod, bert.vocab_size) == (101, 102, 102, 30522)
    assert vocab_size_with_padding(bert.vocab_size) == 30592


def test_bert_special_tokens_in_text(bert):
    # Matched as written, before lower-casing: "[sep]" is text.
    assert bert.tokenize("a [SEP] b [sep]") == [101, 1037, 102, 1038, 1031, 19802, 1033, 102]
    assert bert.tokenize("[CLS][MASK]") == [101, 101, 103, 102]
    plain = BertWordPieceLowerCase(BERT_VOCAB, special_tokens_as_text=True)
    assert plain.tokenize("a [SEP] b") == [101, 1037, 1031, 19802, 1033, 1038, 102]
    assert plain.identity != bert.identity


def test_bert_detokenize(bert):
    ids = bert.tokenize("Hello, my dog is cute!")
    assert bert.detokenize(ids) == "[CLS] hello, my dog is cute! [SEP]"
    assert bert.detokenize(bert.tokenize("unaffable")[1:-1]) == "unaffable"
    # tokenizers cleans up token by token; Megatron's join would give "it's".
    assert bert.detokenize(bert.tokenize("it's")[1:-1]) == "it ' s"
    with pytest.raises(ValueError, match="id 30522 is outside"):
        bert.detokenize([30522])


def test_bert_case_keeps_case_and_accents_and_adds_extra_ids(bert):
    cased = BertWordPieceCase(BERT_VOCAB)
    assert cased.tokenize("hello Hello") == [101, 7592, 100, 102]  # the file has no "Hello"
    assert cased.tokenize("café") != bert.tokenize("café")
    assert cased.identity != bert.identity
    # megatron-core 0.19 gives BertWordPieceCase 100 <extra_id_N> special tokens.
    assert (cased.eod, cased.vocab_size) == (bert.eod, 30522 + 100)
    assert cased.tokenize("x <extra_id_3>") == [101, 1060, 30525, 102]
    assert cased.detokenize([30621]) == "<extra_id_99>"
    assert "<extra_id_3>" not in bert.vocab


def test_bert_vocab_file_errors(tmp_path):
    incomplete = tmp_path / "vocab.txt"
    incomplete.write_text("[PAD]\n[UNK]\n[CLS]\nhello\n")
    with pytest.raises(ValueError, match=r"vocab.txt: no \[SEP\], \[MASK\] in the vocabulary"):
        BertWordPieceLowerCase(incomplete)
    repeated = tmp_path / "repeated.txt"
    repeated.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nhello\nhello\n")
    with pytest.raises(ValueError, match=r"repeated.txt:7: token 'hello' repeats line 6"):
        BertWordPieceLowerCase(repeated)


def test_bert_vocab_lines_are_read_as_transformers_reads_them(tmp_path):
    # tokenizers' WordPiece.read_file: \r\n ends a line, a lone \r does not,
    # trailing whitespace goes, leading whitespace stays (megatron-core 0.19.2
    # with transformers 5 gives these ids for this file).
    vocab = tmp_path / "vocab.txt"
    special = b"[PAD]\r\n[UNK]\r\n[CLS]\r\n[SEP]\r\n[MASK]\r\n"
    vocab.write_bytes(special + b"hello \r\n there\r\na\rb\ny\n")
    tokenizer = BertWordPieceLowerCase(vocab)
    assert tokenizer.vocab_size == 9
    assert tokenizer.tokenize("hello there y") == [2, 5, 1, 8, 3]
    assert tokenizer.tokenize("a b") == [2, 1, 1, 3]


def test_bert_special_ids_are_those_of_the_file(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[EOS]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nhello\n")
    tokenizer = BertWordPieceLowerCase(vocab)
    assert (tokenizer.eod, tokenizer.bos, tokenizer.vocab_size) == (4, 3, 7)
    assert tokenizer.tokenize("Hello there") == [3, 6, 2, 4]


# Hugging Face tokenizer.json ----------------------------------------------------


def save_gpt2_tokenizer_json(folder: Path, post_processor=None, added=()) -> Path:
    """GPT-2 as a tokenizer.json, built with the tokenizers library (no download)."""
    backend = tokenizers.Tokenizer(models.BPE.from_file(str(GPT2_VOCAB), str(GPT2_MERGES)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    if post_processor is not None:
        backend.post_processor = post_processor
    backend.add_special_tokens(list(added))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenizer.json"
    backend.save(str(path))
    return path


def test_huggingface_gpt2_json_matches_gpt2(tmp_path, gpt2):
    # GPT-2's tokenizer.json registers <|endoftext|> as a special token.
    path = save_gpt2_tokenizer_json(tmp_path / "gpt2", added=["<|endoftext|>"])
    hf = HuggingFaceTokenizer(path.parent)  # the folder, or the file itself
    assert HuggingFaceTokenizer(str(path)).identity == hf.identity
    text = "Hello world, <|endoftext|> and naïve 🤗\n\nbye"
    assert hf.tokenize(text) == gpt2.tokenize(text)
    assert hf.detokenize(hf.tokenize(text)) == text
    plain = HuggingFaceTokenizer(path, special_tokens_as_text=True)
    assert plain.tokenize(text) == GPT2BPETokenizer(GPT2_VOCAB, GPT2_MERGES, True).tokenize(text)
    assert plain.tokenize(text) != hf.tokenize(text) and plain.identity != hf.identity
    # No role file: eod is the conventional <|endoftext|>; GPT-2 has no pad or bos.
    assert (hf.vocab_size, hf.eod, hf.pad, hf.bos) == (50257, 50256, None, None)
    assert hf.vocab == gpt2.vocab


def test_huggingface_roles_from_the_config_files(tmp_path):
    path = save_gpt2_tokenizer_json(tmp_path, added=["<|pad|>", "<|im_end|>"])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>",
        "bos_token": {"content": "<|endoftext|>", "lstrip": False, "__type": "AddedToken"},
        "pad_token": "<|endoftext|>",
    }))  # fmt: skip
    hf = HuggingFaceTokenizer(path)
    assert (hf.vocab_size, hf.eod, hf.bos, hf.pad) == (50259, 50258, 50256, 50256)
    # special_tokens_map.json overrides tokenizer_config.json, as in transformers.
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<|pad|>"}))
    hf2 = HuggingFaceTokenizer(tmp_path)
    assert (hf2.eod, hf2.bos, hf2.pad) == (50258, 50256, 50257)
    assert hf2.identity != hf.identity  # the role files are part of the identity
    # Added special tokens are matched in text and kept by detokenize.
    assert hf2.tokenize("hi<|im_end|>") == [5303, 50258]
    assert hf2.detokenize([5303, 50258]) == "hi<|im_end|>"


def test_huggingface_runs_the_post_processor_like_megatron(tmp_path):
    # Megatron's HuggingFaceTokenizer returns transformers' tokenizer(text).input_ids.
    bos = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 50256)]
    )
    hf = HuggingFaceTokenizer(save_gpt2_tokenizer_json(tmp_path, post_processor=bos))
    assert hf.tokenize("Hello world") == [50256, 15496, 995]
    assert hf.tokenize_batch(["Hello world"]) == [[50256, 15496, 995]]


def test_huggingface_pad_from_padding_settings_and_no_eod(tmp_path):
    path = save_gpt2_tokenizer_json(tmp_path, added=["<pad>"])
    data = json.loads(path.read_text())
    data["padding"] = {"strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": None,
                       "pad_id": 50257, "pad_type_id": 0, "pad_token": "<pad>"}  # fmt: skip
    # Rename <|endoftext|> so that no conventional end-of-text token is left.
    model_vocab = data["model"]["vocab"]
    model_vocab["<|end|>"] = model_vocab.pop("<|endoftext|>")
    path.write_text(json.dumps(data))
    hf = HuggingFaceTokenizer(path)
    assert (hf.pad, hf.eod, hf.bos) == (50257, None, None)


def test_huggingface_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"empty/tokenizer.json: no such file"):
        (tmp_path / "empty").mkdir()
        HuggingFaceTokenizer(tmp_path / "empty")
    bad = tmp_path / "bad" / "tokenizer.json"
    bad.parent.mkdir()
    bad.write_text('{"not": "a tokenizer"}')
    with pytest.raises(ValueError, match=r"bad/tokenizer.json: not a Hugging Face tokenizer.json"):
        HuggingFaceTokenizer(bad)
    path = save_gpt2_tokenizer_json(tmp_path / "good")
    (path.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ValueError, match=r"tokenizer_config.json: eos_token '</s>' is not in"):
        HuggingFaceTokenizer(path)
    (path.parent / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"tokenizer_config.json: expected a JSON object"):
        HuggingFaceTokenizer(path)


# Null -------------------------------------------------------------------------


def test_null_tokenizer_is_megatrons():
    # megatron.core's NullTokenizer: N ids, the last the eod, no pad (pad_id -1).
    null = NullTokenizer(1000)
    assert (null.vocab_size, null.eod, null.pad, null.bos) == (1000, 999, None, None)
    assert null.tokenize("5 17\t999\n 0") == [5, 17, 999, 0]
    assert null.detokenize([5, 17, 999]) == "5 17 999"
    assert null.tokenize(null.detokenize([3, 1, 2])) == [3, 1, 2]
    assert null.tokenize("") == []
    assert null.identity != NullTokenizer(999).identity
    assert NullTokenizer(__import__("numpy").int64(7)).eod == 6
    named = NullTokenizer(1000, eod_id=0, pad_id=998)
    assert (named.vocab_size, named.eod, named.pad) == (1000, 0, 998)
    assert NullTokenizer(1000, pad_id=-1).pad is None
    # The ids shape the data (eod appended, pad masked), so they shape its cache key.
    identities = {t.identity for t in (null, named, NullTokenizer(1000, eod_id=0))}
    assert len(identities) == 3


def test_null_tokenizer_errors():
    with pytest.raises(ValueError, match="'x' is not an integer id"):
        NullTokenizer(10).tokenize("1 x 2")
    with pytest.raises(ValueError, match=r"id 10 is outside the vocabulary 0\.\.9"):
        NullTokenizer(10).tokenize("1 10")
    with pytest.raises(ValueError, match=r"eod_id=10 is outside the vocabulary 0\.\.9"):
        NullTokenizer(10, eod_id=10)
    with pytest.raises(ValueError, match=r"pad_id=-2 is outside the vocabulary 0\.\.9"):
        NullTokenizer(10, pad_id=-2)
    with pytest.raises(ValueError, match="pad_id must be an integer"):
        NullTokenizer(10, pad_id=1.5)
    for size in (0, -3, 2.5, "8", True):
        with pytest.raises(ValueError, match="NullTokenizer: vocab_size"):
            NullTokenizer(size)


# build_tokenizer, identity, padding -----------------------------------------------


def test_build_tokenizer_each_type(tmp_path):
    built = {
        "GPT2BPETokenizer": build_tokenizer(
            "GPT2BPETokenizer", vocab_file=GPT2_VOCAB, merge_file=GPT2_MERGES
        ),
        "BertWordPieceLowerCase": build_tokenizer("BertWordPieceLowerCase", vocab_file=BERT_VOCAB),
        "BertWordPieceCase": build_tokenizer("BertWordPieceCase", vocab_file=BERT_VOCAB),
        "HuggingFaceTokenizer": build_tokenizer(
            "HuggingFaceTokenizer", tokenizer_model=save_gpt2_tokenizer_json(tmp_path).parent
        ),
        "SFTTokenizer": build_tokenizer("SFTTokenizer", tokenizer_model=tmp_path),
        "NullTokenizer": build_tokenizer("NullTokenizer", vocab_size=50),
    }
    null = build_tokenizer(
        "NullTokenizer", vocab_size=50, null_tokenizer_eod_id=3, null_tokenizer_pad_id=4
    )
    assert (null.vocab_size, null.eod, null.pad) == (50, 3, 4)
    assert set(built) == set(TOKENIZER_TYPES)
    for name, tokenizer in built.items():
        assert type(tokenizer).__name__ == name
        assert tokenizer.identity.startswith(name + ":")
    assert len({t.identity for t in built.values()}) == len(built)


@pytest.mark.parametrize(
    ("tokenizer_type", "kwargs", "message"),
    [
        ("GPT2BPETokenizer", {"vocab_file": "v.json"}, "'GPT2BPETokenizer' requires merge_file"),
        ("GPT2BPETokenizer", {}, "requires vocab_file and merge_file"),
        ("BertWordPieceCase", {}, "'BertWordPieceCase' requires vocab_file"),
        ("HuggingFaceTokenizer", {"vocab_file": "x"}, "requires tokenizer_model"),
        ("NullTokenizer", {}, "'NullTokenizer' requires vocab_size"),
        ("SentencePieceTokenizer", {}, "'SentencePieceTokenizer' is not supported; choose one of"),
        ("gpt2", {}, "'gpt2' is not supported"),
        (
            "BertWordPieceCase",
            {"vocab_file": "v", "null_tokenizer_eod_id": 0},
            "NullTokenizer's ids; tokenizer_type 'BertWordPieceCase' has its own",
        ),
        (
            "HuggingFaceTokenizer",
            {"tokenizer_model": "t", "null_tokenizer_pad_id": 3},
            "NullTokenizer's ids",
        ),
        ("NullTokenizer", {"vocab_size": 8, "null_tokenizer_eod_id": 8}, "eod_id=8 is outside"),
    ],
)
def test_build_tokenizer_errors(tokenizer_type, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_tokenizer(tokenizer_type, **kwargs)


def test_missing_files_are_named(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match=r"nope.json: no such file \(vocab_file of GPT2"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=missing, merge_file=GPT2_MERGES)
    with pytest.raises(FileNotFoundError, match=r"nope.json: no such file \(merge_file of GPT2"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=GPT2_VOCAB, merge_file=missing)
    with pytest.raises(FileNotFoundError, match=r"nope.json: no such file \(vocab_file of Bert"):
        build_tokenizer("BertWordPieceCase", vocab_file=missing)
    with pytest.raises(FileNotFoundError, match=r"nope.json: no such file"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=missing)


def test_gpt2_bad_files(tmp_path):
    merges = tmp_path / "merges.txt"
    merges.write_text("#version: 0.2\na b c\n")
    with pytest.raises(ValueError, match=r"not a GPT-2 vocab\.json and merges\.txt"):
        GPT2BPETokenizer(GPT2_VOCAB, merges)
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps({"a": 0, "b": 1, "ab": 2}))
    merges.write_text("#version: 0.2\na b\n")
    with pytest.raises(ValueError, match=r"vocab.json: no <\|endoftext\|> token"):
        GPT2BPETokenizer(vocab, merges)


def test_identity_follows_the_bytes_not_the_path(tmp_path, gpt2):
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    shutil.copy(GPT2_VOCAB, vocab)
    shutil.copy(GPT2_MERGES, merges)
    assert GPT2BPETokenizer(vocab, merges).identity == gpt2.identity
    # Dropping the last merge changes tokenization, so it changes the identity.
    lines = GPT2_MERGES.read_text(encoding="utf-8").split("\n")
    merges.write_text("\n".join([*lines[:-2], ""]), encoding="utf-8")
    assert GPT2BPETokenizer(vocab, merges).identity != gpt2.identity


def test_vocab_size_with_padding_is_megatrons():
    assert vocab_size_with_padding(50257) == 50304
    assert vocab_size_with_padding(50257, 128, 2) == 50432
    assert vocab_size_with_padding(50257, 128, 8) == 51200
    assert vocab_size_with_padding(50304) == 50304  # already a multiple
    assert vocab_size_with_padding(50257, 1) == 50257
    assert vocab_size_with_padding(32000, make_vocab_size_divisible_by=64) == 32000
    with pytest.raises(ValueError, match="tensor_model_parallel_size must be at least 1, got 0"):
        vocab_size_with_padding(50257, 128, 0)
    with pytest.raises(ValueError, match="make_vocab_size_divisible_by must be an integer"):
        vocab_size_with_padding(50257, 12.8)
