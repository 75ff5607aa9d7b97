"""Helpers for tests that train apps/gpt end to end on forked gloo ranks."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import tempfile
from pathlib import Path

import torch

# mp_gpt.pretrain is imported here, in the test process, so that every rank forked from
# it shares the modules instead of importing (and, without bytecode files, compiling)
# them again: a quarter of a short run's time.
import mp_gpt.pretrain  # noqa: F401
from mp_gpt.config_files import config_path

__all__ = [
    "GIVEN_PEAK",
    "HYBRID_OPTIONS",
    "LOGGED_MOE",
    "TINY_CONFIG",
    "assert_same_curve",
    "complete_records",
    "curves_part",
    "greedy_on_rank",
    "imported_model",
    "metrics_records",
    "reference_greedy",
    "runs_on_rank",
    "saved_model",
    "tiny_moe_options",
    "tiny_options",
    "train_on_rank",
    "train_output_on_rank",
    "train_printed_on_rank",
    "train_run_on_rank",
]

TINY_CONFIG = config_path("tiny.yaml")

HYBRID_OPTIONS = (
    "--num-layers", "2", "--hybrid-layer-pattern", "M*", "--mamba-num-heads", "8",
    "--mamba-head-dim", "16", "--mamba-num-groups", "2", "--mamba-state-dim", "16",
)  # fmt: skip
"""tiny.yaml's model made a Mamba-hybrid one: a Mamba-2 layer (8 heads of 16 channels in 2
groups, a state of 16), then an attention layer."""

GIVEN_PEAK = ("--peak-tflops", "1")
"""The MFU reference for test runs, given rather than measured: each rank's measure (a
bf16 matmul, several rounds) costs 0.2 s at every start, a quarter of a tiny run on a
forked rank; packages/mp-train/tests/test_mfu.py tests the measure itself."""

LOGGED_MOE = ("lm loss", "load_balancing_loss", "z_loss", "grad_norm")
"""What a MoE run's metrics file records per iteration that layouts must agree on."""


def tiny_options(run_dir: Path, *extra: str) -> list[str]:
    """tiny.yaml on mock data, fp32, 4 iterations of 4 sequences of 64 tokens in
    micro-batches of one, metrics to run_dir/metrics.jsonl, no checkpoints (a later
    --save / --load in `extra` wins), the MFU reference given (GIVEN_PEAK); then extra.
    The ranks forked from this process find the runs' mock datasets built."""
    _warm_forked_ranks()
    return _tiny_argv(run_dir, *extra)


def _tiny_argv(run_dir: Path, *extra: str) -> list[str]:
    return [
        "--config", str(TINY_CONFIG), "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "1000", "--make-vocab-size-divisible-by", "512",
        "--seq-length", "64", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--train-iters", "4", "--eval-interval", "none", "--log-interval", "10",
        "--save", "none", "--load", "none", "--tensorboard-dir", "none",
        "--metrics-file", str(run_dir / "metrics.jsonl"), "--num-workers", "0",
        "--lr-warmup-iters", "1", *GIVEN_PEAK, *extra,
    ]  # fmt: skip


def tiny_moe_options(run_dir: Path, *extra: str) -> list[str]:
    """tiny-moe.yaml on mock data, fp32, 4 iterations of 4 sequences of 64 tokens in
    micro-batches of one, metrics to run_dir/metrics.jsonl, no checkpoints, the MFU
    reference given (GIVEN_PEAK); then extra. The ranks forked from this process find
    the runs' mock datasets built."""
    _warm_forked_ranks()
    return [
        "--config", str(config_path("tiny-moe.yaml")), "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
        "--make-vocab-size-divisible-by", "512", "--seq-length", "64",
        "--micro-batch-size", "1", "--global-batch-size", "4",
        "--train-iters", "4", "--eval-interval", "none", "--log-interval", "10",
        "--save", "none", "--load", "none", "--tensorboard-dir", "none",
        "--metrics-file", str(run_dir / "metrics.jsonl"), "--num-workers", "0",
        "--lr-warmup-iters", "1", "--expert-model-parallel-size", "1", *GIVEN_PEAK, *extra,
    ]  # fmt: skip


