"""mp-data preprocess on bad input: file:line in messages, --skip-bad-lines, no partial output."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mp_data import IndexedDataset
from mp_data.cli import encode, input_file, main, preprocess

GPT2 = Path(__file__).parent / "assets" / "tokenizers" / "gpt2"
GPT2_ARGS = [
    "--tokenizer-type", "GPT2BPETokenizer",
    "--vocab-file", str(GPT2 / "vocab.json"),
    "--merge-file", str(GPT2 / "merges.txt"),
]  # fmt: skip

GOOD = '{"text": "A good line."}'


def run(tmp_path: Path, lines: list[str] | bytes, *extra: str, tokenizer=GPT2_ARGS):
    """Preprocesses `lines` (one per line) into tmp_path/out; returns the exit status."""
    source = tmp_path / "in.jsonl"
    if isinstance(lines, bytes):
        source.write_bytes(lines)
    else:
        source.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    args = ["preprocess", "--input", str(source), "--output-prefix", str(tmp_path / "out")]
    return main([*args, *tokenizer, *extra])


def outputs(folder: Path) -> list[str]:
    """Files a run left in `folder`, its input aside: temporaries (.out*) included."""
    return sorted(p.name for p in folder.iterdir() if "out" in p.name)


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ('{"text": "unterminated}', "not valid JSON"),
        ('{"body": "no text key"}', "no key 'text' (keys present: 'body')"),
        ('["a", "list"]', "expected a JSON object, got an array"),
        ('{"text": 42}', "key 'text' holds a number; expected a string"),
        ('{"text": null}', "key 'text' holds null"),
        ('{"text": ["one", 2]}', "key 'text' holds an array with a number in it"),
        ('{"text": "lone \\ud800 surrogate"}', "lone surrogate"),
    ],
)
def test_a_bad_line_fails_the_run_naming_file_and_line(tmp_path, capsys, line, reason):
    assert run(tmp_path, [GOOD, GOOD, line, GOOD]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"mp-data preprocess: error: {tmp_path / 'in.jsonl'}:3: ")
    assert reason in err and "--skip-bad-lines" in err
    assert outputs(tmp_path) == []  # temporaries discarded too


def test_bad_bytes_and_the_line_number_with_two_workers(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(input_file, "BLOCK_BYTES", 64)  # many blocks, in flight at once
    lines = [GOOD.encode()] * 40 + [b'{"text": "caf\xe9"}'] + [GOOD.encode()] * 40
    assert run(tmp_path, b"\n".join(lines), "--workers", "2") == 1
    err = capsys.readouterr().err
    assert "in.jsonl:41: not UTF-8 text (byte 14: b'\\xe9')" in err
    assert outputs(tmp_path) == []


def test_skip_bad_lines_skips_and_counts(tmp_path, capsys):
    lines = [GOOD, "{not json", GOOD, '{"title": "x"}', "", GOOD, '{"text": 1}']
    assert run(tmp_path, lines, "--skip-bad-lines") == 0
    out = capsys.readouterr().out
    assert "3 documents" in out and "3 bad lines skipped" in out
    assert "skipped lines of" in out and ": 2, 4, 7 (line 2: not valid JSON" in out
    assert IndexedDataset(str(tmp_path / "out_text_document")).document_count == 3
    assert run(tmp_path, ["{"] * 8 + [GOOD], "--skip-bad-lines") == 0
    out = capsys.readouterr().out
    assert "8 bad lines skipped" in out and ": 1, 2, 3, 4, 5, ... (line 1:" in out


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"", "no documents (the file is empty)"),
        (b"\n  \n\n", "no documents (3 lines, all blank)"),
        (b'{"text": ""}\n{"text": ""}\n', "2 documents, but all are empty"),
    ],
)
def test_empty_input_is_an_error(tmp_path, capsys, content, why):
    assert run(tmp_path, content) == 1
    assert why in capsys.readouterr().err
    assert outputs(tmp_path) == []


def test_all_lines_bad_and_skipped_is_an_error(tmp_path, capsys):
    assert run(tmp_path, ["{", "}"], "--skip-bad-lines") == 1
    assert "no documents (all 2 non-blank lines were skipped as bad)" in capsys.readouterr().err


def test_an_id_outside_the_vocabulary_names_the_line(tmp_path, capsys):
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    lines = ['{"text": "1 2 3"}', '{"text": "4 99 5"}', '{"text": "6 100"}', '{"text": "x"}']
    assert run(tmp_path, lines, tokenizer=null) == 1
    err = capsys.readouterr().err
    assert "in.jsonl:3: the tokenizer rejects the text: NullTokenizer: id 100 is outside" in err
    assert outputs(tmp_path) == []
    # 99 is the eod of NullTokenizer(100): in the vocabulary. "x" is no id at all.
    assert run(tmp_path, lines, "--skip-bad-lines", tokenizer=null) == 0
    out = capsys.readouterr().out
    assert "2 bad lines skipped" in out and ": 3, 4 (line 3:" in out
    dataset = IndexedDataset(str(tmp_path / "out_text_document"))
    assert [s.tolist() for s in dataset] == [[1, 2, 3], [4, 99, 5]]


def test_missing_files_are_clear_errors(tmp_path, capsys):
    args = ["preprocess", "--output-prefix", str(tmp_path / "out"), *GPT2_ARGS]
    assert main([*args, "--input", str(tmp_path / "nothing.jsonl")]) == 1
    assert f"{tmp_path / 'nothing.jsonl'}: no such input file" in capsys.readouterr().err
    source = tmp_path / "in.jsonl"
    source.write_text(GOOD + "\n")
    no_vocab = ["--vocab-file", str(tmp_path / "vocab.json")]
    assert main([*args, "--input", str(source), *no_vocab]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'vocab.json'}: no such file (vocab_file of GPT2BPETokenizer)" in err
    no_folder = ["--output-prefix", str(tmp_path / "missing" / "out")]
    assert main([*args, "--input", str(source), *no_folder]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert main([*args, "--input", str(source), "--append-eod", "--workers", "0"]) == 1
    assert "--workers must be at least 1, got 0" in capsys.readouterr().err


def test_a_truncated_gzip_file_is_an_error(tmp_path, capsys):
    packed = gzip.compress(("".join(GOOD + "\n" for _ in range(2000))).encode())
    (tmp_path / "in.jsonl.gz").write_bytes(packed[: len(packed) // 2])
    args = ["--input", str(tmp_path / "in.jsonl.gz"), "--output-prefix", str(tmp_path / "out")]
    assert main(["preprocess", *args, *GPT2_ARGS]) == 1
    err = capsys.readouterr().err
    assert "in.jsonl.gz: cannot read past line " in err and "end-of-stream" in err
    assert outputs(tmp_path) == []


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked only on Linux")
def test_a_dead_worker_is_an_error_not_a_hang(tmp_path, capsys, monkeypatch):
    # The workers are forked: they inherit this patch and die on their first block.
    monkeypatch.setattr(encode.Encoder, "encode", lambda self, data, first: os._exit(3))
    assert run(tmp_path, [GOOD] * 10, "--workers", "2") == 1
    assert "a worker process died unexpectedly" in capsys.readouterr().err
    assert outputs(tmp_path) == []


def test_sigterm_discards_the_outputs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(input_file, "BLOCK_BYTES", 64)
    update = preprocess.Progress.update

    def update_then_terminate(self, *args):
        update(self, *args)
        if self.documents > 5:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(preprocess.Progress, "update", update_then_terminate)
    before = signal.getsignal(signal.SIGTERM)
    assert run(tmp_path, [GOOD] * 50) == 130
    assert "interrupted; no output was written" in capsys.readouterr().err
    assert outputs(tmp_path) == []
    assert signal.getsignal(signal.SIGTERM) is before


def _cli(*args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen(
        [sys.executable, "-m", "mp_data.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        **kwargs,
    )


def test_command_line_exit_status_and_no_traceback(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(GOOD + "\n{oops\n")
    process = _cli("preprocess", "--input", str(source), "--output-prefix", str(tmp_path / "o"),
                   *GPT2_ARGS)  # fmt: skip
    _, err = process.communicate(timeout=120)
    assert process.returncode == 1
    assert err.strip() == (
        f"mp-data preprocess: error: {source}:2: not valid JSON: Expecting property name "
        "enclosed in double quotes (column 2) (--skip-bad-lines skips such lines)"
    )


def test_kill_9_leaves_no_outputs(tmp_path):
    source = tmp_path / "big.jsonl"
    line = json.dumps({"text": " ".join(f"word{i} and more text." for i in range(200))})
    source.write_text((line + "\n") * 3000)  # ~8 MB: seconds of tokenizing
    prefix = tmp_path / "big"
    process = _cli("preprocess", "--input", str(source), "--output-prefix", str(prefix),
                   *GPT2_ARGS, "--workers", "2")  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not any(p.stat().st_size for p in tmp_path.glob(".big_text_document.bin.*.tmp")):
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline, "the run never started writing"
            time.sleep(0.01)
        workers = _children(process.pid)
        assert workers is None or len(workers) == 2
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        process.kill()
        process.communicate()
    assert process.returncode == -signal.SIGKILL
    assert sorted(tmp_path.glob("big_*")) == []  # only hidden temporaries may remain
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers or ()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in workers or ()), "orphaned workers kept running"


def _children(pid: int) -> list[int] | None:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return None  # not Linux, or no children file: the orphan check is skipped
    return [int(p) for p in text.split()]


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited; only its reaping is left
