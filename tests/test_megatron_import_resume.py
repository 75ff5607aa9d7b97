"""A run resumes in mp from a Megatron-LM checkpoint imported with --with-optimizer: after
loading, its iteration, consumed samples, learning rate, Adam step and Adam moments are
the ones megatron-core saved, and its next step on Megatron's next batch gives Megatron's
weights and moments after that step (packages/mp-ckpt/tests/assets/megatron/*/reference.pt),
for a Llama-style model, a hybrid (Mamba) one, a DeepSeek-shaped one with multi-token
prediction and a Qwen3-Next-shaped one (gated DeltaNet and gated attention layers); a
run with --optimizer muon from a Megatron run trained with Muon (its momentum buffers);
and a muP run (--use-mup: the hidden matrices' own learning rate and Adam eps)."""

import re
from pathlib import Path

import pytest
import torch

from mp_ckpt import CheckpointReader, import_megatron, safe_load
from mp_gpt.testing import GIVEN_PEAK, TINY_CONFIG, train_run_on_rank
from mp_state.testing import run_on_ranks

ASSETS = Path(__file__).resolve().parents[1] / "packages/mp-ckpt/tests/assets/megatron"


def _argv(load: Path, case: str = "") -> list[str]:
    """A run that loads `load` and takes no step (it is at iteration 2 of 2), with the
    fixtures' optimizer settings and sequence length (their max_position_embeddings, which
    --use-checkpoint-args takes). The fixture's vocabulary: 100 ids padded
    to 128 (to 256 at Megatron's TP4: 64 x 4); the DeepSeek-shaped ones' 60 padded to 64."""
    vocab = ("60", "32") if case.startswith("mla") else ("100", "64")
    if case.endswith("_tp4"):
        vocab = ("100", "256")
    return [
        "--config", str(TINY_CONFIG), "--mock-data", *GIVEN_PEAK,
        "--tokenizer-type", "NullTokenizer",
        "--vocab-size", vocab[0], "--make-vocab-size-divisible-by", vocab[1],
        "--load", str(load), "--use-checkpoint-args", "--use-checkpoint-opt-param-scheduler",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--train-iters", "2",
        "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "0", "--weight-decay", "0.01",
        "--clip-grad", "1.0", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--adam-eps", "1e-8",
        "--save", "none", "--tensorboard-dir", "none", "--num-workers", "0",
        "--eval-interval", "none", "--log-interval", "100",
    ]  # fmt: skip


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
@pytest.mark.parametrize("case", ["llama_torch_dist_tp2_distopt", "llama_torch_tp2",
                                  "llama_torch_tp4",
                                  "llama_torch_pp2_dp2_distopt", "moe_torch_ep2",
                                  "hybrid_torch_tp2_dp2_distopt", "hybrid_optim_torch_dist_tp2",
                                  "mla_mtp_optim_torch_tp2",
                                  "qwen3_next_optim_torch_tp2"])  # fmt: skip
def test_a_run_resumes_with_megatrons_adam_state(case, tmp_path):
    reference = safe_load(ASSETS / case / "reference.pt")
    load = tmp_path / "mp"
    import_megatron(ASSETS / case, load, with_optimizer=True)
    got = run_on_ranks(body, 1, _argv(load, case), str(load), timeout=180)[0]
    assert got["iteration"] == 2
    # the model the args describe (the hybrid's layer 3 is MoE)
    assert (got["expert_params"] > 0) == case.startswith(("moe", "hybrid", "mla", "qwen3"))
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
    if case.startswith("mla"):  # multi-latent attention: no fused qkv
        return
    layer = 1 if case.startswith(("hybrid", "qwen3")) else 0  # (their attention layer)
    qkv = f"optimizer.exp_avg.decoder.layers.{layer}.self_attention.linear_qkv.k.weight"
    fused = reference["adam"][f"decoder.layers.{layer}.self_attention.linear_qkv.weight"]
    heads = 6 if case.startswith("qwen3") else 4  # per group q q (gate gate) k v
    torch.testing.assert_close(got["state"][qkv], fused["exp_avg"].view(2, heads, 8, 32)[:, -2],
                               rtol=0, atol=0)  # fmt: skip


