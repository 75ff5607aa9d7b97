"""Fill-in-the-middle samples (mp_data.fim, GPTFIMDataset, --fim-* flags): megatron-core's
transform for the same random draws (assets/megatron_fim, recorded from megatron-core
0.19.2's GPTFIMDataset), the parts of a transformed piece rebuilding its text, every
end-of-document token kept, samples that do not depend on the reading order, and the
refusals."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import tokenizers

from mp_data import (
    DataConfig,
    GPTDataset,
    GPTDatasetConfig,
    GPTFIMDataset,
    GPTFIMDatasetConfig,
    HuggingFaceTokenizer,
    IndexedDataset,
    IndexedDatasetBuilder,
    NullTokenizer,
    Split,
)
from mp_data.fim import FimSpec, _permute, fim_sample

ASSETS = Path(__file__).parent / "assets" / "megatron_fim"
RECORDED = json.loads((ASSETS / "cases.json").read_text())
TOKENS = RECORDED["tokens"]
ROLES = {"prefix": "<fim_prefix>", "middle": "<fim_middle>", "suffix": "<fim_suffix>",
         "pad": "<fim_pad>", "eod": "<|endoftext|>"}  # fmt: skip


class Codec:
    """The fixture's tokenizer as FIM's TextCodec (GPTFIMDataset's own is the same)."""

    def __init__(self):
        self.backend = tokenizers.Tokenizer.from_file(str(ASSETS / "tokenizer.json"))

    def decode(self, ids):
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=True)

    def encode(self, text):
        return self.backend.encode(text, add_special_tokens=False).ids


class MegatronDraws:
    """numpy's RandomState, as megatron-core draws from it, behind the Generator calls
    mp_data.fim makes (binomial, integers); counts the draws."""

    def __init__(self, seed):
        self.state, self.draws = np.random.RandomState(seed), 0

    def binomial(self, n, p):
        self.draws += 1
        return self.state.binomial(n, p)

    def integers(self, low, high, size):
        self.draws += 1
        return self.state.randint(low=low, high=high, size=size)


def spec_of(case) -> FimSpec:
    split = case["fim_split_sample"]
    return FimSpec(
        rate=case["fim_rate"], spm_rate=case["fim_spm_rate"], prefix=TOKENS["prefix"],
        middle=TOKENS["middle"], suffix=TOKENS["suffix"], pad=TOKENS["pad"], eod=TOKENS["eod"],
        split=None if split is None else TOKENS["file_sep"],
        fragment_rate=case["fim_fragment_rate"], no_prefix=case["fim_no_prefix"],
    )  # fmt: skip


@pytest.mark.parametrize("case", RECORDED["cases"], ids=[c["name"] for c in RECORDED["cases"]])
def test_the_same_draws_give_megatrons_sample(case):
    draws = MegatronDraws(case["seed"])
    sample = np.array(case["sample"], np.int64)
    got = fim_sample(sample, spec_of(case), Codec(), draws)
    assert got.tolist() == case["output"]
    assert draws.draws == case["draws"]


def test_the_cases_cover_both_orders_truncation_and_fragments():
    """The recorded cases exercise what they should (a fixture that did not would prove
    little): both sentinel orders, untouched pieces, fragments, a kept prefix."""
    outputs = [c["output"] for c in RECORDED["cases"]]
    spm = [o for o in outputs if TOKENS["prefix"] in o
           and o[o.index(TOKENS["prefix"]) + 1] == TOKENS["suffix"]]  # fmt: skip
    assert spm and len(spm) < len(outputs)  # SPM and PSM both
    assert any(c["fim_rate"] < 1 for c in RECORDED["cases"])
    assert any(o[-1] == TOKENS["pad"] for o in outputs)  # a shorter result, padded
    assert any(c["fim_split_sample"] for c in RECORDED["cases"])
    assert any(c["fim_no_prefix"] for c in RECORDED["cases"])


