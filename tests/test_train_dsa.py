"""The tiny DeepSeek-V3.2 (apps/gpt/configs/tiny-deepseek-v32.yaml: tiny-deepseek-v3's
model with DeepSeek's sparse attention, each layer's lightning indexer trained by its KL
loss) trains through pretrain_gpt (fp32, mock data, 64 positions, initialized at std 0.1:
at 0.02 the attention and the indexer both start near uniform and the divergence is a
few 1e-6, all rounding):

- choosing 16 positions on one rank, the language model's loss and the indexer's fall,
  the curve is not the dense one, and the indexer loss reaches TensorBoard under
  Megatron's tag, `indexer loss`, every iteration;
- with every position chosen (dsa_indexer_topk 64), TP2 with sequence parallelism, PP2
  and CP2 follow the one-rank curves (lm loss, MTP loss, indexer loss, every iteration, within
  1e-5 relative), and so does a run saved at PP2 and resumed at TP2. The layouts are
  compared there because a choice of 16 is discrete: scores that tie within rounding,
  which differs between layouts, choose differently and the curves part (seen at TP2 on
  the third iteration). The layer's choice itself is checked against transformers' in
  packages/mp-layers/tests/test_sparse_attention.py.

A layer that reuses another's choice trains alike with full and selective recompute.
Megatron-LM's DSA functional-test line, shrunk, trains at its TP2 x PP2 with sequence
parallelism in bf16."""

from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mp_gpt.config_files import config_path
from mp_gpt.testing import GIVEN_PEAK, assert_same_curve, metrics_records, train_on_rank
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

ITERATIONS = 8
KEYS = ("lm loss", "mtp_1 loss", "indexer loss")
DENSE = ("--dsa-indexer-topk", "64")


def options(run_dir: Path, *layout: str) -> list[str]:
    return [
        "--config", str(config_path("tiny-deepseek-v32.yaml")), "--mock-data", *GIVEN_PEAK,
        "--seq-length", "64", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--train-iters", str(ITERATIONS), "--lr-warmup-iters", "2", "--eval-interval", "none",
        "--save", "none", "--load", "none", "--tensorboard-dir", "none",
        "--init-method-std", "0.1", "--metrics-file", str(run_dir / "metrics.jsonl"), *layout,
    ]  # fmt: skip


LAYOUTS = {
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "cp2": (2, ["--context-parallel-size", "2"]),
}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("dense")
    run_on_ranks(train_on_rank, 1, options(run_dir, *DENSE), timeout=300)
    records = metrics_records(run_dir)
    assert len(records) == ITERATIONS
    return records


def test_sparse_attention_trains_the_model_and_its_indexer(tmp_path, dense):
    board = ["--tensorboard-dir", str(tmp_path / "tb")]
    run_on_ranks(train_on_rank, 1, options(tmp_path, *board), timeout=300)
    records = metrics_records(tmp_path)
    assert len(records) == ITERATIONS
    assert records[-1]["lm loss"] < records[0]["lm loss"] - 0.3, (records[0], records[-1])
    first, last = records[0]["indexer loss"], records[-1]["indexer loss"]
    assert 0 < last < 0.9 * first, (first, last)  # it learns where the attention looks
    gaps = [abs(r["lm loss"] - d["lm loss"]) for r, d in zip(records, dense, strict=True)]
    assert max(gaps) > 1e-3, gaps  # 16 of 64 positions: not the dense attention
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    written = [(e.step, e.value) for e in events.Scalars("indexer loss")]
    assert written == [(r["iteration"], np.float32(r["indexer loss"])) for r in records]


@pytest.mark.parametrize("name", LAYOUTS)
def test_layouts_follow_the_one_rank_curves(tmp_path, dense, name):
    ranks, layout = LAYOUTS[name]
    run_on_ranks(train_on_rank, ranks, options(tmp_path, *DENSE, *layout), timeout=300)
    assert_same_curve(metrics_records(tmp_path), dense, KEYS, name)


def test_checkpoint_at_pp2_resumes_at_tp2_on_the_same_curve(tmp_path, dense):
    """The indexers are saved at PP2 under Megatron's names and resharded to TP2 with
    sequence parallelism: the curves go on unchanged."""
    checkpoint = ["--save", str(tmp_path / "ck"), "--load", str(tmp_path / "ck"),
                  "--save-interval", "4"]  # fmt: skip
    first, second = tmp_path / "pp2", tmp_path / "tp2"
    first.mkdir(), second.mkdir()
    pp2 = [*DENSE, *checkpoint, "--pipeline-model-parallel-size", "2", "--exit-interval", "4"]
    run_on_ranks(train_on_rank, 2, options(first, *pp2), timeout=300)
    tp2 = [*DENSE, *checkpoint, *LAYOUTS["tp2-sp"][1]]
    run_on_ranks(train_on_rank, 2, options(second, *tp2), timeout=300)
    assert_same_curve(metrics_records(first) + metrics_records(second), dense, KEYS,
                      "pp2 then tp2")  # fmt: skip