def step_body(argv, load, data):
    """The run loaded from `load` takes one training step on `data` (Megatron's fixed
    batch, all tokens counted) as its training loop would (with the factors its MoE
    routers' and MTP modules' losses get in backward, and the expert biases' update):
    its weights and Adam state by logical key afterwards, the lr it used, its loss and
    gradient norm."""
    return _one_step(train_run_on_rank(argv), data)


def _one_step(run, data):
    """step_body's step of the loaded run."""
    from mp_gpt.gpt import forward_step
    from mp_pipeline import get_forward_backward_func
    from mp_train.loop.moe_step import MoEStep

    item = {**data, "loss_mask": torch.ones(data["tokens"].shape)}
    for chunk in run.model:
        chunk.train()
    experts = MoEStep(run.config.model, run.model, run.state, fp16=False)
    run.optimizer.zero_grad()
    experts.before(run.optimizer, num_microbatches=1)
    lr = run.optimizer.param_groups[0]["lr"]
    schedule = get_forward_backward_func(run.state.pp.size, None)
    reports = schedule(
        forward_step_func=forward_step, data_iterator=iter([item]), model=run.model,
        num_microbatches=1, config=run.pipeline, pp_group=run.state.pp,
    )  # fmt: skip
    experts.after_backward()
    result = run.optimizer.step()
    total, tokens = reports[0]["lm loss"].tolist()
    weights = {k: t.data.clone() for k, t in run.model[0].sharded_state_dict().items()}
    state = {k: t.data.clone() for k, t in run.optimizer.sharded_state_dict()["state"].items()}
    return {"weights": weights, "state": state, "lr": lr, "loss": total / tokens,
            "grad_norm": result.grad_norm}  # fmt: skip


_MAMBA = {"in_proj.weight": ("in_proj", {"z": 64, "x": 64, "B": 16, "C": 16, "dt": 8}),
          "conv1d_weight": ("conv1d", {"x": 64, "B": 16, "C": 16})}  # fmt: skip
"""The hybrid fixtures' Mamba mixers' fused tensors: the rows of each part (2 groups)."""
_GDN = {"self_attention.in_proj.weight": {"query": 16, "key": 16, "value": 32, "z": 32,
                                          "beta": 4, "alpha": 4},
        "self_attention.conv1d.weight": {"query": 16, "key": 16, "value": 32}}  # fmt: skip
"""The Qwen3-Next-shaped fixtures' gated DeltaNet's fused tensors: each part's rows (2 key
heads)."""


def _logical(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A Megatron TP1 tensor of the Llama or hybrid fixtures as mp's logical tensors (qkv:
    rows per query group [q q k v] x head dim 8; SwiGLU fc1: [gate; up]; a Mamba mixer's
    in_proj and conv1d: each part by group, [2, rows / 2, ...])."""
    if name == "decoder.final_norm.weight":
        return {"decoder.final_layernorm.weight": tensor}
    name = name.replace(".mtp_model_layer.", ".transformer_layer.")  # an MTP module's layer
    expert = re.match(r"(.+\.mlp\.experts\.)local_experts\.(\d+)\.(.+)$", name)
    if expert:  # mp stacks the experts: [experts, ...] (a SwiGLU fc1 split as below)
        within = _logical(f"{expert.group(1)}{expert.group(3)}", tensor)
        return {f"{key}[{expert.group(2)}]": value for key, value in within.items()}
    for fused, rows in _GDN.items():
        if name.endswith("." + fused):
            base = name.removesuffix(".weight")
            pieces = tensor.reshape(tensor.shape[0], -1).split(list(rows.values()))
            return {f"{base}.{p}.weight": piece.reshape(2, -1, piece.shape[-1])
                    for p, piece in zip(rows, pieces, strict=True)}  # fmt: skip
    for fused, (module, rows) in _MAMBA.items():
        if name.endswith(".mixer." + fused):
            base = name.removesuffix(fused) + module
            pieces = tensor.reshape(tensor.shape[0], -1).split(list(rows.values()))
            return {f"{base}.{p}.weight": piece.reshape(2, -1, piece.shape[-1])
                    for p, piece in zip(rows, pieces, strict=True)}  # fmt: skip
    base, part = name.rsplit(".", 1)
    if base.endswith("linear_qkv") and tensor.shape[0] == 96:  # with the output gate
        groups = tensor.view(2, 6, 8, -1)
        return {f"{base}.q.{part}": groups[:, :2], f"{base}.gate.{part}": groups[:, 2:4],
                f"{base}.k.{part}": groups[:, 4], f"{base}.v.{part}": groups[:, 5]}  # fmt: skip
    if base.endswith("linear_qkv"):
        groups = tensor.view(2, 4, 8, -1)
        return {f"{base}.q.{part}": groups[:, :2], f"{base}.k.{part}": groups[:, 2],
                f"{base}.v.{part}": groups[:, 3]}  # fmt: skip
    if base.endswith("linear_fc1"):
        gate, up = tensor.chunk(2)
        return {f"{base}.gate.{part}": gate, f"{base}.up.{part}": up}
    return {name: tensor}


_TOLERANCES = {"qwen3": (1e-7, 5e-8, 5e-9)}
INDEXER_RTOL = 1e-5
"""The sparse-attention indexers' tensors, whose gradients come from their loss alone (of
weight 0.01: moments up to 2e-5 and 7e-10, far under the other tolerances), are compared
within this share of each tensor's largest value where that is tighter (measured: within
1e-6 of it, weights and both moments)."""
"""(weights, exp_avg, exp_avg_sq) tolerances where not the test's default (its docstring)."""