def test_the_parts_rebuild_the_text():
    """PSM and SPM of one piece, untruncated: prefix + middle + suffix is its text."""
    codec = Codec()
    text = "def area(r):\n    return 3.14159 * r * r\n"
    ids = np.array(codec.encode(text), np.int64)
    p, m, s = TOKENS["prefix"], TOKENS["middle"], TOKENS["suffix"]
    for spm in (0.0, 1.0):
        spec = FimSpec(rate=1.0, spm_rate=spm, prefix=p, middle=m, suffix=s,
                       pad=TOKENS["pad"], eod=TOKENS["eod"])  # fmt: skip
        for seed in range(5):
            out = _permute(ids, 1.0, spec, codec, np.random.default_rng(seed)).tolist()
            if spm:  # <pre> <suf> suffix <mid> prefix middle
                assert out[:2] == [p, s]
                suffix, rest = out[2 : out.index(m)], out[out.index(m) + 1 :]
                assert codec.decode(rest) + codec.decode(suffix) == text
            else:  # <pre> prefix <suf> suffix <mid> middle
                assert out[0] == p
                prefix, suffix = out[1 : out.index(s)], out[out.index(s) + 1 : out.index(m)]
                middle = out[out.index(m) + 1 :]
                assert codec.decode(prefix + middle + suffix) == text


def test_every_end_of_document_token_is_kept():
    """An end-of-document token at a sample's start, two in a row, and one at its end stay
    where they are, and only the non-empty pieces are transformed (Megatron drops a token
    that follows an empty piece and wraps the empty piece after a trailing one in three
    sentinels: assets/megatron_fim's edge cases)."""
    codec, eod = Codec(), TOKENS["eod"]
    one = np.array(codec.encode("x = 1"), np.int64)
    two = np.array(codec.encode("y = 2"), np.int64)
    sample = np.concatenate([[eod], one, [eod, eod], two, [eod]]).astype(np.int64)
    spec = FimSpec(rate=1.0, spm_rate=0.0, prefix=TOKENS["prefix"], middle=TOKENS["middle"],
                   suffix=TOKENS["suffix"], pad=TOKENS["pad"], eod=eod)  # fmt: skip
    rng, again = np.random.default_rng(7), np.random.default_rng(7)
    got = fim_sample(sample, spec, codec, rng)
    first, second = (_permute(piece, 1.0, spec, codec, again) for piece in (one, two))
    expected = np.concatenate([[eod], first, [eod, eod], second, [eod]])[: len(sample)]
    assert got.tolist() == expected.tolist()
    assert got[0] == eod and got[len(first) + 1] == got[len(first) + 2] == eod
    # megatron-core drops the first token: mp keeps it, for the same draws
    (case,) = [c for c in RECORDED["edge_cases"] if c["name"] == "eod_at_start"]
    mine = fim_sample(np.array(case["sample"]), spec_of(case), codec, MegatronDraws(case["seed"]))
    assert case["sample"][0] == mine[0] == eod != case["output"][0]


