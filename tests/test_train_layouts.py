"""The tiny config trains to the same loss curve at every layout, end to end.

apps/gpt/configs/tiny.yaml (mock data, a shorter sequence and batch so that
eight ranks fit two cores) for 10 iterations at TP1 PP1 DP1, DP2, TP2, PP2
and TP2 x PP2 x DP2, and PP2 x DP2 with the distributed optimizer (the tied
embedding's two copies on two stages, each sharded over dp): every iteration's
loss within 1e-4 relative (fp32). The same global model at every layout comes
from the init seed (weights drawn per layer) and a vocabulary padded alike at
TP 1 and 2.
"""

import json
from pathlib import Path

import pytest

from mp_gpt.testing import GIVEN_PEAK, TINY_CONFIG, train_on_rank
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

ITERATIONS = 10


def options(run_dir: Path, tp: int, pp: int, *extra: str) -> list[str]:
    return [
        "--config", str(TINY_CONFIG), "--mock-data", *GIVEN_PEAK,
        "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "1000", "--make-vocab-size-divisible-by", "512",
        "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", str(ITERATIONS), "--eval-interval", "none", "--log-interval", "10",
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--save", "none", "--load", "none", "--tensorboard-dir", "none",
        "--metrics-file", str(run_dir / "metrics.jsonl"), "--num-workers", "0",
        "--lr-warmup-iters", "2", *extra,
    ]  # fmt: skip


def losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["lm loss"] for line in lines]


LAYOUTS = [(1, 1, 2), (2, 1, 1), (1, 2, 1), (2, 2, 2)]
DISTRIBUTED = ["--use-distributed-optimizer"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tp1pp1dp1")
    run_on_ranks(train_on_rank, 1, options(run_dir, 1, 1), timeout=300)
    curve = losses(run_dir)
    assert len(curve) == ITERATIONS and curve[-1] < curve[0] - 0.5  # it learns
    return curve


RUNS = [(*layout, []) for layout in LAYOUTS] + [(1, 2, 2, DISTRIBUTED)]


@pytest.mark.parametrize(
    "tp,pp,dp,extra", RUNS,
    ids=[f"tp{t}-pp{p}-dp{d}{'-distopt' if e else ''}" for t, p, d, e in RUNS],
)  # fmt: skip
def test_same_loss_curve(tmp_path, reference, tp, pp, dp, extra):
    run_on_ranks(train_on_rank, tp * pp * dp, options(tmp_path, tp, pp, *extra), timeout=300)
    curve = losses(tmp_path)
    assert len(curve) == ITERATIONS
    for iteration, (got, want) in enumerate(zip(curve, reference, strict=True), start=1):
        assert abs(got - want) <= 1e-4 * abs(want), f"iteration {iteration}: {got} vs {want}"


def test_interleaved_groups_of_all_micro_batches_train_alike(tmp_path, reference):
    """PP2 with two virtual stages per rank, the 4 micro-batches of an iteration in one
    group per chunk (--microbatch-group-size-per-virtual-pipeline-stage 4, Megatron's;
    the default groups 2): the one-rank curve."""
    flags = [*options(tmp_path, 1, 2), "--num-layers-per-virtual-pipeline-stage", "1",
             "--microbatch-group-size-per-virtual-pipeline-stage", "4"]  # fmt: skip
    run_on_ranks(train_on_rank, 2, flags, timeout=300)
    curve = losses(tmp_path)
    assert len(curve) == ITERATIONS
    for iteration, (got, want) in enumerate(zip(curve, reference, strict=True), start=1):
        assert abs(got - want) <= 1e-4 * abs(want), f"iteration {iteration}: {got} vs {want}"


def test_megatrons_tp_pp_dp_mapping_trains_alike(tmp_path, reference):
    """--use-tp-pp-dp-mapping (Megatron's order tp-cp-ep-pp-dp: pipeline stages on
    neighbouring ranks, replicas far apart) at PP2 x DP2 gives the one-rank curve."""
    flags = [*options(tmp_path, 1, 2), "--use-tp-pp-dp-mapping"]
    run_on_ranks(train_on_rank, 4, flags, timeout=300)
    curve = losses(tmp_path)
    assert len(curve) == ITERATIONS
    for iteration, (got, want) in enumerate(zip(curve, reference, strict=True), start=1):
        assert abs(got - want) <= 1e-4 * abs(want), f"iteration {iteration}: {got} vs {want}"


def test_one_query_group_shared_by_two_ranks_trains_alike(tmp_path):
    """One query group (key/value head) at TP2 with sequence parallelism: each rank computes
    half the query heads and half the key and value rows, then gathers the rest of the
    group's keys and values; the one-rank curve of the same model."""
    one_group = ["--num-query-groups", "1", "--train-iters", "4"]
    curves = []
    for tp, extra in ((1, []), (2, ["--sequence-parallel"])):
        run_dir = tmp_path / f"tp{tp}"
        run_on_ranks(train_on_rank, tp, options(run_dir, tp, 1, *one_group, *extra), timeout=300)
        curves.append(losses(run_dir))
    assert len(curves[0]) == 4 and curves[0][-1] < curves[0][0] - 0.1, curves[0]
    for iteration, (got, want) in enumerate(zip(*reversed(curves), strict=True), start=1):
        assert abs(got - want) <= 1e-4 * abs(want), f"iteration {iteration}: {got} vs {want}"


def train_counting_overlapped_exchanges(argv: list[str]) -> tuple[int, int]:
    """train_on_rank, and how many exchanges the schedule left in flight while it computed
    (those it hands to mp_pipeline's InFlight: none unless overlap_p2p_comm is on)."""
    from mp_pipeline.p2p import InFlight

    add, posted = InFlight.add, []

    def counting_add(self, exchange, **kwargs):
        posted.append(not exchange.done)
        return add(self, exchange, **kwargs)

    InFlight.add = counting_add
    return train_on_rank(argv), sum(posted)


def test_interleaved_exchanges_overlapped_or_waited_train_the_same_curve(tmp_path, reference):
    """PP2 with two virtual stages per rank, each exchange waited for as it is posted
    (--no-overlap-p2p-communication) or all of them overlapped with compute, warm-up and
    flush included (--overlap-p2p-communication-warmup-flush): the same losses to the
    last bit, the one-rank curve's within 1e-4."""
    curves, overlapped = {}, {}
    for name in ("--no-overlap-p2p-communication", "--overlap-p2p-communication-warmup-flush"):
        run_dir = tmp_path / name.strip("-")
        flags = [*options(run_dir, 1, 2), "--num-layers-per-virtual-pipeline-stage", "1", name]
        ranks = run_on_ranks(train_counting_overlapped_exchanges, 2, flags, timeout=300)
        curves[name], overlapped[name] = losses(run_dir), [count for _, count in ranks]
    waited, flushed = curves.values()
    assert waited == flushed and len(waited) == ITERATIONS
    for iteration, (got, want) in enumerate(zip(waited, reference, strict=True), start=1):
        assert abs(got - want) <= 1e-4 * abs(want), f"iteration {iteration}: {got} vs {want}"
    assert overlapped["--no-overlap-p2p-communication"] == [0, 0]
    assert min(overlapped["--overlap-p2p-communication-warmup-flush"]) > 0, overlapped
