"""The embedded default: GPT pretraining from nothing, on this machine, with no downloads.

    uv run mp-gpt-quickstart [--run-dir runs/quickstart] [--nproc 2]

1. a real text corpus: the documentation strings of the installed Python code;
2. a byte-level BPE tokenizer trained on it (mp-data train-tokenizer);
3. the corpus tokenized into Megatron's .bin/.idx (mp-data preprocess);
4. configs/tiny.yaml trained on `--nproc` ranks under torchrun (gloo on
   CPUs): the loss falls, validation runs, checkpoints and TensorBoard logs
   land in the run directory;
5. a sample generated from the last checkpoint.

Each step is skipped when its output exists, and training resumes from the
latest checkpoint: running the command again continues instead of starting
over (`--train-iters N --override-opt-param-scheduler` trains further: the
learning-rate schedule then decays over the new length).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from mp_data import write_docstring_corpus
from mp_gpt.config_files import config_path

__all__ = ["main"]

CONFIG = config_path("tiny.yaml")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mp-gpt-quickstart", description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", default="runs/quickstart", help="everything goes here")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (processes) to train on")
    parser.add_argument("--corpus-mb", type=float, default=6.0, help="size of the text corpus")
    parser.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size")
    parser.add_argument("--config", default=str(CONFIG), help="the training YAML file")
    args, overrides = parser.parse_known_args(argv)
    run_dir = Path(args.run_dir).resolve()
    data = run_dir / "data"
    data.mkdir(parents=True, exist_ok=True)

    corpus = data / "corpus.jsonl"
    if not corpus.exists():
        _step(f"writing a {args.corpus_mb:g} MB corpus of Python docstrings to {corpus}")
        write_docstring_corpus(str(corpus), int(args.corpus_mb * 2**20))
    tokenizer = data / "tokenizer"
    if not (tokenizer / "merges.txt").exists():
        _step(f"training a {args.vocab_size}-token BPE tokenizer into {tokenizer}")
        _check(mp_data(["train-tokenizer", "--input", str(corpus), "--vocab-size",
                        str(args.vocab_size), "--output", str(tokenizer)]))  # fmt: skip
    prefix = data / "corpus"
    if not Path(f"{prefix}_text_document.idx").exists():
        _step("tokenizing the corpus into .bin/.idx")
        _check(mp_data([
            "preprocess", "--input", str(corpus), "--output-prefix", str(prefix),
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tokenizer / "vocab.json"),
            "--merge-file", str(tokenizer / "merges.txt"), "--append-eod", "--workers", "2",
        ]))  # fmt: skip

    _step(f"training {args.config} on {args.nproc} ranks (logs: {run_dir / 'tensorboard'})")
    env = {**os.environ, "MP_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={args.nproc}", "-m", "mp_gpt.pretrain",
        "--config", args.config, *overrides,
    ]  # fmt: skip
    started = time.time()
    result = subprocess.run(command, env=env)
    if result.returncode != 0:
        print(f"training failed with exit status {result.returncode}", file=sys.stderr)
        return result.returncode
    _step(f"trained in {time.time() - started:.0f} s; a sample from the last checkpoint:")
    sample = subprocess.run(
        [sys.executable, "-m", "mp_gpt.generate", "--load", str(run_dir / "checkpoints"),
         "--prompt", "The function returns", "--max-new-tokens", "40"],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    if sample.returncode != 0:
        print(sample.stderr, file=sys.stderr)
        return sample.returncode
    print(sample.stdout.strip())
    print(f"\nrun directory: {run_dir} (checkpoints/, tensorboard/, data/); run the command "
          "again to continue from the latest checkpoint")  # fmt: skip
    return 0


def _step(message: str) -> None:
    print(f"==> {message}", flush=True)


def mp_data(args: list[str]) -> int:
    """Runs the `mp-data` command (its exit status)."""
    return subprocess.run([sys.executable, "-m", "mp_data.cli", *args]).returncode


def _check(status: int) -> None:
    if status:
        raise SystemExit(status)


if __name__ == "__main__":
    sys.exit(main())
