"""mp refuses, before a run starts, the Megatron-LM command lines that Megatron-LM refuses,
and accepts the ones it accepts (assets/megatron_refusals/cases.json, written by its
generate.py with megatron-core 0.19.2: parse_args, validate_args, then the micro-batch
calculator and the TransformerConfig, OptimizerConfig and DistributedDataParallelConfig
its training builds). Where the two differ on purpose, DIFFERENCES says how and why.

mp's verdict is mp_train.parse_config then mp_train.validate at the case's world size: a
refusal is a one-line error (ValueError or ConfigError), or argparse's exit naming the
flag. A command line both accept must come to the settings Megatron-LM derives from it
(the model's fields, the layout, the batch, the optimizer's; DERIVED_DIFFERENCES names
the fields that differ on purpose)."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from mp_train import parse_config, validate

CASES = json.loads((Path(__file__).parent / "assets/megatron_refusals/cases.json").read_text())

EARLIER = "earlier"
"""mp refuses before the run what Megatron-LM's set-up takes and fails on later."""
STRICTER = "stricter"
"""mp refuses a value, or a flag, that Megatron-LM reads as another or ignores."""
LIMITATION = "limitation"
"""mp refuses what Megatron-LM runs: a feature mp lacks, named in the error."""
EXTENSION = "extension"
"""mp runs what Megatron-LM refuses."""

DIFFERENCES: dict[str, tuple[str, str]] = {
    # mp refuses; Megatron-LM's set-up takes it
    "vpp-microbatches-not-a-multiple-of-pp": (EARLIER, "Megatron-LM's interleaved schedule "
        "raises at the first step (schedules.py: the last group of micro-batches)"),
    "moe-router-topk-above-experts": (EARLIER, "5 of 4 experts: the router's top-k has no "
        "5 to pick at the first forward"),
    "moe-layer-freq-list-of-wrong-length": (EARLIER, "Megatron-LM's layer specs assert the "
        "pattern's length when they build the layers (gpt_layer_specs.py)"),
    "gqa-groups-not-dividing-heads": (EARLIER, "4 query heads do not share 3 key/value "
        "groups: no attention is built of it"),
    "cp-a2a-with-heads-not-divisible": (EARLIER, "the all-to-all splits each rank's 2 "
        "key/value heads over 4 context-parallel ranks at the first forward"),
    "gated-delta-net-without-its-sizes": (EARLIER, "Megatron-LM's GatedDeltaNet asserts a "
        "silu activation in its convolution (gated_delta_net/gdn.py), at the first forward"),
    "rotary-percent-above-one": (STRICTER, "Megatron-LM shortens the rotary dimension only "
        "below 1, so 1.5 rotates the whole head"),
    "rampup-and-step-schedule": (STRICTER, "Megatron-LM ignores --rampup-batch-size "
        "(deprecated there); mp ramps with it, and two batch schedules are one too many"),
    "moe-without-sp-at-tp2": (EARLIER, "Megatron-LM's MoE layer raises at its first "
        "training forward under tensor parallelism without sequence parallelism "
        "(moe_layer.py)"),
    "moe-ep-with-tp-without-sp": (EARLIER, "as moe-without-sp-at-tp2"),
    "muon-with-fp16": (EARLIER, "Megatron-LM refuses Muon (an emerging optimizer) in fp16 "
        "when it builds the optimizer"),
    "relative-positions": (LIMITATION, "T5's relative position bias is not implemented"),
    "fp8-with-fp16": (LIMITATION, "mp's FP8 GEMMs (torchao's) take and give bf16"),
    # mp runs; Megatron-LM refuses
    "megatron-fsdp": (EXTENSION, "Megatron-FSDP saves only as fsdp_dtensor; mp's one "
        "checkpoint format serves FSDP and every other layout"),
    "overlap-param-gather-with-optimizer-step-without-vpp": (EXTENSION, "mp takes the flag "
        "without effect (docs/migrating-from-megatron.md), so no layout needs refusing"),
    "vpp-at-pp2-without-p2p-overlap": (EXTENSION, "Megatron-LM's batched exchange would pair "
        "two messages with the one neighbour; mp's keep the two directions apart (gloo tags, "
        "a fixed order) and run the interleaved schedule at PP2 without overlap"),
    "save-without-interval": (EXTENSION, "mp saves at the end of training (and on an exit "
        "signal) without an interval"),
    "attention-backend-local": (EXTENSION, "Megatron-LM asks for its local layer spec "
        "(--spec local); mp's --attention-backend local is its unfused attention in either "
        "layer implementation"),
    "moe-shared-expert-overlap-with-allgather": (EXTENSION, "mp takes "
        "--moe-shared-expert-overlap without effect, so no dispatcher needs refusing"),
    "squared-relu": (EXTENSION, "Megatron-LM's bias-activation fusion, on by default, has "
        "no squared-ReLU kernel; mp has no fusion to refuse it (--no-bias-gelu-fusion is a "
        "no-op)"),
    "moe-bias-with-etp2": (EXTENSION, "mp's grouped experts add fc2's bias once, after the "
        "expert-tensor-parallel reduction (moe/experts.py; test_moe_layouts.py)"),
    "decrease-batch-size-if-needed": (EXTENSION, "without eval_global_batch_size mp "
        "evaluates with the decreased global batch; Megatron-LM checks the requested one"),
}  # fmt: skip
"""case -> (how mp differs from Megatron-LM, why). mp's verdict is the other one."""


