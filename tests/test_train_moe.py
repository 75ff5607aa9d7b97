"""Mixture of experts end to end: apps/gpt's tiny-moe config (4 experts, top-2, the
load-balancing and z-losses on; fp32, dropout 0) trains with the one-rank loss curve,
auxiliary losses, gradient norms and consumed samples at EP2 (all-to-all and all-gather
dispatch), EP2 x TP2 with sequence parallelism (expert TP 1 and 2), EP2 x DP2 (also with
the distributed optimizer), EP2 x PP2, EP2 x CP2, EP2 x CP2 x PP2 x DP2 in Megatron's
--use-tp-pp-dp-mapping order and EP2 with every layer recomputed in backward.
One rank runs the global batch as micro-batches of one sequence, as each data-parallel
rank does. gpt-oss's MLP (biases everywhere) trains the same at EP2 x TP2 x expert-TP2, and
Sinkhorn routing and two load-balancing losses at once at EP2."""

import pytest

from mp_gpt.testing import (
    LOGGED_MOE,
    assert_same_curve,
    metrics_records,
    tiny_moe_options,
    train_on_rank,
)
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

ITERATIONS = 4

EP2 = ["--expert-model-parallel-size", "2"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
LAYOUTS = {
    "ep2": (2, EP2),
    "ep2-allgather": (2, [*EP2, "--moe-token-dispatcher-type", "allgather"]),
    "ep2-tp2-etp1": (4, [*EP2, *TP2, "--expert-tensor-parallel-size", "1"]),
    "ep2-tp2-etp2": (4, [*EP2, *TP2]),
    "ep2-dp2": (4, EP2),
    "ep2-dp2-distopt": (4, [*EP2, "--use-distributed-optimizer"]),
    "ep2-pp2": (4, [*EP2, "--pipeline-model-parallel-size", "2"]),
    "ep2-cp2": (4, [*EP2, "--context-parallel-size", "2"]),
    # Megatron's other rank order (its dp_last MoE functional test): pipeline stages on
    # neighbouring ranks, replicas 4 apart, each CP pair the EP pair of the experts.
    "ep2-cp2-pp2-dp2-tp-pp-dp-mapping": (
        8,
        [
            *EP2,
            "--context-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--use-tp-pp-dp-mapping",
        ],
    ),
    "ep2-recompute": (
        2,
        [
            *EP2,
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
        ],
    ),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one-rank")
    run_on_ranks(train_on_rank, 1, tiny_moe_options(run_dir), timeout=300)
    return metrics_records(run_dir)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_layouts_train_as_one_rank(tmp_path, reference, name):
    world, layout = LAYOUTS[name]
    run_on_ranks(train_on_rank, world, tiny_moe_options(tmp_path, *layout), timeout=300)
    got = metrics_records(tmp_path)
    assert len(reference) == ITERATIONS
    assert_same_curve(got, reference, LOGGED_MOE, name)


GPT_OSS = ["--activation", "gelu", "--quick-geglu", "--glu-linear-offset", "1",
           "--activation-func-clamp-value", "7", "--add-bias-linear"]  # fmt: skip


def test_gpt_oss_mlp_trains_as_one_rank_at_ep2_tp2_etp2(tmp_path):
    """gpt-oss's MLP (the clamped quick GEGLU, router and expert biases, attention biases)
    at EP2 x TP2 with expert TP 2 and the distributed optimizer: the one-rank curve, the
    gradient norm counting the fc2 biases held whole on both expert-TP ranks once."""
    run_on_ranks(train_on_rank, 1, tiny_moe_options(tmp_path / "one", *GPT_OSS), timeout=300)
    reference = metrics_records(tmp_path / "one")
    layout = [*GPT_OSS, *EP2, *TP2, "--use-distributed-optimizer"]
    run_on_ranks(train_on_rank, 4, tiny_moe_options(tmp_path / "four", *layout), timeout=300)
    got = metrics_records(tmp_path / "four")
    assert len(reference) == ITERATIONS
    assert_same_curve(got, reference, LOGGED_MOE, "gpt-oss ep2-tp2-etp2")


def curves_at(tmp_path, flags: list[str], *layouts: tuple[int, list[str]]) -> list[list[dict]]:
    """The metrics records of tiny-moe with `flags` on one rank, then at each (ranks,
    layout flags) of `layouts`."""
    curves = []
    for ranks, layout in ((1, []), *layouts):
        options = tiny_moe_options(tmp_path / f"ranks{ranks}", *flags, *layout)
        run_on_ranks(train_on_rank, ranks, options, timeout=300)
        curves.append(metrics_records(tmp_path / f"ranks{ranks}"))
    assert len(curves[0]) == ITERATIONS
    return curves


SINKHORN = ["--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "0",
            "--moe-router-topk", "1"]  # fmt: skip


def test_sinkhorn_routing_trains_as_one_rank_at_ep2(tmp_path):
    """S-BASE routing (top-1, Megatron-LM's GPT-3 MoE functional tests): each router call
    balances its own micro-batch's tokens, one sequence on one rank as on each of two, so
    EP2 has the one-rank curve."""
    curves = curves_at(tmp_path, SINKHORN, (2, EP2))
    assert_same_curve(curves[1], curves[0], ("lm loss", "grad_norm"), "sinkhorn ep2")


TWO_LOSSES = ["--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss",
              "--moe-aux-loss-coeff", "0.01", "0.001"]  # fmt: skip


def test_two_balancing_losses_train_as_one_rank_at_ep2(tmp_path):
    """Megatron's lists of load-balancing types and coefficients: the micro-batch's loss
    and the per-sequence one, each with its coefficient and logged apart; EP2 has the
    one-rank curve of both."""
    curves = curves_at(tmp_path, TWO_LOSSES, (2, EP2))
    assert all(r["seq_load_balancing_loss"] > 0 for r in curves[0])
    logged = (*LOGGED_MOE, "seq_load_balancing_loss")
    assert_same_curve(curves[1], curves[0], logged, "two losses ep2")


QUANTILE = ["--moe-router-load-balancing-type", "quantile_balancing", "--moe-aux-loss-coeff", "0",
            "--moe-router-quantile-balancing-ema", "0.5"]  # fmt: skip


def test_quantile_balancing_trains_as_one_rank_at_ep2_and_tp2(tmp_path):
    """Megatron-LM's quantile balancing: each step's bias from the micro-batches' column
    quantiles (over the tensor-parallel ranks' tokens gathered, then averaged over the
    data-parallel ranks) routes the next step; one sequence per micro-batch on one rank as
    on each of two, so EP2 and EP2 x TP2 (sequence parallelism) have the one-rank curve."""
    curves = curves_at(tmp_path, QUANTILE, (2, EP2), (4, [*EP2, *TP2]))
    for got, name in zip(curves[1:], ("ep2", "ep2-tp2"), strict=True):
        assert_same_curve(got, curves[0], ("lm loss", "z_loss", "grad_norm"), name)
    # the bias routes: from the second step on, the plain top-k's curve is another
    plain = tiny_moe_options(tmp_path / "plain", "--moe-aux-loss-coeff", "0")
    run_on_ranks(train_on_rank, 1, plain, timeout=300)
    top_k = metrics_records(tmp_path / "plain")
    assert top_k[0]["lm loss"] == curves[0][0]["lm loss"]
    later = zip(top_k[2:], curves[0][2:], strict=True)
    assert all(abs(a["lm loss"] - b["lm loss"]) > 1e-6 for a, b in later)
