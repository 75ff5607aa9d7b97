"""`mp-train estimate --megatron-formula` against megatron-core 0.19.2's own figures:
assets/megatron_estimate/cases.json, written by generate.py beside it from Megatron-LM
command lines (dense GPT-2 and Llama, Mixtral, DeepSeek-V3 with MTP, DeepSeek-V2-Lite;
TP, PP, virtual PP, DP, CP, EP, the distributed optimizer on and off). The same command
lines go through mp's parser here; every float and every printed line must be Megatron's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mp_train.estimate import main

CASES = json.loads((Path(__file__).parent / "assets/megatron_estimate/cases.json").read_text())
FIGURES = ("weight_and_optimizer_mb", "activation_mb", "total_mb", "flops_per_iteration",
           "padded_vocab_size", "data_parallel_size", "num_microbatches")  # fmt: skip


def run(case: dict, capsys, *flags: str) -> dict:
    argv = ["estimate", *flags, "--world-size", str(case["world_size"]), "--vocab-size",
            str(case["vocab_size"]), *case["command_line"].split()]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_every_case_is_megatrons(capsys):
    assert CASES["megatron_core"] == "0.19.2"
    for name, case in CASES["cases"].items():
        ours = run(case, capsys, "--megatron-formula")
        assert {key: ours[key] for key in FIGURES} == {key: case[key] for key in FIGURES}, name
        assert ours["megatron_report"] == case["report"], name
        assert ours["formula"] == "megatron-core 0.19.2"
        # mp's own FLOPs are Megatron's count too (MTP, MoE, MLA included).
        assert run(case, capsys)["flops_per_iteration"] == case["flops_per_iteration"], name


def test_the_default_differs_from_megatron_by_what_mp_holds_beside_its_formula(capsys):
    # GPT-2 1.3B at TP 2 x DP 4 with the distributed optimizer. Without biases and learned
    # positions mp holds the parameters Megatron's formula counts, and its weights and
    # optimizer state are Megatron's to the byte: 655,822,848 parameters x (6 + 12/4) B.
    # (Before the norms were counted whole on each tensor-parallel rank, as Megatron
    # counts them since 0.19 and as they are allocated, mp printed 5,628.11 MB.)
    lean = CASES["cases"]["gpt2-1.3b-no-bias-tp2-dp4-distopt"]
    assert lean["weight_and_optimizer_mb"] == 655_822_848 * 9 / 2**20 == 5628.97265625
    assert run(lean, capsys)["weight_and_optimizer_mb"] == lean["weight_and_optimizer_mb"]
    # With Megatron's defaults (biases, learned positions) mp also holds per layer the QKV
    # and fc1 biases 3h + 4h / t and the out and fc2 biases 2h whole, and the 2048 x h
    # positions whole: 24 x 11,264 + 4,194,304 = 4,464,640 parameters, 38.32 MB more.
    full = CASES["cases"]["gpt2-1.3b-tp2-dp4-distopt"]
    ours = run(full, capsys)
    assert ours["parameters_on_most_loaded_shard"] == 655_822_848 + 4_464_640
    assert ours["weight_and_optimizer_mb"] - full["weight_and_optimizer_mb"] == pytest.approx(
        4_464_640 * 9 / 2**20
    )