@pytest.mark.multirank
@pytest.mark.parametrize("case", ["llama_torch_dist_tp2_distopt",
                                  "hybrid_torch_dist_tp2_dp2_distopt",
                                  "mla_mtp_torch_dist_tp1_distopt",
                                  "mla_two_losses_torch_dist_tp1_distopt",
                                  "mla_dsa_torch_dist_tp1_distopt",
                                  "qwen3_next_torch_dist_tp2_dp2_distopt"])  # fmt: skip
def test_the_step_after_resuming_is_megatrons(case, tmp_path):
    """One more step in mp from the imported checkpoint, on the batch Megatron took its
    third step on, gives Megatron's weights and Adam moments after that step.

    Tolerance: mp's forward and backward are not Megatron's kernel for kernel (imported
    logits agree within 1e-7), so the gradients differ by float32 rounding (measured: the
    gradient norm, 1.55 before clipping to 1.0, by 2.3e-7). Through Adam that moves the
    weights and exp_avg by at most 3.7e-9 and exp_avg_sq by 2.5e-10 (measured), while the
    step itself moves them by up to 9e-4, 8e-3 and 3e-4: compared within atol 5e-8, 5e-8
    and 2e-9, over 10x the measured error and far below what a step that ignored the
    loaded moments or step count would miss by. The hybrid (a Mamba, an attention, an MLP
    and a MoE layer; the distributed optimizer's buckets at TP2 x DP2): gradient norm 3.50
    within 1.5e-8 relative, the same loss, weights within 3.0e-8, exp_avg 3.8e-9,
    exp_avg_sq 1.8e-10 (measured), for steps of 9e-4, 9e-3 and 4e-4. The DeepSeek-shaped
    one (multi-latent attention, DeepSeek's MoE, an MTP module; TP1): gradient norm within
    1.2e-7 relative, weights 3.0e-8, exp_avg 2.8e-9, exp_avg_sq 2.1e-10 (measured); with
    two load-balancing losses (aux_loss 0.01 beside seq_aux_loss 0.001, Megatron's lists),
    the same tolerances hold; and with DeepSeek's sparse attention (each layer's indexer
    choosing 6 of 16 positions, trained by its loss of weight 0.01: the indexer's weights
    and moments after the step are megatron-core's too). The
    Qwen3-Next-shaped one (a gated DeltaNet layer, gated attention; the distributed
    optimizer at TP2 x DP2), whose DeltaNet megatron-core computes position by position
    (the fixtures' stand-in) and mp in chunks: the same loss, gradient norm 5.29 within
    8.9e-8 relative, weights within 4.5e-8 (1.5 units in the last place of its weights of
    up to 0.27), exp_avg 1.1e-8, exp_avg_sq 1.5e-9 (measured): compared within 1e-7, 5e-8
    and 5e-9, 2-4x over them and 1/9000 of the step.
    """
    reference = safe_load(ASSETS / case / "reference.pt")
    step = reference["next_step"]
    load = tmp_path / "mp"
    import_megatron(ASSETS / case, load, with_optimizer=True)
    data = {k: step[k] for k in ("tokens", "labels", "position_ids")}
    got = run_on_ranks(step_body, 1, _argv(load, case), str(load), data, timeout=180)[0]
    assert got["lr"] == step["lr"]
    assert got["loss"] == pytest.approx(step["loss"], rel=1e-6)
    assert got["grad_norm"] == pytest.approx(step["grad_norm"], rel=1e-5)
    compared = 0
    family = case.split("_")[0]
    tolerances = _TOLERANCES.get(family, (5e-8, 5e-8, 2e-9))
    for name, recorded in step["adam"].items():
        before = reference["adam"][name]
        for (state, key), atol in zip((("param", ""), ("exp_avg", "optimizer.exp_avg."),
                                       ("exp_avg_sq", "optimizer.exp_avg_sq.")), tolerances,
                                      strict=True):  # fmt: skip
            held = got["weights"] if state == "param" else got["state"]
            for logical, expected in _logical(name, recorded[state]).items():
                # the step moved every tensor: an unchanged one would not prove the update
                assert not torch.equal(expected, _logical(name, before[state])[logical])
                stacked = re.match(r"(.+)\[(\d+)\]$", logical)  # one expert of a stack
                value = (held[key + stacked.group(1)][int(stacked.group(2))] if stacked
                         else held[key + logical])  # fmt: skip
                if ".indexer." in logical:  # moments of 1e-5 and 1e-10: relative to them
                    atol = min(atol, INDEXER_RTOL * float(expected.abs().max()))
                torch.testing.assert_close(value, expected, rtol=0, atol=atol,
                                           msg=f"{state} {logical}")  # fmt: skip
                compared += 1
    tensors = {"llama": 10, "hybrid": 17, "mla": 15, "qwen3": 29}[family]
    # (the two-loss and sparse-attention fixtures, written after record.py tracked layer 1's
    # q_layernorm, record it too; the sparse-attention one two indexer tensors besides)
    newer = "two_losses" in case or "dsa" in case
    assert compared == 3 * (tensors + newer + 2 * ("dsa" in case))


