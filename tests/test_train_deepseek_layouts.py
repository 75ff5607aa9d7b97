"""The tiny DeepSeek-V3 (apps/gpt/configs/tiny-deepseek-v3.yaml: MLA with a query latent
and YaRN, a dense and a MoE layer with sigmoid group-limited routing, the expert bias and
a shared expert, one MTP module) trains through pretrain_gpt to the one-rank curve at
every layout (CP2 with p2p and a2a; TP2+SP and ZeRO-3 at DP2 with Megatron's fine-grained
recompute; MLA's all_gather is checked layer by layer in test_mla_layouts.py of mp-layers):
the language model's loss, the MTP module's and the per-sequence balancing loss, every
iteration of 8, within 1e-5 relative (fp32, no dropout, mock data); and from a checkpoint
saved at PP2 and resumed at TP2. The MTP loss reaches TensorBoard under Megatron's tag,
`mtp_1 loss`, every iteration."""

from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mp_gpt.config_files import config_path
from mp_gpt.testing import GIVEN_PEAK, assert_same_curve, metrics_records, train_on_rank
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

ITERATIONS = 8
KEYS = ("lm loss", "mtp_1 loss", "seq_load_balancing_loss")


def options(run_dir: Path, *layout: str) -> list[str]:
    return [
        "--config", str(config_path("tiny-deepseek-v3.yaml")), "--mock-data", *GIVEN_PEAK,
        "--seq-length", "64", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--train-iters", str(ITERATIONS), "--lr-warmup-iters", "2", "--eval-interval", "none",
        "--save", "none", "--load", "none", "--tensorboard-dir", "none",
        "--metrics-file", str(run_dir / "metrics.jsonl"), *layout,
    ]  # fmt: skip


LAYOUTS = {
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "ep2": (2, ["--expert-model-parallel-size", "2"]),
    "ep2-tp2": (4, ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                    "--sequence-parallel"]),
    "cp2-p2p": (2, ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
    "cp2-a2a": (2, ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]),
    "dp2-distopt": (2, ["--use-distributed-optimizer"]),
    # Megatron's fine-grained recompute of DeepSeek-V3 (outputs discarded and rebuilt)
    "tp2-sp-recompute-modules": (2, [
        "--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj",
        "layernorm", "moe_act", "shared_experts"]),
    # Megatron-LM's DeepSeek-V3 line under its FSDP (examples/megatron_fsdp)
    "dp2-zero3-recompute-modules": (2, [
        "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
        "--recompute-granularity", "selective", "--recompute-modules", "mlp", "moe",
        "mla_up_proj", "layernorm"]),
}  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one-rank")
    board = ["--tensorboard-dir", str(run_dir / "tb")]
    run_on_ranks(train_on_rank, 1, options(run_dir, *board), timeout=300)
    records = metrics_records(run_dir)
    assert len(records) == ITERATIONS
    for key in ("lm loss", "mtp_1 loss"):  # both learn
        assert records[-1][key] < records[0][key] - 0.3, (key, records[0], records[-1])
    # TensorBoard: Megatron's tag, every iteration (as the MoE losses), the logged values.
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    written = [(e.step, e.value) for e in events.Scalars("mtp_1 loss")]
    assert written == [(r["iteration"], np.float32(r["mtp_1 loss"])) for r in records]
    return records


@pytest.mark.parametrize("name", LAYOUTS)
def test_same_lm_and_mtp_curves(tmp_path, reference, name):
    ranks, layout = LAYOUTS[name]
    run_on_ranks(train_on_rank, ranks, options(tmp_path, *layout), timeout=300)
    assert_same_curve(metrics_records(tmp_path), reference, KEYS, name)


def test_checkpoint_at_pp2_resumes_at_tp2_on_the_same_curve(tmp_path, reference):
    """The MTP module, the last stage's embedding copy and the expert biases are saved at
    PP2 and resharded to TP2 with sequence parallelism: the curve goes on unchanged."""
    checkpoint = ["--save", str(tmp_path / "ck"), "--load", str(tmp_path / "ck"),
                  "--save-interval", "4"]  # fmt: skip
    first, second = tmp_path / "pp2", tmp_path / "tp2"
    first.mkdir(), second.mkdir()
    pp2 = [*checkpoint, "--pipeline-model-parallel-size", "2", "--exit-interval", "4"]
    run_on_ranks(train_on_rank, 2, options(first, *pp2), timeout=300)
    tp2 = [*checkpoint, "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    run_on_ranks(train_on_rank, 2, options(second, *tp2), timeout=300)
    records = metrics_records(first) + metrics_records(second)
    assert_same_curve(records, reference, KEYS, "pp2 then tp2")


def test_one_module_repeated_at_two_depths_trains_alike_at_tp2(tmp_path):
    """--mtp-use-repeated-layer with --mtp-num-layers 2: one module makes both depths'
    predictions; both depths' losses follow the one-rank curve at TP2 with sequence
    parallelism."""
    repeated = ["--mtp-num-layers", "2", "--mtp-use-repeated-layer", "--train-iters", "4"]
    curves = {}
    for name, ranks, layout in (("one", 1, []), ("tp2", 2, LAYOUTS["tp2-sp"][1])):
        run_on_ranks(train_on_rank, ranks, options(tmp_path / name, *repeated, *layout),
                     timeout=300)  # fmt: skip
        curves[name] = metrics_records(tmp_path / name)
    assert len(curves["one"]) == 4
    assert_same_curve(curves["tp2"], curves["one"], (*KEYS, "mtp_2 loss"), "repeated tp2")


def test_detached_heads_train_alike_at_pp2_with_their_own_grad_norm(tmp_path):
    """--mtp-detach-heads: the MTP module (on the last of two pipeline stages) trains on
    its loss alone and is clipped by its own gradient norm, which both stages compute
    together: the language model's loss, the module's and both norms follow the one-rank
    curve; the logged grad norm leaves the module out."""
    detached = ["--mtp-detach-heads", "--train-iters", "4"]
    curves = {}
    for name, ranks, layout in (("one", 1, []), ("pp2", 2, LAYOUTS["pp2"][1]),
                                ("attached", 1, ["--no-mtp-detach-heads"])):  # fmt: skip
        run_on_ranks(train_on_rank, ranks, options(tmp_path / name, *detached, *layout),
                     timeout=300)  # fmt: skip
        curves[name] = metrics_records(tmp_path / name)
    one, attached = curves["one"], curves["attached"]
    assert len(one) == 4 and all(r["mtp_grad_norm"] > 0 for r in one)
    assert "mtp_grad_norm" not in attached[0]
    assert_same_curve(curves["pp2"], one, (*KEYS, "grad_norm", "mtp_grad_norm"), "detached pp2")
    # the first step's language-model loss is the same; the updates then differ
    assert one[0]["lm loss"] == attached[0]["lm loss"]
    assert one[-1]["lm loss"] != attached[-1]["lm loss"]
    assert one[0]["grad_norm"] < attached[0]["grad_norm"]
