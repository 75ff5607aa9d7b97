"""SFT data: 200 chat conversations written by the test, rendered with the chat template of
a tokenizer the test writes, packed into loss-masked samples.

The corpus (mp_data.sft_example) says whose each word is (c<i> tags conversation i,
assistants speak a<k>, users u<k>), so the expected loss mask and packing are read off
the tokens, not computed by the code under test; conversation lengths come from
transformers' own apply_chat_template.
"""

from __future__ import annotations

import itertools
import json
import logging
import os

import numpy as np
import pytest

from mp_data import (
    BlendedDataset,
    BlendedMegatronDatasetBuilder,
    GPTDatasetConfig,
    SFTDataError,
    SFTDataset,
    SFTLowLevelDataset,
    SFTTokenizer,
    pack_conversations,
    write_chat_corpus,
    write_chat_tokenizer,
)
from mp_data.config import SFTPromptFormat
from mp_data.sft_tokenizer import SFT_PROMPT_FORMATS

transformers = pytest.importorskip("transformers")

SEQ = 64  # a sample: SEQ inputs, SEQ labels, SEQ + 1 tokens
LONG_EVERY = 40  # conversations 0, 40, 80, ... open with a 60-word message: truncated


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat")
    write_chat_tokenizer(str(folder / "tokenizer"))
    records = write_chat_corpus(str(folder / "chat.jsonl"), 200, seed=3, long_every=LONG_EVERY,
                                long_words=60)  # fmt: skip
    tokenizer = SFTTokenizer(folder / "tokenizer", "default")
    return folder, records, tokenizer


def config(folder, tokenizer, seed=5, **kw) -> GPTDatasetConfig:
    kw.setdefault("blend", ([str(folder / "chat.jsonl")], None))
    return GPTDatasetConfig(random_seed=seed, sequence_length=SEQ, tokenizer=tokenizer,
                            split="80,10,10", path_to_cache=str(folder / "cache"),
                            **kw)  # fmt: skip


def test_samples_mask_the_assistant_and_pack_whole_conversations(chat, caplog):
    folder, records, tokenizer = chat
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(folder / "tokenizer")
    # The conversations' token ids as transformers renders and tokenizes them.
    expected = [hf.apply_chat_template(r["messages"], tokenize=True, return_dict=False)
                for r in records]  # fmt: skip
    vocab = tokenizer.vocab
    word = {i: w for w, i in vocab.items()}
    assistant_words = {vocab[f"a{k}"] for k in range(50)}
    end_of_turn = vocab["<|im_end|>"]
    with caplog.at_level(logging.INFO, logger="mp_data"):
        train, valid, test = BlendedMegatronDatasetBuilder(
            SFTDataset, [None, None, None], lambda: True, config(folder, tokenizer)
        ).build()
    assert [len(d.indices) for d in (train, valid, test)] == [160, 20, 20]  # lines split 80/10/10
    ids, _ = tokenizer.tokenize_conversation(records[7]["messages"])
    assert ids.tolist() == expected[7]  # mp's tokenization is transformers'

    seen = {}  # conversation -> (sample, tokens held)
    fills = {}  # sample -> (first conversation, tokens used)
    for j in range(len(train)):
        item = train[j]
        tokens, labels = item["tokens"].numpy(), item["labels"].numpy()
        docs, pos = item["document_ids"].numpy(), item["position_ids"].numpy()
        loss = item["loss_mask"].numpy()
        # Loss exactly where the next token is the assistant's: its words, and the end of
        # turn that closes them, within the same conversation.
        want = np.isin(labels, list(assistant_words)) | (
            (labels == end_of_turn) & np.isin(tokens, list(assistant_words))
        )
        want &= np.append(docs[1:] == docs[:-1], True)
        np.testing.assert_array_equal(loss, want.astype(np.float32), err_msg=f"sample {j}")
        assert docs[0] == 0 and np.all(np.diff(docs) >= 0) and np.all(np.diff(docs) <= 1)
        starts = np.flatnonzero(np.diff(docs, prepend=-1))
        assert np.all(pos[starts] == 0)
        full = np.append(tokens, labels[-1])
        used = 0
        for d, start in enumerate(starts):
            run = full[start : (starts[d + 1] if d + 1 < len(starts) else SEQ + 1)]
            if start + len(run) == SEQ + 1 and run[-1] == vocab["<pad>"]:
                run = run[:-1]  # the last token, a label only, is the padding's
            if run[0] == vocab["<pad>"]:  # the padding: a document of its own, last
                assert d == len(starts) - 1 and np.all(run == vocab["<pad>"])
                assert loss[start:].sum() == 0
                continue
            conversation = int(word[int(run[2])][1:])  # <|im_start|> system c<i>
            assert conversation not in seen, f"conversation {conversation} split"
            seen[conversation] = (j, len(run))
            want = expected[conversation][: SEQ + 1]  # whole, or truncated when longer
            assert run.tolist() == want, f"conversation {conversation} in sample {j}"
            used += len(run)
        fills[j] = (int(word[int(full[2])][1:]), used)
        assert "attention_mask" not in item  # attention reads document_ids

    assert sorted(seen) == list(range(160))  # every train conversation once
    # Greedy in file order: a sample ends only where the next conversation does not fit.
    order = sorted(fills.values())
    for (_, used), (first_next, _) in itertools.pairwise(order):
        assert used + min(len(expected[first_next]), SEQ + 1) > SEQ + 1
    truncated = [c for c in range(160) if len(expected[c]) > SEQ + 1]
    assert set(range(0, 160, LONG_EVERY)) <= set(truncated)
    assert all(seen[c][1] == SEQ + 1 for c in truncated)
    logged = [r.getMessage() for r in caplog.records if "SFTDataset train" in r.getMessage()]
    dropped = sum(len(expected[c]) - SEQ - 1 for c in truncated)
    assert len(logged) == 1
    assert f"{len(truncated)} conversations longer than {SEQ + 1} tokens truncated" in logged[0]
    assert f"({dropped} tokens dropped)" in logged[0]