_MUON = ["--optimizer", "muon", "--muon-tp-mode", "duplicated", "--muon-fp32-matmul-prec", "high"]
"""llama_muon_torch_dist_tp2's Muon settings (its cases.py's MUON: Megatron's defaults but
the whole matrix orthogonalized at TP2, in fp32)."""
_MUON_TOLERANCES = {"param": 5e-8, "momentum_buffer": 5e-9, "exp_avg": 5e-8, "exp_avg_sq": 2e-9}


@pytest.mark.multirank
def test_the_step_after_resuming_megatrons_muon_run_is_megatrons(tmp_path):
    """A run with --optimizer muon loads the import of a Megatron-LM run trained with Muon
    (the Llama model at TP2: momentum buffers for the matrices, Adam's moments for the
    embedding, the output layer and the norms), and its next step on the batch Megatron
    took its third step on gives Megatron's weights, momentum buffers and moments.

    Measured: the same loss, the gradient norm (1.55) within 1e-7 relative, weights within
    2.0e-8, momentum buffers 1.2e-9, exp_avg 2.8e-9, exp_avg_sq 2.6e-10, for steps of at
    least 2.2e-3 (Muon's weights), 2.3e-4 (momentum), 9e-4 (Adam's weights), 1e-4 and 5e-8:
    a step from a momentum buffer or moments not loaded would miss by about the step."""
    case = "llama_muon_torch_dist_tp2"
    reference = safe_load(ASSETS / case / "reference.pt")
    step = reference["next_step"]
    load = tmp_path / "mp"
    import_megatron(ASSETS / case, load, with_optimizer=True)
    data = {k: step[k] for k in ("tokens", "labels", "position_ids")}
    argv = [*_argv(load, case), *_MUON]
    got = run_on_ranks(step_body, 1, argv, str(load), data, timeout=180)[0]
    assert got["lr"] == step["lr"]
    assert got["loss"] == pytest.approx(step["loss"], rel=1e-6)
    assert got["grad_norm"] == pytest.approx(step["grad_norm"], rel=1e-5)
    compared = 0
    for kind, states in (("muon", ("param", "momentum_buffer")),
                         ("adam", ("param", "exp_avg", "exp_avg_sq"))):  # fmt: skip
        for name, recorded in step[kind].items():
            for state in states:
                held = got["weights"] if state == "param" else got["state"]
                key = "" if state == "param" else f"optimizer.{state}."
                before = _logical(name, reference[kind][name][state])
                for logical, expected in _logical(name, recorded[state]).items():
                    assert not torch.equal(expected, before[logical])  # the step moved it
                    torch.testing.assert_close(held[key + logical], expected, rtol=0,
                                               atol=_MUON_TOLERANCES[state],
                                               msg=f"{state} {logical}")  # fmt: skip
                    compared += 1
    assert compared == 2 * 10 + 3 * 3  # qkv as q, k, v and fc1 as gate, up
    assert not any(k.startswith("optimizer.exp_avg.") and ".linear_" in k for k in got["state"])


