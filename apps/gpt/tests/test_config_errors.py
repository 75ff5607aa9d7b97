"""A configuration mistake ends pretrain_gpt with one line from rank 0 naming the flag and
the fix, exit status 2 on every rank, and no traceback (docs/errors-and-logging.md).

Every message is checked through main() in this process (an error before the model is
built costs nothing); two forked ranks, with the variables torchrun sets, run main() at
once (each rank's output and status apart); the real entry point runs as a subprocess
for one rank, and under torchrun itself."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

import pytest

from mp_gpt.config_files import config_path
from mp_gpt.pretrain import main
from mp_gpt.testing import GIVEN_PEAK
from mp_state.testing import run_on_ranks

BASE = [
    "--config", str(config_path("tiny.yaml")), "--mock-data", *GIVEN_PEAK,
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--seq-length", "64",
    "--train-iters", "200", "--eval-interval", "none", "--save", "none", "--load", "none",
    "--tensorboard-dir", "none", "--num-workers", "0",
]  # fmt: skip

# (flags replacing or added to BASE, the whole line rank 0 prints)
MISTAKES = {
    "precision": (["--bf16", "--fp16"], "error: --bf16 and --fp16 are exclusive: choose one"),
    "tokenizer": (
        ["--tokenizer-type", "GPT3Tokenizer"],
        "error: --tokenizer-type GPT3Tokenizer is not one mp has: choose one of "
        "GPT2BPETokenizer, BertWordPieceLowerCase, BertWordPieceCase, HuggingFaceTokenizer, "
        "SFTTokenizer, NullTokenizer",
    ),
    "tokenizer argument": (
        ["--tokenizer-type", "GPT2BPETokenizer", "--merge-file", "none"],
        "error: --tokenizer-type GPT2BPETokenizer needs --merge-file",
    ),
    "tokenizer file": (
        ["--tokenizer-type", "GPT2BPETokenizer"],
        "error: --vocab-file /nonexistent/data/tokenizer/vocab.json does not exist "
        "(--tokenizer-type GPT2BPETokenizer)",
    ),
    "warmup iterations": (
        ["--lr-warmup-iters", "100", "--lr-decay-iters", "50"],
        "error: --lr-warmup-iters 100 is not below --lr-decay-iters 50: warm up for fewer "
        "iterations or decay over more",
    ),
    "warmup unit": (
        ["--train-iters", "none", "--train-samples", "100", "--lr-warmup-iters", "2"],
        "error: --lr-warmup-iters in a --train-samples run: the schedule counts samples; "
        "give --lr-warmup-samples or --lr-warmup-fraction (and --lr-warmup-iters 0 where a "
        "--config file sets it)",
    ),
    "warmup samples": (
        [
            "--train-iters",
            "none",
            "--train-samples",
            "6400",
            "--lr-warmup-iters",
            "0",
            "--lr-warmup-samples",
            "6400",
        ],
        "error: --lr-warmup-samples 6400 is not below --train-samples 6400 (the decay length "
        "without --lr-decay-samples): warm up for fewer samples or decay over more",
    ),
    "data path": (
        ["--no-mock-data", "--data-path", "/nonexistent/corpus_text_document"],
        "error: --data-path /nonexistent/corpus_text_document: "
        "/nonexistent/corpus_text_document.bin does not exist; give the path of a .bin/.idx "
        "pair without its extension",
    ),
    "layout": (
        ["--tensor-model-parallel-size", "2"],
        "error: world size 1 is not divisible by --tensor-model-parallel-size 2 x "
        "--pipeline-model-parallel-size 1 x --context-parallel-size 1: launch a multiple of "
        "2 ranks or lower these sizes",
    ),
    "heads": (
        ["--tensor-model-parallel-size", "3"],
        "error: --tensor-model-parallel-size 3 does not divide --num-attention-heads 4",
    ),
    "unknown flag": (
        ["--no-such-flag"],
        "error: unrecognized arguments: --no-such-flag (see pretrain_gpt.py --help)",
    ),
    "bad value": (
        ["--micro-batch-size", "two"],
        "error: argument --micro-batch-size: 'two' is not an integer (see pretrain_gpt.py --help)",
    ),
    "config file": (
        ["--config", "/nonexistent/run.yaml"],
        "error: /nonexistent/run.yaml: No such file or directory",
    ),
    "refused Megatron flag": (
        ["--fp8-param-gather"],
        "error: --fp8-param-gather: FP8 parameters and their all-gather need Transformer "
        "Engine: mp keeps parameters in their dtype under --fp8-format",
    ),
    "checkpoint format": (
        ["--ckpt-format", "torch"],
        "error: --ckpt-format torch: mp saves and loads its own torch_dist-style checkpoints; "
        "drop the flag (a Megatron-LM checkpoint in another format converts with `mp-ckpt "
        "import-megatron SRC DST`)",
    ),
    "fp8 recipe": (
        ["--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "delayed"],
        "error: --fp8-recipe delayed: delayed scaling (an amax history) is Transformer "
        "Engine's and torchao's float8 training has none; use --fp8-recipe tensorwise (mp's "
        "default) or rowwise",
    ),
    # The suite runs with MP_DEVICE=cpu (conftest.py), with or without a GPU.
    "fp8 without a GPU": (
        ["--bf16", "--fp8-format", "hybrid"],
        "error: --fp8-format hybrid needs a CUDA GPU with FP8 tensor cores (compute "
        "capability 8.9+: L4, L40S, H100, H200, B200); this rank computes on cpu "
        "(--fp8-emulate checks FP8 numerics without one, slowly)",
    ),
    "memory history without a GPU": (
        ["--record-memory-history"],
        "error: --record-memory-history records the CUDA caching allocator's history: it "
        "needs a CUDA device; this rank computes on cpu",
    ),
    "backend": (
        ["--distributed-backend", "nccl"],
        "error: --distributed-backend nccl needs CUDA devices and MP_DEVICE=cpu keeps this "
        "process on the CPU: use --distributed-backend gloo or unset MP_DEVICE",
    ),
}


def test_device_memory_that_cannot_be_measured_is_one_line(capsys, monkeypatch):
    def unmeasured(device):
        raise RuntimeError("log_device_memory_used needs NVML's Python bindings")

    monkeypatch.setattr("mp_train.observability.memory.device_memory_used", unmeasured)
    monkeypatch.setenv("MP_RUN_DIR", "/nonexistent")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main([*BASE, "--log-device-memory-used"]) == 2
    assert capsys.readouterr().err == "error: log_device_memory_used needs NVML's Python bindings\n"


@pytest.mark.parametrize("name", MISTAKES)
def test_a_mistake_is_one_line_and_status_2(name, capsys, monkeypatch):
    flags, line = MISTAKES[name]
    monkeypatch.setenv("MP_RUN_DIR", "/nonexistent")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main([*BASE, *flags]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", line + "\n")


def test_a_data_path_from_a_file_names_the_file(tmp_path, capsys, monkeypatch):
    listing = tmp_path / "data-args.txt"
    listing.write_text("0.5 /nonexistent/web 0.5 /nonexistent/code\n")
    monkeypatch.setenv("MP_RUN_DIR", "/nonexistent")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "1", "--train-iters", "10",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
        "--data-args-path", str(listing),
    ]  # fmt: skip
    assert main(argv) == 2
    line = (
        f"error: --data-args-path {listing} lists /nonexistent/web: /nonexistent/web.bin does "
        "not exist; give the path of a .bin/.idx pair without its extension"
    )
    assert capsys.readouterr() == ("", line + "\n")


def _environment(**extra: str) -> dict[str, str]:
    return {**os.environ, "MP_RUN_DIR": "/nonexistent", "OMP_NUM_THREADS": "1", **extra}


def _entry_point(*flags: str) -> list[str]:
    return [sys.executable, "-m", "mp_gpt.pretrain", *BASE, *flags]


def test_one_rank_subprocess():
    flags, line = MISTAKES["precision"]
    done = subprocess.run(_entry_point(*flags), env=_environment(), capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert (done.returncode, done.stdout, done.stderr) == (2, "", line + "\n")


def _main_on_rank(argv_per_mistake: list[list[str]]) -> list[tuple[int, str, str]]:
    """Each main(argv)'s status and what it printed (stdout, stderr) on this rank."""
    os.environ["MP_RUN_DIR"] = "/nonexistent"
    found = []
    for argv in argv_per_mistake:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main(argv)
        found.append((status, out.getvalue(), err.getvalue()))
    return found


