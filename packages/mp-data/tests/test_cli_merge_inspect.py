"""mp-data merge (prefixes or a folder) and mp-data inspect."""

from __future__ import annotations

import json
from pathlib import Path

from mp_data import IndexedDataset
from mp_data.cli import main

GPT2 = Path(__file__).parent / "assets" / "tokenizers" / "gpt2"
GPT2_ARGS = [
    "--tokenizer-type", "GPT2BPETokenizer",
    "--vocab-file", str(GPT2 / "vocab.json"),
    "--merge-file", str(GPT2 / "merges.txt"),
]  # fmt: skip

DOCUMENTS = [f"Document {i}. It has {'two ' * (i % 4)}sentences." for i in range(30)] + [""]


def preprocess(tmp_path: Path, documents: list[str], prefix: Path, *extra: str) -> str:
    source = tmp_path / f"{prefix.name}.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    args = ["preprocess", "--input", str(source), "--output-prefix", str(prefix)]
    assert main([*args, *GPT2_ARGS, "--append-eod", *extra]) == 0
    level = "sentence" if "--split-sentences" in extra else "document"
    return f"{prefix}_text_{level}"


def same_files(a: str, b: str) -> bool:
    return all(Path(a + s).read_bytes() == Path(b + s).read_bytes() for s in (".bin", ".idx"))


def test_merging_two_halves_equals_preprocessing_the_whole(tmp_path, capsys):
    for extra in ((), ("--split-sentences",)):
        whole = preprocess(tmp_path, DOCUMENTS, tmp_path / "whole", *extra)
        parts = tmp_path / f"parts{len(extra)}"
        parts.mkdir()
        first = preprocess(tmp_path, DOCUMENTS[:12], parts / "a", *extra)
        second = preprocess(tmp_path, DOCUMENTS[12:], parts / "b", *extra)
        merged = str(tmp_path / f"merged{len(extra)}")
        assert main(["merge", "--input", first, second, "--output-prefix", merged]) == 0
        assert same_files(merged, whole)
        # A folder stands for its datasets in sorted order (a, then b), as in Megatron.
        (parts / ".a.bin.x1.tmp").write_bytes(b"a temporary is ignored")
        from_folder = str(parts / "all")
        assert main(["merge", "--input", str(parts), "--output-prefix", from_folder]) == 0
        assert same_files(from_folder, whole)
        # Run again: the earlier output in the folder is not merged into itself.
        assert main(["merge", "--input", str(parts), "--output-prefix", from_folder]) == 0
        assert same_files(from_folder, whole)
    out = capsys.readouterr().out
    assert "merged 2 datasets: 30 sequences, 31 documents" in out


def test_merge_errors(tmp_path, capsys):
    assert main(["merge", "--input", str(tmp_path / "none"), "--output-prefix", "x"]) == 1
    assert "none: not a dataset (" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["merge", "--input", str(tmp_path / "empty"), "--output-prefix", "x"]) == 1
    assert "no datasets (pairs of P.bin and P.idx) in this folder" in capsys.readouterr().err
    a = preprocess(tmp_path, DOCUMENTS[:3], tmp_path / "a")
    null = tmp_path / "null.jsonl"
    null.write_text('{"text": "1 2"}\n')
    args = ["--input", str(null), "--output-prefix", str(tmp_path / "n")]
    assert (
        main(["preprocess", *args, "--tokenizer-type", "NullTokenizer", "--vocab-size", "70000"])
        == 0
    )
    out = str(tmp_path / "mixed")
    assert (
        main(["merge", "--input", a, str(tmp_path / "n_text_document"), "--output-prefix", out])
        == 1
    )
    assert "merged datasets must share a dtype" in capsys.readouterr().err
    assert not list(tmp_path.glob("mixed*")) and not list(tmp_path.glob(".mixed*"))


def test_inspect_prints_counts_and_the_first_document(tmp_path, capsys):
    prefix = preprocess(tmp_path, DOCUMENTS, tmp_path / "d", "--split-sentences")
    capsys.readouterr()
    assert main(["inspect", prefix + ".idx", *GPT2_ARGS, "--chars", "12"]) == 0
    out = capsys.readouterr().out
    dataset = IndexedDataset(prefix)
    assert len(dataset) == 60  # "Document i." and "It has ... sentences."
    assert f"sequences:  {len(dataset):,}" in out
    assert "documents:  31" in out and "dtype:      uint16" in out
    assert f"tokens:     {int(dataset.sequence_lengths.sum()):,}" in out
    assert f".bin file:  {Path(prefix + '.bin').stat().st_size:,} bytes" in out
    assert "sequence length:  min " in out and "median" in out
    assert "document length:  min " in out and "empty documents:  1" in out
    assert "first document (" in out and "'Document 0.I'..." in out  # Punkt dropped the space


def test_inspect_without_tokenizer_and_on_a_missing_dataset(tmp_path, capsys):
    prefix = preprocess(tmp_path, DOCUMENTS, tmp_path / "d")
    capsys.readouterr()
    assert main(["inspect", prefix]) == 0
    out = capsys.readouterr().out
    assert "sequences:  30" in out and "first document" not in out and "document length" not in out
    assert main(["inspect", str(tmp_path / "missing")]) == 1
    assert "missing: not a dataset" in capsys.readouterr().err