@pytest.mark.multirank
def test_the_step_after_resuming_megatrons_mup_run_is_megatrons(tmp_path):
    """The import of a Megatron-LM run trained with muP (the Llama model at TP2, hidden 32
    over a base of 16: width multiplier 2) resumes with Megatron's three parameter groups
    (the norms; the embedding and output layer at lr 1e-3 and eps 1e-8; the hidden
    matrices at 5e-4 and 5e-9), and its next step gives Megatron's weights and moments.

    Measured: the same loss, the gradient norm (0.96) within 5e-9 relative, weights within
    3.0e-8, exp_avg 2.3e-9, exp_avg_sq 1.3e-10, for steps of at least 4.6e-4, 1.4e-4 and
    9e-8; a hidden matrix stepped at the base lr would move twice as far (Adam's step is
    proportional to the lr), and an optimizer without muP's groups refuses the checkpoint
    (3 groups saved, 2 built)."""
    case = "llama_mup_torch_tp2"
    reference = safe_load(ASSETS / case / "reference.pt")
    step = reference["next_step"]
    load = tmp_path / "mp"
    import_megatron(ASSETS / case, load, with_optimizer=True)
    got = run_on_ranks(mup_body, 1, _argv(load, case), str(load),
                       {k: step[k] for k in ("tokens", "labels", "position_ids")},
                       timeout=180)[0]  # fmt: skip
    saved = {(g["wd_mult"], g["max_lr"]): g for g in reference["param_groups"]}
    assert got["groups"] == [
        (0.0, False, saved[0.0, 1e-3]["max_lr"], saved[0.0, 1e-3]["eps"]),
        (1.0, False, saved[1.0, 1e-3]["max_lr"], saved[1.0, 1e-3]["eps"]),
        (1.0, True, saved[1.0, 5e-4]["max_lr"], saved[1.0, 5e-4]["eps"]),
    ]
    assert got["mup_width_mult"] == reference["mup"]["width_mult"] == 2.0
    step_got = got["step"]
    assert step_got["lr"] == step["lr"]
    assert step_got["loss"] == pytest.approx(step["loss"], rel=1e-6)
    assert step_got["grad_norm"] == pytest.approx(step["grad_norm"], rel=1e-5)
    compared = 0
    for name, recorded in step["adam"].items():
        for (state, key), atol in zip((("param", ""), ("exp_avg", "optimizer.exp_avg."),
                                       ("exp_avg_sq", "optimizer.exp_avg_sq.")),
                                      (5e-8, 5e-8, 2e-9), strict=True):  # fmt: skip
            held = step_got["weights"] if state == "param" else step_got["state"]
            before = _logical(name, reference["adam"][name][state])
            for logical, expected in _logical(name, recorded[state]).items():
                assert not torch.equal(expected, before[logical])  # the step moved it
                torch.testing.assert_close(held[key + logical], expected, rtol=0, atol=atol,
                                           msg=f"{state} {logical}")  # fmt: skip
                compared += 1
    assert compared == 3 * 13  # 8 tracked tensors: each qkv as q, k, v, fc1 as gate, up


def mup_body(argv, load, data):
    """step_body's step, and the loaded optimizer's groups (wd_mult, muP, max_lr, eps)."""
    run = train_run_on_rank(argv)
    groups = [(g["wd_mult"], bool(g.get("mup")), g.get("max_lr", run.scheduler.max_lr),
               g["eps"]) for g in run.optimizer.param_groups]  # fmt: skip
    return {"groups": groups, "mup_width_mult": run.config.model.mup_width_mult,
            "step": _one_step(run, data)}  # fmt: skip