def documents() -> list[str]:
    return [f"def f{i}(x):\n    return x * {i} + {i * i}\n" * (1 + i % 3) for i in range(40)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """40 small code documents tokenized with the fixture's tokenizer, each closed by
    <|endoftext|>."""
    tokenizer = HuggingFaceTokenizer(ASSETS / "tokenizer.json")
    prefix = str(tmp_path_factory.mktemp("fim") / "code_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for text in documents():
        builder.add_item(np.array([*tokenizer.tokenize(text), tokenizer.eod]))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def fim_dataset(corpus, tmp_path, cls=GPTFIMDataset, tokenizer=None, **fields):
    tokenizer = tokenizer or HuggingFaceTokenizer(ASSETS / "tokenizer.json")
    common = dict(random_seed=5, sequence_length=64, tokenizer=tokenizer, split="1,0,0",
                  blend=([corpus], None),
                  path_to_cache=str(tmp_path / "cache"), create_attention_mask=False)  # fmt: skip
    if cls is GPTFIMDataset:
        config = GPTFIMDatasetConfig(**common, fim_rate=fields.pop("fim_rate", 1.0),
                                     fim_spm_rate=0.5,
                                     fim_extra_tokens=fields.pop("tokens", ROLES),
                                     **fields)  # fmt: skip
    else:
        config = GPTDatasetConfig(**common)
    data = IndexedDataset(corpus)
    return cls(data, corpus, np.arange(len(data), dtype=np.int32), 30, Split.train, config)


def test_a_sample_does_not_depend_on_the_reading_order(corpus, tmp_path):
    forward = fim_dataset(corpus, tmp_path)
    backward = fim_dataset(corpus, tmp_path)
    ahead = [forward[i]["tokens"].tolist() for i in range(len(forward))]
    behind = [backward[i]["tokens"].tolist() for i in reversed(range(len(backward)))]
    assert ahead == behind[::-1]
    assert all(len(t) == 64 for t in ahead)
    with_fim = sum(TOKENS["prefix"] in t for t in ahead)
    assert with_fim == len(ahead)  # every sample has a piece, every piece is transformed


def test_a_sample_does_not_depend_on_the_folder(corpus, tmp_path):
    """The same files under another folder (moved, or mounted elsewhere on a resume) give
    the same samples; under another file name, other draws."""
    samples, moved, renamed = {}, "moved/code_text_document", "renamed/other_text_document"
    for where in (moved, renamed):
        prefix = tmp_path / where
        prefix.parent.mkdir()
        for suffix in (".bin", ".idx"):
            shutil.copy(corpus + suffix, str(prefix) + suffix)
        data = fim_dataset(str(prefix), tmp_path / where.split("/")[0])
        samples[where] = [data[i]["tokens"].tolist() for i in range(len(data))]
    here = fim_dataset(corpus, tmp_path)
    assert [here[i]["tokens"].tolist() for i in range(len(here))] == samples[moved]
    assert samples[renamed] != samples[moved]


def test_at_rate_zero_the_samples_are_gpt_datasets(corpus, tmp_path):
    plain = fim_dataset(corpus, tmp_path, cls=GPTDataset)
    untouched = fim_dataset(corpus, tmp_path, fim_rate=0.0)
    for i in range(len(plain)):
        for key in ("tokens", "labels", "loss_mask"):
            assert untouched[i][key].tolist() == plain[i][key].tolist()


def test_fim_tokens_missing_from_the_vocabulary_are_named(corpus, tmp_path):
    tokens = {**ROLES, "middle": "<fill_here>"}
    with pytest.raises(ValueError, match="--fim-middle-token '<fill_here>' is not a token"):
        fim_dataset(corpus, tmp_path, tokens=tokens)
    with pytest.raises(ValueError, match="--fim-split-sample '<sep>' is not a token"):
        fim_dataset(corpus, tmp_path, fim_split_sample="<sep>", fim_fragment_rate=0.5)
    with pytest.raises(ValueError, match=r"FIM needs a tokenizer with a text form .*NullTokenizer"):
        fim_dataset(corpus, tmp_path, tokenizer=NullTokenizer(200))


@pytest.mark.parametrize(("fields", "message"), [
    ({"fim_rate": 0.3}, "fim_rate=0.3 applies with fim_data=True"),
    ({"fim_eod_token": "</s>"}, "fim_eod_token='</s>' applies with fim_data=True"),
    ({"fim_data": True, "mock_data": True}, "mock_data=True has none"),
    ({"fim_data": True, "sft": True}, "fim_data=True and sft=True are two kinds"),
])  # fmt: skip
def test_the_flags_refuse_what_would_do_nothing(fields, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(**fields)


@pytest.mark.parametrize(("fields", "message"), [
    ({"fim_rate": 1.5}, r"fim_rate=1.5 must be in \[0, 1\]"),
    ({"fim_split_sample": "<file_sep>"}, "give both"),
    ({"fim_fragment_rate": 0.5}, "give both"),
    ({"tokens": {**ROLES, "pad": ""}}, "fim_extra_tokens has no pad token"),
])  # fmt: skip
def test_the_dataset_config_checks_its_fields(corpus, tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        fim_dataset(corpus, tmp_path, **fields)
