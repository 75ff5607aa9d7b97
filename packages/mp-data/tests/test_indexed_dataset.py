"""Megatron's .bin/.idx: the layout byte by byte, round trips, merge, bad input, atomicity."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from mp_data import DType, IndexedDataset, IndexedDatasetBuilder, merge_datasets


def u64(n: int) -> bytes:
    return n.to_bytes(8, "little")


def i64s(values) -> bytes:
    return b"".join(v.to_bytes(8, "little", signed=True) for v in values)


def i32s(values) -> bytes:
    return b"".join(v.to_bytes(4, "little", signed=True) for v in values)


# The format note's example, spelled out: two documents of 3 and 5 uint16 tokens.
EXAMPLE_IDX = (
    b"MMIDIDX\x00\x00" + u64(1) + bytes([8]) + u64(2) + u64(3)
    + i32s([3, 5]) + i64s([0, 6]) + i64s([0, 1, 2])
)  # fmt: skip
EXAMPLE_TOKENS = [[10, 11, 12], [20, 21, 22, 23, 65535]]


def write_prefix(tmp_path, idx: bytes, bin_: bytes, name="d") -> str:
    prefix = str(tmp_path / name)
    (tmp_path / f"{name}.idx").write_bytes(idx)
    (tmp_path / f"{name}.bin").write_bytes(bin_)
    return prefix


def example_bin() -> bytes:
    return b"".join(t.to_bytes(2, "little") for doc in EXAMPLE_TOKENS for t in doc)


def test_builder_writes_the_format_notes_example_byte_for_byte(tmp_path):
    assert len(EXAMPLE_IDX) == 82
    prefix = str(tmp_path / "ex")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for doc in EXAMPLE_TOKENS:
        builder.add_item(doc)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    assert (tmp_path / "ex.idx").read_bytes() == EXAMPLE_IDX
    assert (tmp_path / "ex.bin").read_bytes() == example_bin()


def test_reader_on_a_hand_built_file(tmp_path):
    ds = IndexedDataset(write_prefix(tmp_path, EXAMPLE_IDX, example_bin()))
    assert len(ds) == 2 and ds.document_count == 2 and ds.dtype == np.uint16
    assert ds.sequence_lengths.tolist() == [3, 5]
    assert ds.sequence_pointers.tolist() == [0, 6]
    assert ds.document_indices.tolist() == [0, 1, 2]
    assert ds[1].tolist() == EXAMPLE_TOKENS[1]
    assert ds[-2].tolist() == EXAMPLE_TOKENS[0]
    assert ds.get(1, offset=1, length=3).tolist() == [21, 22, 23]
    assert ds.get(1, offset=3).tolist() == [23, 65535]
    assert [a.tolist() for a in ds[0:2]] == EXAMPLE_TOKENS
    assert [a.tolist() for a in ds] == EXAMPLE_TOKENS
    assert IndexedDataset.exists(ds.path_prefix)


def test_sequence_modes_of_multimodal_indices_are_accepted(tmp_path):
    prefix = write_prefix(tmp_path, EXAMPLE_IDX + bytes([0, 1]), example_bin())
    assert IndexedDataset(prefix).sequence_modes is None
    assert IndexedDataset(prefix, multimodal=True).sequence_modes.tolist() == [0, 1]


def random_documents(rng, n_docs, vocab):
    docs = []
    for _ in range(n_docs):
        sentences = [rng.integers(0, vocab, rng.integers(0, 40)) for _ in range(rng.integers(0, 4))]
        docs.append(sentences)
    return docs


def build(prefix, docs, dtype):
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for sentences in docs:
        if len(sentences) == 1 and len(sentences[0]) % 2:
            builder.add_item(sentences[0])
            builder.end_document()
        else:
            builder.add_document(
                np.concatenate(sentences) if sentences else np.zeros(0, np.int64),
                [len(s) for s in sentences],
            )
    builder.finalize(prefix + ".idx")


@pytest.mark.parametrize("vocab", [300, 65499, 65500, 200_000])
def test_round_trip(tmp_path, vocab):
    rng = np.random.default_rng(vocab)
    docs = random_documents(rng, 300, vocab)
    dtype = DType.optimal_dtype(vocab)
    assert dtype == (np.uint16 if vocab < 65500 else np.int32)
    prefix = str(tmp_path / "rt")
    build(prefix, docs, dtype)
    ds = IndexedDataset(prefix)
    flat = [s for doc in docs for s in doc]
    assert len(ds) == len(flat) and ds.document_count == len(docs)
    for got, want in zip(ds, flat, strict=True):
        assert got.dtype == dtype and got.tolist() == want.tolist()
    bounds = np.cumsum([0] + [len(doc) for doc in docs])
    assert ds.document_indices.tolist() == bounds.tolist()


def test_empty_documents_repeat_the_boundary_and_an_empty_dataset_reads(tmp_path):
    prefix = str(tmp_path / "e")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    builder.end_document()
    builder.add_item([1, 2])
    builder.end_document()
    builder.end_document()
    builder.finalize(prefix + ".idx")
    assert IndexedDataset(prefix).document_indices.tolist() == [0, 0, 1, 1]
    empty = str(tmp_path / "none")
    IndexedDatasetBuilder(empty + ".bin").finalize(empty + ".idx")
    ds = IndexedDataset(empty)
    assert len(ds) == 0 and ds.document_count == 0 and list(ds) == []


def test_merge_of_two_halves_equals_the_whole_byte_for_byte(tmp_path):
    docs = random_documents(np.random.default_rng(7), 200, 1000)
    whole, first, second = (str(tmp_path / n) for n in ("whole", "a", "b"))
    build(whole, docs, np.uint16)
    build(first, docs[:83], np.uint16)
    build(second, docs[83:], np.uint16)
    merged = merge_datasets([first, second], str(tmp_path / "merged"))
    for ext in (".bin", ".idx"):
        assert read_bytes(merged.path_prefix + ext) == read_bytes(whole + ext)


def test_merged_document_indices_follow_the_format_note(tmp_path):
    # Two copies of a dataset with document boundaries [0, 2, 8].
    prefix = str(tmp_path / "p")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    builder.add_document(np.arange(2), [1, 1])
    builder.add_document(np.arange(6), [1] * 6)
    builder.finalize(prefix + ".idx")
    merged = merge_datasets([prefix, prefix], str(tmp_path / "m"))
    assert merged.document_indices.tolist() == [0, 2, 8, 10, 16]
    assert merged.sequence_pointers.tolist()[8] == 16  # shifted by A's .bin size


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def replace_at(data: bytes, offset: int, new: bytes) -> bytes:
    return data[:offset] + new + data[offset + len(new) :]


@pytest.mark.parametrize(
    ("idx", "bin_", "message"),
    [
        (replace_at(EXAMPLE_IDX, 0, b"MMIDIDY"), None, r"bad magic b'MMIDIDY"),
        (replace_at(EXAMPLE_IDX, 9, u64(2)), None, r"index version 2 is not supported"),
        (replace_at(EXAMPLE_IDX, 17, bytes([9])), None, r"unknown dtype code 9"),
        (EXAMPLE_IDX[:60], None, r"60 bytes, but a header for 2 sequences .* needs 82"),
        (EXAMPLE_IDX[:20], None, r"20 bytes is too short for an MMIDIDX header"),
        (None, example_bin()[:-2], r"\.bin: 14 bytes, .* describes 16 bytes .* truncated"),
        (None, example_bin() + b"\0\0", r"18 bytes, .* longer than its index"),
        (replace_at(EXAMPLE_IDX, 42, i64s([1])), None, r"pointers \(1 \.\.\. 6\) disagree"),
        (replace_at(EXAMPLE_IDX, 34 + 24, i64s([1])), None, r"document indices must run from 0"),
    ],
)
def test_bad_files_raise_errors_naming_the_file(tmp_path, idx, bin_, message):
    bin_ = example_bin() if bin_ is None else bin_
    prefix = write_prefix(tmp_path, idx or EXAMPLE_IDX, bin_)
    with pytest.raises(ValueError, match=message) as info:
        IndexedDataset(prefix)
    assert str(tmp_path / "d") in str(info.value)


def test_missing_files_and_bad_access(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nothing\.idx: no such file"):
        IndexedDataset(str(tmp_path / "nothing"))
    ds = IndexedDataset(write_prefix(tmp_path, EXAMPLE_IDX, example_bin()))
    with pytest.raises(IndexError, match="sequence 2 is out of range for 2"):
        ds[2]
    with pytest.raises(IndexError, match=r"tokens 2\.\.5 are outside sequence 0 of 3"):
        ds.get(0, offset=2, length=3)
    with pytest.raises(ValueError, match="contiguous"):
        ds[0:2:2]


def test_builder_rejects_what_it_cannot_store(tmp_path):
    prefix = str(tmp_path / "b")
    with IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16) as builder:
        with pytest.raises(
            ValueError, match=r"token id 70000 does not fit .* uint16 \(0\.\.65535\)"
        ):
            builder.add_item([1, 70000])
        with pytest.raises(ValueError, match=r"token id -1 does not fit"):
            builder.add_item([-1])
        with pytest.raises(ValueError, match="must be 1-D"):
            builder.add_item([[1, 2]])
        with pytest.raises(ValueError, match="not integers"):
            builder.add_item([1.5])
        with pytest.raises(ValueError, match=r"do not split a document of 3 tokens"):
            builder.add_document([1, 2, 3], [1, 1])
        other = str(tmp_path / "o")
        IndexedDatasetBuilder(other + ".bin", dtype=np.int32).finalize(other + ".idx")
        with pytest.raises(ValueError, match="tokens are int32, this dataset's are uint16"):
            builder.add_index(other)
    with pytest.raises(ValueError, match="dtype bool has no MMIDIDX code"):
        IndexedDatasetBuilder(prefix + ".bin", dtype=bool)


def test_nothing_appears_before_finalize_or_after_a_failure(tmp_path):
    prefix = str(tmp_path / "f")
    with pytest.raises(RuntimeError, match="boom"), IndexedDatasetBuilder(prefix + ".bin") as b:
        b.add_item([1, 2, 3])
        assert not os.path.exists(prefix + ".bin")
        raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


KILLED_WRITER = """
    import sys, time
    import numpy as np
    from mp_data import IndexedDatasetBuilder
    builder = IndexedDatasetBuilder(sys.argv[1] + "_text_document.bin", dtype=np.uint16)
    for i in range(1000):
        builder.add_item(np.arange(1000) % 300)
        builder.end_document()
    print("writing", flush=True)
    time.sleep(60)
    builder.finalize(sys.argv[1] + "_text_document.idx")
"""


def test_a_writer_killed_mid_run_leaves_no_output_files(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(textwrap.dedent(KILLED_WRITER))
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(script), str(out / "P")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "writing"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    time.sleep(0.1)
    left = sorted(os.listdir(out))
    assert not [n for n in left if n.endswith((".bin", ".idx"))], left
    assert left and all(n.startswith(".") and n.endswith(".tmp") for n in left)