# Megatron-LM's tests/functional_tests/test_cases/gpt/gpt3_mcore_te_tp2_pp2_dsa/
# model_config.yaml, as written but for the data (mock), the output paths, the model's
# size (4 layers of 64, 8 heads; the indexer's 64 heads of 128 channels choosing 2048 of
# 1024 positions become 4 of 16 choosing 32 of 64) and the run (3 iterations of 4
# sequences of 64 tokens at its TP2 x PP2 on four CPU ranks); its --transformer-impl
# transformer_engine is dropped and --distributed-backend is gloo on a CPU
MEGATRON_DSA_TEST = """
--num-layers 4 --hidden-size 64 --num-attention-heads 8 --multi-latent-attention
--q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16
--experimental-attention-variant dsa --disable-bias-linear --dsa-indexer-n-heads 4
--dsa-indexer-head-dim 16 --dsa-indexer-topk 32 --dsa-indexer-loss-coeff 0.01
--attention-backend fused --log-params-norm --log-num-zeros-in-grad
--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --micro-batch-size 2
--global-batch-size 4 --seq-length 64 --max-position-embeddings 64 --train-iters 3
--timing-log-level 0 --lr-decay-iters 320000 --split 949,50,1 --distributed-backend nccl
--lr 0.00015 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --clip-grad 1.0
--lr-warmup-fraction .01 --log-interval 1 --save-interval 25 --eval-interval 1000
--eval-iters 10 --transformer-impl transformer_engine --tensor-model-parallel-size 2
--pipeline-model-parallel-size 2 --sequence-parallel --untie-embeddings-and-output-weights
--deterministic-mode --no-gradient-accumulation-fusion --attention-softmax-in-fp32
--use-mcore-models --ckpt-format torch_dist --bf16 --log-memory-to-tensorboard
"""


def test_megatrons_dsa_functional_test_line_trains(tmp_path):
    line = MEGATRON_DSA_TEST.replace("--transformer-impl transformer_engine", "")
    line = line.replace("--distributed-backend nccl", "--distributed-backend gloo")
    argv = [*line.split(), "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "1000", "--metrics-file", str(tmp_path / "metrics.jsonl"),
            "--save", "none", "--load", "none", "--tensorboard-dir", "none",
            "--num-workers", "0", *GIVEN_PEAK]  # fmt: skip
    assert run_on_ranks(train_on_rank, 4, argv, timeout=300) == [0] * 4
    records = metrics_records(tmp_path)
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert all(np.isfinite(r["lm loss"]) and r["indexer loss"] > 0 for r in records)


def test_shared_choices_train_alike_with_the_layers_recomputed(tmp_path):
    """Layer 2 reuses layer 1's choice (--dsa-indexer-topk-freq 2, offset 1; the MTP module
    left out, its layer choosing for itself: test_sparse_attention.py): with every layer
    recomputed in backward (the choice carried by the micro-batch's Rotary, so that the
    recomputed layer 2 reuses its own micro-batch's; the indexer loss logged once, not
    again by the recompute), and with Megatron's selective modules (the attention, MLA's
    up projections and the norms), the curves are those of the run that keeps its
    activations."""
    shared = ["--dsa-indexer-topk-freq", "2", "--dsa-indexer-skip-topk-offset", "1",
              "--mtp-num-layers", "none", "--global-batch-size", "8"]  # fmt: skip
    full = ["--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "1"]  # fmt: skip
    selective = ["--recompute-granularity", "selective", "--recompute-modules", "core_attn",
                 "mla_up_proj", "layernorm"]  # fmt: skip
    curves = {}
    for name, extra in (("kept", []), ("full", full), ("selective", selective)):
        run_on_ranks(train_on_rank, 1, options(tmp_path / name, *shared, *extra), timeout=300)
        curves[name] = metrics_records(tmp_path / name)
    assert len(curves["kept"]) == ITERATIONS
    for name in ("full", "selective"):
        assert_same_curve(curves[name], curves["kept"], ("lm loss", "indexer loss"), name)
