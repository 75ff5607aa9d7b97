"""A run resumes in mp from a Megatron-LM checkpoint imported with --with-optimizer: after
loading, its iteration, consumed samples, learning rate, Adam step and Adam moments are
the ones megatron-core saved (packages/mp-ckpt/tests/assets/megatron/*/reference.pt)."""

from pathlib import Path

import pytest
import torch

from mp_ckpt import CheckpointReader, import_megatron, safe_load
from mp_gpt.testing import TINY_CONFIG, train_run_on_rank
from mp_state.testing import run_on_ranks

ASSETS = Path(__file__).resolve().parents[1] / "packages/mp-ckpt/tests/assets/megatron"


def body(argv, load):
    """The run loaded from `load`, at the imported iteration (no step taken): its
    optimizer state per key, and its counters."""
    run = train_run_on_rank(argv)
    optimizer = run.optimizer
    state = {k: p.data.clone() for k, p in optimizer.sharded_state_dict()["state"].items()}
    named = dict(run.model[0].module.named_parameters())
    main = optimizer.shards[named["output_layer.weight"]][0].main_param
    moments = {k: optimizer.optimizer.state[main][k].clone() for k in ("exp_avg", "exp_avg_sq")}
    return {
        "state": state,
        "output_layer": {**moments, "step": optimizer.optimizer.state[main]["step"].clone()},
        "expert_params": sum(".mlp.experts." in n for n in named),
        "iteration": run.train.iteration,
        "consumed": run.train.consumed_train_samples,
        "lrs": [g["lr"] for g in optimizer.param_groups],
        "weight_decays": [g["weight_decay"] for g in optimizer.param_groups],
    }


@pytest.mark.multirank
@pytest.mark.parametrize(
    "case", ["llama_torch_dist_tp2_distopt", "llama_torch_tp2", "moe_torch_ep2"]
)
def test_a_run_resumes_with_megatrons_adam_state(case, tmp_path):
    reference = safe_load(ASSETS / case / "reference.pt")
    load = tmp_path / "mp"
    import_megatron(ASSETS / case, load, with_optimizer=True)
    # The fixture's vocabulary: 100 ids (+ NullTokenizer's eod) padded to 128.
    argv = [
        "--config", str(TINY_CONFIG), "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "100", "--make-vocab-size-divisible-by", "64",
        "--load", str(load), "--use-checkpoint-args", "--use-checkpoint-opt-param-scheduler",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2",
        "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "0", "--weight-decay", "0.01",
        "--save", "none", "--tensorboard-dir", "none", "--num-workers", "0",
        "--eval-interval", "none", "--log-interval", "100",
    ]  # fmt: skip
    got = run_on_ranks(body, 1, argv, str(load), timeout=180)[0]
    assert got["iteration"] == 2
    assert (got["expert_params"] > 0) == case.startswith("moe")  # the model the args describe
    assert got["consumed"] == 2 * reference["args"]["global_batch_size"]
    for lr in got["lrs"]:
        assert lr == pytest.approx(reference["lr_next"], rel=1e-6)
    assert got["weight_decays"] == [0.0, 0.01]
    recorded = reference["adam"]["output_layer.weight"]
    for name in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(got["output_layer"][name], recorded[name], rtol=0, atol=0)
    assert float(got["output_layer"]["step"]) == reference["optimizer_step"]
    # Every state tensor the run holds is the imported one (qkv and fc1 pieces included).
    reader = CheckpointReader(load)
    assert got["state"] and all(k.startswith("optimizer.exp_avg") for k in got["state"])
    for key, value in got["state"].items():
        torch.testing.assert_close(value, reader.read(key), rtol=0, atol=0, msg=key)
    qkv = "optimizer.exp_avg.decoder.layers.0.self_attention.linear_qkv.k.weight"
    fused = reference["adam"]["decoder.layers.0.self_attention.linear_qkv.weight"]["exp_avg"]
    torch.testing.assert_close(got["state"][qkv], fused.view(2, 4, 8, 32)[:, 2], rtol=0, atol=0)