def test_cache_reuse_shuffle_and_blend(chat, monkeypatch, tmp_path):
    folder, _, tokenizer = chat
    first = BlendedMegatronDatasetBuilder(SFTDataset, [None] * 3, lambda: True,
                                          config(folder, tokenizer)).build()[0]  # fmt: skip
    files = sorted(os.listdir(folder / "cache"))
    assert any(f.endswith("SFTLowLevelDataset-tokens.npy") for f in files)
    assert not [f for f in files if f.endswith(".tmp")]

    def no_tokenizing(*args):
        raise AssertionError("the cache was not used")

    # Built again from the cache: same samples, in the same shuffled order.
    monkeypatch.setattr(SFTTokenizer, "tokenize_conversation", no_tokenizing)
    again = BlendedMegatronDatasetBuilder(SFTDataset, [None] * 3, lambda: True,
                                          config(folder, tokenizer)).build()[0]  # fmt: skip
    np.testing.assert_array_equal(again.shuffle_index, first.shuffle_index)
    for j in (0, len(first) - 1):
        assert all((again[j][k] == first[j][k]).all() for k in first[j])
    other = BlendedMegatronDatasetBuilder(SFTDataset, [None] * 3, lambda: True,
                                          config(folder, tokenizer, seed=6)).build()[0]  # fmt: skip
    np.testing.assert_array_equal(np.sort(other.shuffle_index), np.sort(first.shuffle_index))
    assert not np.array_equal(other.shuffle_index, first.shuffle_index)
    assert sorted(os.listdir(folder / "cache")) != files  # the new seed's entry beside

    # More samples than a pass holds: further passes, each shuffled anew.
    monkeypatch.undo()
    packs = len(first)
    write_chat_corpus(str(tmp_path / "b.jsonl"), 60, seed=4)
    blend = ([str(folder / "chat.jsonl"), str(tmp_path / "b.jsonl")], [0.5, 0.5])
    train, valid, test = BlendedMegatronDatasetBuilder(
        SFTDataset, [2 * packs, 10, 10], lambda: True, config(folder, tokenizer, blend=blend)
    ).build()
    assert isinstance(train, BlendedDataset) and len(train) == 2 * packs
    assert (len(valid), len(test)) == (10, 10)  # Megatron's blend: the counts asked
    assert len(train.datasets[0]) == 2 * packs  # ceil(packs * 1.005) asked: two passes
    ids = np.asarray(train.datasets[0].shuffle_index)
    assert sorted(ids[:packs]) == sorted(ids[packs:]) and not np.array_equal(ids[:packs],
                                                                           ids[packs:])  # fmt: skip
    assert {train[i]["dataset_id"] for i in range(10)} == {0, 1}


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ('{"messages": [{"role": "user", "content": "u1"}', "not valid JSON"),
        ('{"text": "u1"}', "no 'messages' key"),
        ('{"messages": []}', "'messages' is empty"),
        ('{"messages": [{"role": "bot", "content": "a1"}]}', "message 0 has role 'bot'"),
        ('{"messages": [{"role": "user", "content": ["u1"]}]}',
         "message 0 (user) has an array as content"),
        ('{"messages": [{"role": "user", "content": "u1"}, {"role": "assistant", "content": ""}]}',
         "message 1 (assistant) is empty"),
    ],
)  # fmt: skip
def test_a_malformed_line_is_named_and_nothing_is_written(chat, tmp_path, line, error):
    _, records, tokenizer = chat
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps(r) for r in records[:10]]
    lines.insert(6, line)
    lines.insert(3, "   ")  # blank lines are skipped, but counted
    path.write_text("\n".join(lines) + "\n")
    c = config(tmp_path, tokenizer)
    with pytest.raises(SFTDataError) as raised:
        SFTLowLevelDataset(str(path), c)
    assert str(raised.value).startswith(f"{path}:8: {error}"), raised.value
    assert not (tmp_path / "cache").exists() or not os.listdir(tmp_path / "cache")