@pytest.mark.multirank
def test_two_ranks_find_the_mistake_and_rank_0_alone_prints():
    """Both ranks find the mistake and return 2; rank 0 alone prints, rank 1 says nothing.
    The ranks are forked with torchrun's variables (RANK, WORLD_SIZE 2, ...) and no
    process group: the mistakes are found before torch.distributed starts. One mistake
    only: rank 1 waits mp_train's 5 s grace period after every mistake it finds."""
    names = ["data path"]
    argvs = [[*BASE, *MISTAKES[name][0]] for name in names]
    rank0, rank1 = run_on_ranks(_main_on_rank, 2, argvs, init_process_group=False, timeout=120)
    assert rank0 == [(2, "", MISTAKES[name][1] + "\n") for name in names]
    assert rank1 == [(2, "", "")] * len(names)


def test_under_torchrun(tmp_path):
    """torchrun adds its own report of the ranks' exit statuses (with its launcher's
    traceback, and exits 1); the ranks print one line and no traceback."""
    flags, line = MISTAKES["precision"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", "--log-dir", str(tmp_path / "torchrun-logs"),
               *_entry_point(*flags)[1:]]  # fmt: skip
    done = subprocess.run(command, env=_environment(), capture_output=True, text=True,
                          timeout=180)  # fmt: skip
    output = done.stdout + done.stderr
    assert [text for text in output.splitlines() if text.startswith("error:")] == [line]
    # torchrun stops the other rank once one has exited: one status 2 at least.
    assert "exitcode  : 2" in output, output
    # The one traceback is the launcher's own (torch/distributed/run.py), no rank's.
    assert "mp_gpt" not in output.split("Traceback", 1)[-1].split("ChildFailedError")[0], output