def mp_verdict(command_line: str, world_size: int) -> tuple[str, str]:
    """("accepted", "") or ("refused", the error's text)."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            validate(parse_config(command_line.split()), world_size)
    except SystemExit:
        return "refused", printed.getvalue().strip().splitlines()[-1]
    except ValueError as error:  # ConfigError is one
        return "refused", str(error)
    return "accepted", ""


OTHER = {"accepted": "refused", "refused": "accepted"}
CLAIMS = re.compile(r"as in Megatron|Megatron(-LM)? (refuses|asks)")
"""What a refusal says of Megatron-LM that a case Megatron-LM accepts belies."""


@pytest.mark.parametrize("name", sorted(CASES["cases"]))
def test_refused_as_megatron_refuses(name):
    case = CASES["cases"][name]
    verdict, error = mp_verdict(case["command_line"], case["world_size"])
    kind = DIFFERENCES.get(name, (None,))[0]
    want = OTHER[case["verdict"]] if kind else case["verdict"]
    assert verdict == want, (case, error)
    if kind in (EARLIER, STRICTER, LIMITATION):
        assert case["verdict"] == "accepted"
    elif kind == EXTENSION:
        assert case["verdict"] == "refused"
    if verdict == "refused":
        assert "\n" not in error.strip(), error
        if kind in (STRICTER, LIMITATION):  # Megatron-LM runs it
            assert not CLAIMS.search(error), error


def test_every_difference_is_a_case():
    assert set(DIFFERENCES) <= set(CASES["cases"])


# field -> (when it may differ: of the case's flags and mp's config, why);
# docs/migrating-from-megatron.md
DERIVED_DIFFERENCES = {
    "eval_interval": (lambda flags, config: "--eval-interval" not in flags,
                      "mp's default is 1000, Megatron-LM's before 0.19; 0.19's is none "
                      "(Defaults that differ)"),
    "fp8_recipe": (lambda flags, config: "--fp8-recipe" not in flags,
                   "mp's default is tensorwise, Megatron-LM's delayed (Transformer Engine's, "
                   "refused by mp; Defaults that differ)"),
    "split": (lambda flags, config: "--data-path" not in flags,
              "without --data-path Megatron-LM leaves --split unset (mock data splits evenly, "
              "in mp too); with one it takes the legacy '969, 30, 1', mp's default"),
    "use_distributed_optimizer": (lambda flags, config: config.optimizer.use_megatron_fsdp,
                                  "Megatron-LM sets it under Megatron-FSDP, whose code runs "
                                  "through its distributed optimizer's; mp's FSDP shards the "
                                  "optimizer state itself and leaves the field as given"),
}  # fmt: skip


PARTS = ("model", "parallel", "gpt", "optimizer", "training", "checkpoint", "data", "logging")
"""The parts of mp's RunConfig, in the order a field's name is looked for."""


def mp_derived(config, validated: dict, name: str):
    """mp's value of a field of Megatron-LM's `derived` record."""
    if name in validated:  # data_parallel_size, global_batch_size, num_microbatches
        return validated[name]
    model, optimizer = config.model, config.optimizer
    if name == "add_qkv_bias":  # Megatron-LM's is on whenever add_bias_linear is
        return model.add_bias_linear or model.add_qkv_bias
    if name == "recompute_modules":
        return model.recompute_modules or ["core_attn"]
    if name == "accumulate_allreduce_grads_in_fp32":  # as Megatron-LM derives it for bf16
        return optimizer.grad_reduce_in_fp32
    if name in ("start_weight_decay", "end_weight_decay"):  # weight_decay when unset
        return optimizer.start_wd if name == "start_weight_decay" else optimizer.end_wd
    training = config.training
    if name == "eval_global_batch_size":  # the training's when unset
        return training.eval_global_batch_size or validated["global_batch_size"]
    if name == "eval_micro_batch_size":
        return training.eval_micro_batch_size or training.micro_batch_size
    if name == "embedding_init_method_std":  # Megatron-LM's is init_method_std when unset
        return model.embedding_init_std
    if name == "experimental_attention_variant":  # mp's name for Megatron-LM's variant
        variant = model.experimental_attention_variant
        return "gated_delta_net" if variant == "gdn" else variant
    for part in PARTS:
        if hasattr(getattr(config, part), name):
            value = getattr(getattr(config, part), name)
            return list(value) if isinstance(value, tuple) else value
    raise AssertionError(f"no field {name} in mp's RunConfig")


ACCEPTED = sorted(
    name
    for name, case in CASES["cases"].items()
    if case["verdict"] == "accepted" and name not in DIFFERENCES
)
"""The cases both accept (an EXTENSION is one Megatron-LM refuses)."""


@pytest.mark.parametrize("name", ACCEPTED)
def test_an_accepted_command_line_comes_to_megatrons_settings(name):
    """What a command line both accept comes to: the model's fields, the layout, the batch,
    the schedule, the optimizer's and the checkpoint's settings as Megatron-LM derives them
    (its `derived` record)."""
    case = CASES["cases"][name]
    with contextlib.redirect_stderr(io.StringIO()):
        config = parse_config(case["command_line"].split())
    validated = validate(config, case["world_size"])
    differ = {}
    for field, want in zip(CASES["derived"], case["derived"], strict=True):
        got = mp_derived(config, validated, field)
        if got is False and want is None:  # a switch Megatron-LM's parser leaves at None
            continue
        allowed = DERIVED_DIFFERENCES.get(field)
        if got != want and not (allowed and allowed[0](case["flags"].split(), config)):
            differ[field] = (got, want)
    assert not differ, differ
