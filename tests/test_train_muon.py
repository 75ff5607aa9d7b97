"""Muon through the loop (--optimizer muon): with the Newton-Schulz iterations in fp32
(--muon-fp32-matmul-prec high) the tiny model trains to the one-rank curve at DP2 under
the distributed optimizer (Megatron's layer-wise one: whole parameters per rank), at
TP2+SP in the duplicated and distributed modes (also with one query group shared by both
ranks) and at PP2, and the tiny MoE at EP2 and
TP2 x ETP2. The layer-wise state is split over the ranks, and its checkpoint resumes on
the one-rank curve and loads at another layout; Megatron-LM's own Muon functional-test
line trains."""

import pytest
import torch

from mp_gpt.testing import (
    GIVEN_PEAK,
    assert_same_curve,
    metrics_records,
    tiny_moe_options,
    tiny_options,
    train_on_rank,
    train_run_on_rank,
)
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

MUON = ["--optimizer", "muon", "--muon-fp32-matmul-prec", "high", "--train-iters", "6"]
KEYS = ("lm loss", "grad_norm")
DISTOPT = ["--use-distributed-optimizer"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
DENSE = {
    "dp2-distopt": DISTOPT,
    "tp2-duplicated": TP2,
    "tp2-distributed": [*TP2, "--muon-tp-mode", "distributed"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> list[dict]:
    run_dir = tmp_path_factory.mktemp("one")
    run_on_ranks(train_on_rank, 1, tiny_options(run_dir, *MUON), timeout=300)
    records = metrics_records(run_dir)
    assert records[-1]["lm loss"] < records[0]["lm loss"] - 0.3  # it learns
    return records


@pytest.mark.parametrize("layout", DENSE)
def test_dense_layouts_train_to_the_one_rank_curve(tmp_path, one_rank, layout):
    run_on_ranks(train_on_rank, 2, tiny_options(tmp_path, *MUON, *DENSE[layout]), timeout=300)
    assert_same_curve(metrics_records(tmp_path), one_rank, KEYS, layout)


def test_a_query_group_shared_by_two_ranks_orthogonalizes_as_one_rank(tmp_path):
    """One query group at TP2 (each rank half the group's query heads and key and value
    rows): --muon-split-qkv's q, k and v parts, gathered over TP in the distributed mode,
    are the one-rank parts, and the curve is the one-rank curve."""
    one_group = [*MUON, "--num-query-groups", "1"]
    run_on_ranks(train_on_rank, 1, tiny_options(tmp_path / "one", *one_group), timeout=300)
    layout = [*one_group, *TP2, "--muon-tp-mode", "distributed"]
    run_on_ranks(train_on_rank, 2, tiny_options(tmp_path / "tp2", *layout), timeout=300)
    want = metrics_records(tmp_path / "one")
    assert_same_curve(metrics_records(tmp_path / "tp2"), want, KEYS, "tp2 one group")


MOE = {"ep2-distopt": ["--expert-model-parallel-size", "2", *DISTOPT],
       "tp2-etp2": [*TP2, "--expert-tensor-parallel-size", "2"]}  # fmt: skip


def test_moe_layouts_train_to_the_one_rank_curve(tmp_path):
    run_on_ranks(train_on_rank, 1, tiny_moe_options(tmp_path / "one", *MUON), timeout=300)
    want = metrics_records(tmp_path / "one")
    for name, layout in MOE.items():
        options = tiny_moe_options(tmp_path / name, *MUON, *layout)
        run_on_ranks(train_on_rank, 2, options, timeout=300)
        assert_same_curve(metrics_records(tmp_path / name), want, ("lm loss",), name)


def state_on_rank(argv: list[str]) -> dict:
    """What this rank's optimizer holds after the run: the state tensors' elements by
    name, and the main parameters' elements."""
    optimizer = train_run_on_rank(argv).optimizer
    held: dict[str, int] = {}
    for state in optimizer.optimizer.state.values():
        for name, tensor in state.items():
            if tensor.dim():
                held[name] = held.get(name, 0) + tensor.numel()
    held["main"] = sum(s.main_param.numel() for s in optimizer._all_shards())
    return held


def test_layer_wise_state_is_split_and_resumes_on_the_curve(tmp_path):
    decay = [*MUON, "--lr-decay-iters", "8"]  # one schedule for the 6 and 8 iterations
    longer = tmp_path / "longer"
    (plain,) = run_on_ranks(state_on_rank, 1, tiny_options(longer, *decay, "--train-iters", "8"),
                            timeout=300)  # fmt: skip
    want = metrics_records(longer)
    # Muon's momentum on the matrices, Adam's moments on the rest (embedding, norms)
    assert plain["momentum_buffer"] > 0 and plain["exp_avg"] == plain["exp_avg_sq"] > 0
    assert plain["momentum_buffer"] + plain["exp_avg"] == plain["main"]
    ckpt = ["--save", str(tmp_path / "ck"), "--load", str(tmp_path / "ck"),
            "--save-interval", "3"]  # fmt: skip
    halves = tmp_path / "halves"
    first = tiny_options(halves, *decay, *DISTOPT, *ckpt, "--exit-interval", "3")
    ranks = run_on_ranks(state_on_rank, 2, first, timeout=300)
    for name in ("momentum_buffer", "exp_avg", "main"):  # each parameter on one rank
        assert sum(r[name] for r in ranks) == plain[name], name
    for name in ("momentum_buffer", "main"):  # about half on each (by whole parameters)
        assert max(r[name] for r in ranks) < 0.6 * plain[name], name
    run_on_ranks(train_on_rank, 2, tiny_options(halves, *decay, *DISTOPT, *ckpt), timeout=300)
    resumed = metrics_records(halves)
    assert [r["iteration"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    # iterations 4 to 6 resumed from the layer-wise checkpoint: on the one-rank curve
    assert_same_curve(resumed, want[:6], KEYS, "dp2-distopt resumed")
    # the checkpoint of iteration 6 at TP2 (each rank's Muon state from the owners')
    more = tmp_path / "tp2"
    options = tiny_options(more, *decay, *TP2, "--load", str(tmp_path / "ck"),
                           "--train-iters", "8", "--override-opt-param-scheduler")  # fmt: skip
    run_on_ranks(train_on_rank, 2, options, timeout=300)
    assert_same_curve(metrics_records(more), want[6:], KEYS, "tp2 loaded")


# Megatron-LM's tests/functional_tests/test_cases/moe/
# gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_muon/model_config.yaml, as written but for
# the data (mock), the output paths, the model's size (2 layers of 64, 4 experts of 64)
# and the run (3 iterations of 4 sequences of 64 tokens at EP2 on two CPU ranks); its
# --transformer-impl transformer_engine is dropped and --distributed-backend is gloo on a
# CPU (both need CUDA)
MEGATRON_MUON_TEST = """
--num-layers 2 --hidden-size 64 --num-attention-heads 8 --log-params-norm
--log-num-zeros-in-grad --log-validation-ppl-to-tensorboard --log-timers-to-tensorboard
--micro-batch-size 2 --global-batch-size 4 --seq-length 64 --max-position-embeddings 64
--disable-bias-linear --train-iters 3 --timing-log-level 0 --lr-decay-iters 320000
--split 949,50,1 --distributed-backend nccl --lr 0.00015 --lr-decay-style cosine
--min-lr 1.0e-5 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction .01
--log-interval 1 --save-interval 50 --eval-interval 1000 --eval-iters 10
--transformer-impl transformer_engine --tensor-model-parallel-size 1
--pipeline-model-parallel-size 1 --expert-model-parallel-size 2 --num-experts 4
--moe-token-dispatcher-type allgather --moe-router-load-balancing-type aux_loss
--moe-router-topk 2 --moe-router-dtype fp32 --moe-ffn-hidden-size 64 --moe-grouped-gemm
--ckpt-fully-parallel-load --deterministic-mode --no-gradient-accumulation-fusion
--attention-softmax-in-fp32 --use-checkpoint-opt_param-scheduler --use-mcore-models
--ckpt-format torch_dist --bf16 --no-bias-gelu-fusion --log-memory-to-tensorboard
--optimizer muon --muon-momentum 0.9 --muon-extra-scale-factor 0.2
--muon-scale-mode spectral --async-save --use-persistent-ckpt-worker
--use-distributed-optimizer --no-use-layer-wise-param-layout
"""


def test_megatrons_muon_functional_test_line_trains(tmp_path):
    line = MEGATRON_MUON_TEST.replace("--transformer-impl transformer_engine", "")
    line = line.replace("--distributed-backend nccl", "--distributed-backend gloo")
    argv = [*line.split(), "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "1000", "--metrics-file", str(tmp_path / "metrics.jsonl"),
            "--save", "none", "--load", "none", "--tensorboard-dir", "none",
            "--num-workers", "0", *GIVEN_PEAK]  # fmt: skip
    assert run_on_ranks(train_on_rank, 2, argv, timeout=300) == [0, 0]
    records = metrics_records(tmp_path)
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(r["lm loss"])) for r in records)