def test_packing_plan_and_prompt_formats(chat):
    folder = chat[0]
    lengths = np.array([3, 4, 2, 9, 1, 0, 5, 5])
    # capacity 6: [3] [4 2] [9, truncated alone] [1 0 5] [5]
    assert pack_conversations(lengths, 6).tolist() == [0, 1, 3, 4, 7, 8]
    assert pack_conversations(np.array([0, 0]), 6).tolist() == [0]
    assert set(SFT_PROMPT_FORMATS) == set(SFTPromptFormat.__args__)
    # Megatron's nemotron-nano-v2: the assistant's text and its closing tokens have loss,
    # its header (the generation prompt) none.
    nano = SFTTokenizer(folder / "tokenizer", "nemotron-nano-v2")
    messages = [{"role": "user", "content": "u1 u2"}, {"role": "assistant", "content": "a2 a1"}]
    text = nano.render(messages)
    assert text == "<SPECIAL_11>User\nu1 u2\n<SPECIAL_11>Assistant\na2 a1\n<SPECIAL_12>\n"
    ids, assistant = nano.tokenize_conversation(messages)
    answer = nano.backend.encode("a2 a1\n<SPECIAL_12>\n", add_special_tokens=False).ids
    assert assistant.tolist() == [False] * (len(ids) - len(answer)) + [True] * len(answer)
    assert ids[-len(answer) :].tolist() == answer
    assert nano.identity != SFTTokenizer(folder / "tokenizer", "default").identity
    # A template that rewrites earlier turns (here: shows only the last answer) is refused.
    nano.chat_template = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
                          "{{ m['content'] }} {% endif %}{% endfor %}")  # fmt: skip
    with pytest.raises(ValueError, match=r"message 1 \(assistant\): the 'nemotron-nano-v2' chat"):
        nano.tokenize_conversation(messages + messages)


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallelism_pads_each_conversation_to_twice_cp(chat, cp):
    """Megatron's SFTDataset under context parallelism: every conversation padded to a
    multiple of 2 x cp tokens within its own document (no loss on the padding), so every
    document of every sample splits into 2 x cp chunks (mp_layers.PackedSeqParams splits
    by document); nothing else changes."""
    folder, records, tokenizer = chat
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(folder / "tokenizer")
    expected = [hf.apply_chat_template(r["messages"], tokenize=True, return_dict=False)
                for r in records]  # fmt: skip
    word = {i: w for w, i in tokenizer.vocab.items()}
    pad = tokenizer.vocab["<pad>"]
    settings = config(folder, tokenizer, context_parallel_size=cp)
    train = BlendedMegatronDatasetBuilder(SFTDataset, [None] * 3, lambda: True, settings).build()[0]
    plain = BlendedMegatronDatasetBuilder(SFTDataset, [None] * 3, lambda: True,
                                          config(folder, tokenizer)).build()[0]  # fmt: skip
    # The assistant's loss, conversation by conversation, without the padding.
    plain_loss = {}
    for j in range(len(plain)):
        item = plain[j]
        docs = item["document_ids"].numpy()
        for d in np.unique(docs):
            tokens = item["tokens"].numpy()[docs == d]
            if tokens[0] != pad:
                plain_loss[int(word[int(tokens[2])][1:])] = item["loss_mask"].numpy()[docs == d]
    seen = set()
    for j in range(len(train)):
        item = train[j]
        tokens, docs = item["tokens"].numpy(), item["document_ids"].numpy()
        loss, pos = item["loss_mask"].numpy(), item["position_ids"].numpy()
        for d in np.unique(docs):
            run = docs == d
            assert run.sum() % (2 * cp) == 0, f"sample {j} document {d}: {run.sum()} tokens"
            assert np.array_equal(pos[run], np.arange(run.sum()))
            if tokens[run][0] == pad:  # the sample's trailing padding
                assert loss[run].sum() == 0
                continue
            conversation = int(word[int(tokens[run][2])][1:])
            assert conversation not in seen
            seen.add(conversation)
            n = min(len(expected[conversation]), int(run.sum()))
            assert tokens[run][:n].tolist() == expected[conversation][:n]
            assert np.all(tokens[run][n:] == pad) and loss[run][n:].sum() == 0
            want = plain_loss[conversation]
            np.testing.assert_array_equal(loss[run][: len(want) - 1], want[:-1])
    assert seen == set(plain_loss)
    assert len(train) >= len(plain)
