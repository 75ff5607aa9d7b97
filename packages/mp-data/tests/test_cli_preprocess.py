"""mp-data preprocess: round trips, worker counts, compressed input, progress output."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import numpy as np
import pytest

from mp_data import IndexedDataset
from mp_data.cli import input_file, main
from mp_data.tokenizers import build_tokenizer

GPT2 = Path(__file__).parent / "assets" / "tokenizers" / "gpt2"
GPT2_ARGS = [
    "--tokenizer-type", "GPT2BPETokenizer",
    "--vocab-file", str(GPT2 / "vocab.json"),
    "--merge-file", str(GPT2 / "merges.txt"),
]  # fmt: skip

DOCUMENTS = [
    "Hello world. This is the first document.",
    "Second one,\nwith a newline and ünïcödé — and emoji 🎉.",
    "",  # an empty document is still a document
    "  leading and trailing spaces  ",
    "Tabs\tand\r\nCRLF inside the text.",
    "<|endoftext|> is ordinary text for GPT2BPETokenizer.",
] + [f"Document number {i}: the quick brown fox jumps over the lazy dog." for i in range(40)]


def gpt2():
    return build_tokenizer(
        "GPT2BPETokenizer",
        vocab_file=GPT2 / "vocab.json",
        merge_file=GPT2 / "merges.txt",
    )


def write_jsonl(path: Path, records, compress: bool = False) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in records)
    if compress:
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text, encoding="utf-8")
    return path


def preprocess(tmp_path: Path, input_path: Path, name: str, *extra: str) -> Path:
    prefix = tmp_path / name
    args = ["preprocess", "--input", str(input_path), "--output-prefix", str(prefix)]
    assert main([*args, *GPT2_ARGS, *extra]) == 0
    return prefix


def documents_of(prefix: str) -> list[np.ndarray]:
    dataset = IndexedDataset(str(prefix))
    bounds = dataset.document_indices
    return [
        np.concatenate([dataset[i] for i in range(bounds[d], bounds[d + 1])] or [np.zeros(0)])
        for d in range(dataset.document_count)
    ]


def test_round_trip_gives_the_documents_back(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": d} for d in DOCUMENTS])
    prefix = preprocess(tmp_path, source, "out")
    dataset = IndexedDataset(f"{prefix}_text_document")
    assert dataset.dtype == np.uint16  # GPT-2's 50,257 ids fit
    assert dataset.document_count == len(DOCUMENTS)
    assert len(dataset) == len(DOCUMENTS) - 1  # the empty document has no sequence
    tokenizer = gpt2()
    decoded = [tokenizer.detokenize(d.tolist()) for d in documents_of(f"{prefix}_text_document")]
    assert decoded == DOCUMENTS
    assert documents_of(f"{prefix}_text_document")[0].tolist() == tokenizer.tokenize(DOCUMENTS[0])


def test_append_eod_ends_each_nonempty_document(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": d} for d in DOCUMENTS])
    prefix = preprocess(tmp_path, source, "out", "--append-eod")
    tokenizer = gpt2()
    for text, ids in zip(DOCUMENTS, documents_of(f"{prefix}_text_document"), strict=True):
        if not text:
            assert ids.size == 0  # Megatron appends eod only to a document with tokens
            continue
        assert ids[-1] == tokenizer.eod == 50256
        assert tokenizer.detokenize(ids[:-1].tolist()) == text


def test_one_dataset_per_json_key(tmp_path, capsys):
    records = [{"title": f"Title {i}", "text": f"Body {i}.", "other": 1} for i in range(5)]
    source = write_jsonl(tmp_path / "in.jsonl", records)
    prefix = preprocess(tmp_path, source, "out", "--json-keys", "text", "title")
    tokenizer = gpt2()
    for key in ("text", "title"):
        decoded = [
            tokenizer.detokenize(d.tolist()) for d in documents_of(f"{prefix}_{key}_document")
        ]
        assert decoded == [r[key] for r in records]
    out = capsys.readouterr().out
    assert "5 documents" in out and f"{prefix}_title_document.idx" in out


def test_workers_and_compression_do_not_change_the_bytes(tmp_path, monkeypatch):
    # Tiny blocks, so that two workers each get many and must be put back in order.
    monkeypatch.setattr(input_file, "BLOCK_BYTES", 300)
    records = [{"text": d} for d in DOCUMENTS * 3]
    plain = write_jsonl(tmp_path / "in.jsonl", records)
    packed = write_jsonl(tmp_path / "in.jsonl.gz", records, compress=True)
    outputs = [
        preprocess(tmp_path, plain, "one", "--workers", "1", "--append-eod"),
        preprocess(tmp_path, plain, "two", "--workers", "2", "--append-eod"),
        preprocess(tmp_path, packed, "gz", "--workers", "2", "--append-eod"),
    ]
    for suffix in (".bin", ".idx"):
        contents = {Path(f"{p}_text_document{suffix}").read_bytes() for p in outputs}
        assert len(contents) == 1


def test_blocks_cut_only_at_newlines_and_number_the_lines(tmp_path, monkeypatch):
    lines = [b'{"text": "a"}', b"", b'{"text": "' + b"x" * 50 + b'"}', b'{"text": "b"}']
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"\n".join(lines))  # a BOM, and no final newline
    blocks = list(input_file.InputFile(str(path)).blocks(block_bytes=8))
    assert b"".join(data for _, data in blocks) == b"\n".join(lines)
    for first, data in blocks:
        assert data.endswith(b"\n") or data == lines[-1]
        assert lines[first - 1] == data.split(b"\n")[0]


def test_megatron_sentence_lists_and_blank_lines(tmp_path):
    # A value may be a list of sentences (a file split beforehand): one sequence each.
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": ["One.", " Two.", ""]}\n\n   \n{"text": "Three."}\n')
    prefix = preprocess(tmp_path, path, "out")
    dataset = IndexedDataset(f"{prefix}_text_document")
    assert dataset.document_count == 2
    tokenizer = gpt2()
    assert [tokenizer.detokenize(s.tolist()) for s in dataset] == ["One.", " Two.", "Three."]
    assert dataset.document_indices.tolist() == [0, 2, 3]


def test_null_tokenizer_writes_the_ids_it_is_given(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2 3"}, {"text": "70000 4"}])
    prefix = tmp_path / "out"
    args = ["preprocess", "--input", str(source), "--output-prefix", str(prefix)]
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "70002"]
    assert main([*args, *null, "--append-eod"]) == 0
    dataset = IndexedDataset(f"{prefix}_text_document")
    assert dataset.dtype == np.int32  # 70,002 ids do not fit uint16
    assert [s.tolist() for s in dataset] == [[1, 2, 3, 70001], [70000, 4, 70001]]
    # Megatron's --null-tokenizer-eod-id names another end-of-document id.
    assert main([*args, *null, "--append-eod", "--null-tokenizer-eod-id", "0"]) == 0
    dataset = IndexedDataset(f"{prefix}_text_document")
    assert [s.tolist() for s in dataset] == [[1, 2, 3, 0], [70000, 4, 0]]
    gpt2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v", "--merge-file", "m"]
    assert main([*args, *gpt2, "--null-tokenizer-eod-id", "0"]) == 1


def test_progress_is_a_bar_on_a_terminal_and_log_lines_otherwise(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(input_file, "BLOCK_BYTES", 200)
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": d} for d in DOCUMENTS])
    preprocess(tmp_path, source, "log", "--log-interval", "10")
    captured = capsys.readouterr()
    logged = captured.err.splitlines()
    assert len(logged) >= 3 and all("documents" in line for line in logged)
    assert "\r" not in captured.err
    summary = captured.out.splitlines()[0]
    for word in ("46 documents", "tokens", "0 bad lines skipped", " s,", "tokens/s", "MB/s"):
        assert word in summary

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    preprocess(tmp_path, source, "tty")
    drawn = terminal.getvalue()
    # tqdm's bar, redrawn in place (mp_data.progress), with the counts after it.
    assert drawn.startswith("\r") and drawn.endswith("\n") and "preprocess: 46doc" in drawn
    assert "626 tokens" in drawn.rsplit("\r", 1)[1]


@pytest.mark.parametrize(
    "command", [[], ["preprocess"], ["merge"], ["inspect"], ["train-tokenizer"]]
)
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exit:
        main([*command, "--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: mp-data")
    if command == ["preprocess"]:
        options = ["--input", "--json-keys", "--split-sentences", "--keep-newlines"]
        options += ["--workers", "--log-interval", "--skip-bad-lines", "--merge-file"]
        for option in options:
            assert option in out


def test_partitions_give_megatrons_order(tmp_path):
    """--partitions 3: partition p holds lines p, p + 3, ...; the output is partition 0's
    documents, then 1's, then 2's. --keep-sequential-samples keeps the input's order."""
    records = [{"text": t} for t in DOCUMENTS]
    source = write_jsonl(tmp_path / "in.jsonl", records)
    whole = documents_of(f"{preprocess(tmp_path, source, 'whole')}_text_document")
    parts = preprocess(tmp_path, source, "parts", "--partitions", "3", "--workers", "2")
    parts = documents_of(f"{parts}_text_document")
    order = [i for p in range(3) for i in range(len(DOCUMENTS)) if i % 3 == p]
    assert len(parts) == len(whole) == len(DOCUMENTS)
    for got, i in zip(parts, order, strict=True):
        np.testing.assert_array_equal(got, whole[i])
    sequential = preprocess(tmp_path, source, "seq", "--partitions", "3",
                            "--keep-sequential-samples")  # fmt: skip
    for suffix in (".bin", ".idx"):
        assert (Path(f"{sequential}_text_document{suffix}").read_bytes()
                == Path(f"{tmp_path / 'whole'}_text_document{suffix}").read_bytes())  # fmt: skip


def test_partitions_must_be_positive(tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    args = ["preprocess", "--input", str(source), "--output-prefix", str(tmp_path / "o")]
    assert main([*args, *GPT2_ARGS, "--partitions", "0"]) == 1
    assert "--partitions must be at least 1, got 0" in capsys.readouterr().err