def metrics_records(run_dir: Path) -> list[dict]:
    """The records of run_dir/metrics.jsonl, one per iteration."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def tiny_curve(run_dir: Path, ranks: int, *extra: str) -> list[dict]:
    """tiny_options(run_dir, *extra) trained on `ranks` of the test launcher's ranks
    (mp_state.testing); its metrics records."""
    from mp_state.testing import run_on_ranks

    run_on_ranks(train_on_rank, ranks, tiny_options(run_dir, *extra), timeout=300)
    return metrics_records(run_dir)


def complete_records(run_dir: Path) -> list[dict]:
    """The records of run_dir/metrics.jsonl written whole, in order: a line a kill cut
    short is not one (for runs a test kills)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    found = []
    for line in path.read_text().splitlines():
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return found


def assert_same_curve(got: list[dict], want: list[dict], keys, name: str) -> None:
    """The same iterations and consumed samples, and every value of `keys` within 1e-5
    relative of the reference's."""
    assert [r["iteration"] for r in got] == [r["iteration"] for r in want], name
    for mine, reference in zip(got, want, strict=True):
        where = f"{name}, iteration {reference['iteration']}"
        assert mine["consumed_samples"] == reference["consumed_samples"], where
        for key in keys:
            difference = abs(mine[key] - reference[key])
            assert difference <= 1e-5 * abs(reference[key]), (where, key, mine, reference)


def curves_part(one: list[dict], other: list[dict], keys) -> float:
    """The largest relative difference between two runs' values of `keys`, over their
    iterations: how far a change to the data or the model moved the curve (one step's
    loss at initialization may land near the other run's by chance)."""
    assert [r["iteration"] for r in one] == [r["iteration"] for r in other]
    return max(abs(mine[key] - theirs[key]) / abs(theirs[key])
               for mine, theirs in zip(one, other, strict=True) for key in keys)  # fmt: skip


def train_on_rank(argv: list[str]) -> int:
    """One rank of a run of `mp_gpt.pretrain.main(argv)` under mp_state.testing's launcher:
    one thread per rank (the forked ranks share the cores) and no run directory."""
    _rank_setup()
    from mp_gpt.pretrain import main

    return main(argv)


def train_output_on_rank(argv: list[str]) -> tuple[int, str]:
    """As train_on_rank, with what the rank printed: (exit status, stdout and stderr in
    one text). mp's log handler writes to sys.stderr as it is at each record, so the log
    lines are in it. The streams go to a file, not a StringIO: the hang watchdog hands
    sys.stderr's descriptor to faulthandler."""
    with tempfile.TemporaryFile("w+") as out:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            status = train_on_rank(argv)
        out.seek(0)
        return status, out.read()


def train_run_on_rank(argv: list[str]):
    """As train_on_rank, but returns the finished run (mp_train's Run) for the test to
    read from; the process group stays up, as the launcher ends the rank anyway."""
    _rank_setup()
    from mp_gpt.pretrain import train
    from mp_train import parse_config

    return train(parse_config(argv))


def train_printed_on_rank(argv: list[str]) -> str:
    """As train_run_on_rank, but returns what the rank printed (its stdout)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train_run_on_rank(argv)
    return out.getvalue()


def imported_model(checkpoint) -> torch.nn.Module:
    """mp_layers.GPTModel on one rank, built from the settings a checkpoint's common.pt
    records (common["model_config"], as mp-ckpt import-hf writes it), dropout 0, with the
    checkpoint's weights, in eval mode."""
    import dataclasses

    from mp_ckpt import CheckpointReader, load_checkpoint
    from mp_layers import GPTModel, ModelGroups, TransformerConfig

    path = CheckpointReader(checkpoint).directory / "common.pt"
    settings = torch.load(path, weights_only=False)["model_config"]
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    kept = {k: v for k, v in settings.items() if k in fields}
    config = TransformerConfig(**kept | {"hidden_dropout": 0.0, "attention_dropout": 0.0})
    torch.manual_seed(9)  # other weights until loaded
    model = GPTModel(config, "local", settings["vocab_size"], settings["max_position_embeddings"],
                     groups=ModelGroups.single()).eval()  # fmt: skip
    load_checkpoint(checkpoint, model.sharded_state_dict())
    return model


def saved_model(checkpoint, max_length: int) -> tuple[torch.nn.Module, dict]:
    """(GPTModel on one rank with the settings and weights of a training run's save, in
    eval mode, dropout 0, without the run's sequence parallelism; the save's common.pt)
    for tests comparing a run's result."""
    import dataclasses

    from mp_ckpt import CheckpointReader, load_checkpoint
    from mp_layers import GPTModel, ModelGroups, TransformerConfig

    common = torch.load(CheckpointReader(checkpoint).directory / "common.pt", weights_only=False)
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    skipped = ("params_dtype", "hidden_dropout", "attention_dropout", "sequence_parallel")
    kept = {k: v for k, v in common["config"]["model"].items()
            if k in fields and k not in skipped}  # fmt: skip
    config = TransformerConfig(**kept, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config, "local", common["model_config"]["vocab_size"], max_length,
                     groups=ModelGroups.single()).eval()  # fmt: skip
    load_checkpoint(checkpoint, model.sharded_state_dict(), strict=False)  # no optimizer
    return model, common


def runs_on_rank(*argvs: list[str]) -> None:
    """One rank of runs of `mp_gpt.pretrain`, one after the other in the same process (each
    ends its process groups), under mp_state.testing's launcher."""
    _rank_setup()
    import mp_state
    from mp_gpt.pretrain import train
    from mp_train import load_config

    for i, argv in enumerate(argvs):
        if i:
            mp_state.destroy()
        train(load_config(argv))


def reference_greedy(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    """The new tokens of a transformers model's generate(do_sample=False) for each prompt
    alone (exactly `new` of them: no end-of-document stop)."""
    want = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
            want.append(out[0, len(prompt) :].tolist())
    return want


def greedy_on_rank(checkpoint: str, layout: list[str], prompts: list[list[int]],
                   new: int) -> list[list[int]]:  # fmt: skip
    """One rank of mp_gpt.generate's Generator over `checkpoint` at `layout` (its parallel
    options): the greedy new tokens of the prompts, generated in one batch."""
    torch.set_num_threads(1)
    from mp_gpt.generate import Generator
    from mp_gpt.generation import Sampling

    generator = Generator(checkpoint, layout)
    try:
        done = generator.complete(prompts, max_new_tokens=new,
                                  sampling=[Sampling()] * len(prompts))  # fmt: skip
    finally:
        generator.close()
    return [c.tokens for c in done]


def _rank_setup() -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("MP_RUN_DIR", "/nonexistent")


def _warm_forked_ranks() -> None:
    """Does in the test process the start-up work that each rank forked from it would
    otherwise repeat, so that its ranks find it done: the command-line parser's help
    texts, read from the config classes' source (once), and the mock datasets of
    tiny_options' runs, which mp-data keeps for the process (mp_data.built_indices;
    built again when the test process's own builds have pushed them out). A rank of a
    tiny run spent about 0.45 s of CPU, 0.25 s of it on these (docs/testing.md)."""
    global _warm_datasets
    from mp_data import kept_indices

    if _warm_datasets and set(_warm_datasets) <= set(kept_indices()):
        return
    config = _tiny_config()
    _build_mock_datasets(config)
    _warm_datasets = kept_indices()[-3:]  # train, valid and test


_warm_datasets: list[str] = []


@functools.cache
def _tiny_config():
    from mp_train import parse_config

    environ = {**os.environ, "MP_RUN_DIR": "/nonexistent"}
    return parse_config(_tiny_argv(Path(tempfile.gettempdir())), environ=environ)


def _build_mock_datasets(config) -> None:
    """apps/gpt's datasets of `config`, built as one rank of one would build them."""
    from types import SimpleNamespace

    from mp_data import build_tokenizer, train_valid_test_num_samples
    from mp_gpt.gpt import datasets_provider

    data, training = config.data, config.training
    tokenizer = build_tokenizer(data.tokenizer_type, vocab_size=data.vocab_size)
    counts = train_valid_test_num_samples(
        training.train_iters, training.global_batch_size, training.eval_interval or 0,
        training.eval_iters,
    )  # fmt: skip
    alone = SimpleNamespace(rank=0, size=1)
    state = SimpleNamespace(pp=alone, tp=alone)
    datasets_provider(SimpleNamespace(config=config, state=state, tokenizer=tokenizer), counts)
