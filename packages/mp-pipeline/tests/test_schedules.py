"""1F1B and interleaved 1F1B equal no pipelining on a stack of linear layers.

The interleaved schedule also runs its micro-batches in groups other than the pipeline
size (microbatch_group_size_per_vp_stage), with numbers of micro-batches that are not a
multiple of it.

Eight tanh(Linear) layers of width H, boundary tensors [S, B, H], an MSE loss
on the last stage. The same global weights are cut into pipeline stages (and
virtual stages); each layout's losses and gradients must equal
forward_backward_no_pipelining over the same micro-batches (fp32, 1e-5).
"""

import contextlib
import dataclasses

import pytest
import torch
import torch.distributed as dist

import mp_state
from mp_pipeline import (
    Exchange,
    P2PCommunicator,
    PipelineConfig,
    forward_backward_no_pipelining,
    get_forward_backward_func,
    schedule_table,
    stage_layers,
)
from mp_pipeline.testing import TanhStack
from mp_state import ParallelConfig, RankGroup
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

LAYERS, S, B, H = 8, 4, 2, 6


def stack(offset: int, count: int, first: bool) -> TanhStack:
    """Layers offset .. offset + count - 1 of the whole stack."""
    torch.manual_seed(0)
    whole = [torch.nn.Linear(H, H) for _ in range(LAYERS)]
    return TanhStack(whole[offset : offset + count], first)


def micro_batches(m: int):
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(S, B, H, generator=generator), torch.randn(S, B, H, generator=generator))
            for _ in range(m)]  # fmt: skip


def forward_step(data_iterator, model):
    x, y = next(data_iterator)

    def loss_func(output):
        loss = torch.nn.functional.mse_loss(output, y)
        return loss, {"loss": loss.detach()}

    return model(x), loss_func


# The interleaved schedule's exchanges: waited for as posted, overlapped in the steady
# state (overlap_p2p_comm), and in the warm-up and flush too
OVERLAP = {
    None: {},
    "overlap": {"overlap_p2p_comm": True},
    "flush": {"overlap_p2p_comm": True, "overlap_p2p_comm_warmup_flush": True},
}


def config(group: int | None = None, **settings) -> PipelineConfig:
    return PipelineConfig(seq_length=S, micro_batch_size=B, hidden_size=H,
                          microbatch_group_size_per_vp_stage=group, **settings)  # fmt: skip


def reference(m: int, forward_only: bool = False):
    model = stack(0, LAYERS, True)
    losses = forward_backward_no_pipelining(
        forward_step_func=forward_step, data_iterator=iter(micro_batches(m)), model=model,
        num_microbatches=m, config=config(), forward_only=forward_only,
    )  # fmt: skip
    grads = {} if forward_only else {
        (i, name): p.grad.clone() for i, layer in enumerate(model.layers)
        for name, p in layer.named_parameters()
    }  # fmt: skip
    return [r["loss"] for r in losses], grads


def pipeline_body(pp: int, vpp: int | None, m: int, forward_only: bool, group: int | None = None,
                  settings: dict | None = None, step=forward_step):  # fmt: skip
    torch.set_num_threads(1)
    state = mp_state.initialize(ParallelConfig(pipeline_model_parallel_size=pp))
    chunks, offsets = [], []
    for vp_stage in range(vpp or 1):
        where = stage_layers(
            LAYERS, pp, state.pp.rank, virtual_pipeline_model_parallel_size=vpp, vp_stage=vp_stage
        )
        chunks.append(stack(where.offset, where.count, where.pre_process))
        offsets.append(where.offset)
    iterators = [iter(micro_batches(m)) for _ in chunks]
    schedule = get_forward_backward_func(pp, vpp)
    losses = schedule(
        forward_step_func=step, data_iterator=iterators if vpp else iterators[0],
        model=chunks if vpp else chunks[0], num_microbatches=m,
        config=config(group, **settings or {}), pp_group=state.pp, forward_only=forward_only,
    )  # fmt: skip
    grads = {}
    if not forward_only:
        for chunk, offset in zip(chunks, offsets, strict=True):
            for i, layer in enumerate(chunk.layers):
                for name, p in layer.named_parameters():
                    grads[(offset + i, name)] = p.grad.clone()
    mp_state.destroy()
    dist.barrier()
    return [r["loss"] for r in losses], grads


LAYOUTS = [(2, None, 4), (4, None, 4), (4, None, 8), (4, None, 2), (2, 2, 4), (2, 2, 2),
           (2, 4, 4), (4, 2, 8)]  # fmt: skip
# (pp, vpp, m, microbatch_group_size_per_vp_stage): groups larger than p, a last group
# shorter than the others, m not a multiple of p, one group of all m
GROUPED = [(2, 2, 5, 3), (2, 2, 6, 4), (2, 2, 3, 3), (4, 2, 6, 6), (2, 4, 7, 4)]


@pytest.mark.parametrize("pp,vpp,m", LAYOUTS, ids=[f"pp{p}-vpp{v}-m{m}" for p, v, m in LAYOUTS])
def test_pipelining_equals_no_pipelining(pp, vpp, m):
    assert_equals_no_pipelining(pp, vpp, m)


@pytest.mark.parametrize("pp,vpp,m,group", GROUPED,
                         ids=[f"pp{p}-vpp{v}-m{m}-g{g}" for p, v, m, g in GROUPED])  # fmt: skip
def test_interleaved_groups_of_other_sizes_equal_no_pipelining(pp, vpp, m, group):
    assert_equals_no_pipelining(pp, vpp, m, group)


def assert_equals_no_pipelining(pp: int, vpp: int | None, m: int, group: int | None = None,
                                settings: dict | None = None):  # fmt: skip
    want_losses, want_grads = reference(m)
    results = run_on_ranks(pipeline_body, pp, pp, vpp, m, False, group, settings, timeout=120)
    got_grads = {}
    for _, grads in results:
        got_grads.update(grads)
    assert set(got_grads) == set(want_grads)
    for key, want in want_grads.items():
        torch.testing.assert_close(got_grads[key], want, rtol=1e-5, atol=1e-7, msg=str(key))
    torch.testing.assert_close(results[-1][0], want_losses, rtol=1e-5, atol=1e-7)
    assert all(losses == [] for losses, _ in results[:-1])  # losses on the last stage only


@pytest.mark.parametrize("pp,vpp,m,group", [(2, None, 4, None), (4, None, 2, None),
                                            (2, 2, 4, None), (2, 2, 5, 3)])  # fmt: skip
def test_forward_only_gives_the_same_losses(pp, vpp, m, group):
    want_losses, _ = reference(m, forward_only=True)
    results = run_on_ranks(pipeline_body, pp, pp, vpp, m, True, group, timeout=120)
    torch.testing.assert_close(results[-1][0], want_losses, rtol=1e-5, atol=1e-7)


# (pp, vpp, m, group): a steady state on every rank, every micro-batch in the warm-up of
# rank 0, four stages, a short last group, four chunks
OVERLAPPED = [(2, 2, 4, None), (2, 2, 2, None), (4, 2, 8, None), (2, 2, 5, 3), (2, 4, 7, 4)]


@pytest.mark.parametrize("mode", ["overlap", "flush"])
@pytest.mark.parametrize("pp,vpp,m,group", OVERLAPPED,
                         ids=[f"pp{p}-vpp{v}-m{m}-g{g}" for p, v, m, g in OVERLAPPED])  # fmt: skip
def test_overlapped_exchanges_equal_no_pipelining(pp, vpp, m, group, mode):
    assert_equals_no_pipelining(pp, vpp, m, group, OVERLAP[mode])


@pytest.mark.parametrize("pp,vpp,m,group", [(2, 2, 4, None), (4, 2, 6, 6)])
def test_overlapped_forward_only_gives_the_same_losses(pp, vpp, m, group):
    want_losses, _ = reference(m, forward_only=True)
    results = run_on_ranks(pipeline_body, pp, pp, vpp, m, True, group, OVERLAP["flush"],
                           timeout=120)  # fmt: skip
    torch.testing.assert_close(results[-1][0], want_losses, rtol=1e-5, atol=1e-7)


def test_overlapped_exchanges_of_variable_shapes_equal_no_pipelining():
    """Each exchange first sends its tensors' shapes (waited for), then the tensors."""
    settings = {**OVERLAP["flush"], "variable_seq_lengths": True}
    assert_equals_no_pipelining(2, 2, 4, None, settings)


def timeline_body(pp: int, vpp: int, m: int) -> dict:
    """Per overlap mode, this rank's events in order: "F" a forward step, "B" a chunk's
    backward reaching its last layer's weights, ("post", n) and ("wait", n) exchange n
    posted and waited for (an exchange with nothing to send or receive is not posted)."""
    post, wait = P2PCommunicator.post, Exchange.wait
    events: list = []

    def logged_post(self, **kwargs):
        exchange = post(self, **kwargs)
        if not exchange.done:
            exchange.number = len(events)
            events.append(("post", exchange.number))
        return exchange

    def logged_wait(self):
        if not self.done:
            events.append(("wait", self.number))
        return wait(self)

    def step(data_iterator, model):
        events.append("F")
        if not getattr(model, "logged", False):
            model.layers[-1].weight.register_hook(lambda grad: events.append("B"))
            model.logged = True
        return forward_step(data_iterator, model)

    P2PCommunicator.post, Exchange.wait = logged_post, logged_wait
    timelines = {}
    for mode, settings in OVERLAP.items():
        events.clear()
        pipeline_body(pp, vpp, m, False, None, settings, step)
        timelines[mode] = list(events)
    return timelines


def spans(events: list) -> list[str]:
    """Per exchange, the computation ("F", "B") that ran between its post and its wait."""
    opened, between = {}, []
    for i, event in enumerate(events):
        if event[0] == "post":
            opened[event[1]] = i
        elif event[0] == "wait":
            between.append("".join(e for e in events[opened.pop(event[1]) : i] if e in ("F", "B")))
    assert not opened, "an exchange posted was never waited for"
    return between


def test_overlapped_exchanges_travel_while_the_other_steps_compute():
    """Waited for as posted, no exchange spans a computation. Under overlap_p2p_comm,
    on every rank, a forward's exchange is in flight during a backward and a backward's
    during a forward. With the warm-up and flush overlapped too, more exchanges span a
    computation before the first backward, and after the last forward."""
    for rank, timelines in enumerate(run_on_ranks(timeline_body, 2, 2, 2, 4, timeout=120)):
        assert [s for s in spans(timelines[None]) if s] == [], rank
        overlapped = spans(timelines["overlap"])
        assert any(s.startswith("B") for s in overlapped), (rank, overlapped)
        assert any(s.startswith("F") for s in overlapped), (rank, overlapped)
        for mode in ("overlap", "flush"):
            assert timelines[mode].count("F") == timelines[mode].count("B") == 8
        warm_ups = {mode: _spans_in_warm_up_and_flush(timelines[mode]) for mode in OVERLAP}
        assert warm_ups["flush"] > warm_ups["overlap"] >= warm_ups[None] == 0, (rank, warm_ups)


def _spans_in_warm_up_and_flush(events: list) -> int:
    """Exchanges spanning a computation, posted before the first backward or after the
    last forward."""
    first_b = events.index("B")
    last_f = len(events) - 1 - events[::-1].index("F")
    opened, count = {}, 0
    for i, event in enumerate(events):
        if event[0] == "post":
            opened[event[1]] = i
        elif event[0] == "wait":
            start = opened.pop(event[1])
            ran = any(e in ("F", "B") for e in events[start:i])
            count += ran and (start < first_b or start > last_f)
    return count


def test_the_schedule_table_is_megatrons():
    # Megatron's example (PP2, groups of 3, 5 micro-batches, 2 chunks): micro-batches
    # 0 1 2 0 1 2 3 4 3 4 through chunks 0 0 0 1 1 1 0 0 1 1.
    assert schedule_table(5, 2, 3) == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert schedule_table(4, 2, 2) == [0, 0, 1, 1, 0, 0, 1, 1]


@pytest.mark.parametrize(
    "m,group,message",
    [
        (3, None, r"num_microbatches=3 in groups of microbatch_group_size_per_vp_stage=2 "
                  r"leaves a last group of 1, fewer than pipeline_model_parallel_size=2"),
        (4, 5, r"microbatch_group_size_per_vp_stage=5 per model chunk, which must lie "
               r"between pipeline_model_parallel_size=2 and num_microbatches=4"),
        (4, 1, r"microbatch_group_size_per_vp_stage=1 per model chunk, which must lie between"),
    ],
)  # fmt: skip
def test_interleaved_refuses_bad_groups_before_communicating(m, group, message):
    group_of_ranks = RankGroup("pp", (0, 1), 0, None)  # no process group: a collective fails
    schedule = get_forward_backward_func(2, 2)
    chunks = [stack(0, 2, True), stack(4, 2, False)]
    with pytest.raises(ValueError, match=message):
        schedule(forward_step_func=forward_step, data_iterator=[iter([]), iter([])],
                 model=chunks, num_microbatches=m, config=config(group),
                 pp_group=group_of_ranks)  # fmt: skip


def test_stage_layers():
    assert [stage_layers(8, 4, r) for r in range(4)][1].offset == 2
    # pp 2 x vpp 2: virtual stages (c=0, r=0), (0, 1), (1, 0), (1, 1) hold 2 layers each.
    offsets = [[stage_layers(8, 2, r, virtual_pipeline_model_parallel_size=2, vp_stage=c).offset
                for c in range(2)] for r in range(2)]  # fmt: skip
    assert offsets == [[0, 4], [2, 6]]
    uneven = [stage_layers(10, 4, r, num_layers_in_first_pipeline_stage=1,
                           num_layers_in_last_pipeline_stage=3) for r in range(4)]  # fmt: skip
    assert [(s.offset, s.count) for s in uneven] == [(0, 1), (1, 3), (4, 3), (7, 3)]
    assert uneven[0].pre_process and uneven[3].post_process and not uneven[1].post_process
    with pytest.raises(ValueError, match="not divisible by virtual_pipeline_model_parallel_size"):
        stage_layers(6, 2, 0, virtual_pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match="would share 8 layers unevenly"):
        stage_layers(10, 4, 0, num_layers_in_first_pipeline_stage=2)
    # Megatron's "|" segments: virtual stage c * pp + r holds segments[c * pp + r].
    segments = [2, 1, 3, 1]
    chunks = [[stage_layers(7, 2, r, virtual_pipeline_model_parallel_size=2, vp_stage=c,
                            segments=segments) for c in range(2)] for r in range(2)]  # fmt: skip
    assert [[(s.offset, s.count) for s in rank] for rank in chunks] == [
        [(0, 2), (3, 3)], [(2, 1), (6, 1)]]  # fmt: skip
    assert chunks[0][0].pre_process and chunks[1][1].post_process
    assert not chunks[1][0].post_process and not chunks[0][1].pre_process
    for wrong, message in (
        ([2, 1, 3], "3 segments for pipeline_model_parallel_size=2 x"),
        ([3, 1, 3, 1], "must hold num_layers=7 layers in all, none below zero"),
        ([4, -1, 3, 1], "must hold num_layers=7 layers in all, none below zero"),
    ):
        with pytest.raises(ValueError, match=message):
            stage_layers(7, 2, 0, virtual_pipeline_model_parallel_size=2, segments=wrong)
    # a stage may hold no layer (the embedding or the loss alone: a pipeline layout's)
    empty = stage_layers(7, 2, 1, virtual_pipeline_model_parallel_size=2, vp_stage=1,
                         segments=[3, 1, 3, 0])  # fmt: skip
    assert (empty.offset, empty.count, empty.post_process) == (7, 0, True)
    with pytest.raises(ValueError, match="num_layers_in_first_pipeline_stage=1 and"):
        stage_layers(7, 2, 0, virtual_pipeline_model_parallel_size=2, segments=segments,
                     num_layers_in_first_pipeline_stage=1)  # fmt: skip


class SyncLog:
    """A chunk's no_sync context, and whether it was held at each of the chunk's backwards."""

    def __init__(self) -> None:
        self.held, self.backwards = False, []

    @contextlib.contextmanager
    def no_sync(self):
        self.held = True
        try:
            yield
        finally:
            self.held = False


def sync_body(pp: int, vpp: int, m: int, group: int | None, shared: bool) -> list[list[bool]]:
    """Each chunk's backwards: whether its no_sync (one per chunk, or one `shared` by the
    chunks, a single context) was held at each."""
    torch.set_num_threads(1)
    state = mp_state.initialize(ParallelConfig(pipeline_model_parallel_size=pp))
    chunks, logs = [], []
    one = SyncLog()
    for vp_stage in range(vpp):
        where = stage_layers(
            LAYERS, pp, state.pp.rank, virtual_pipeline_model_parallel_size=vpp, vp_stage=vp_stage
        )
        chunk, log = (
            stack(where.offset, where.count, where.pre_process),
            one if shared else SyncLog(),
        )
        chunk.layers[0].weight.register_hook(lambda grad, log=log: log.backwards.append(log.held))
        chunks.append(chunk)
        logs.append(log)
    funcs = one.no_sync if shared else [log.no_sync for log in logs]
    settings = dataclasses.replace(config(group), no_sync_func=funcs)
    get_forward_backward_func(pp, vpp)(
        forward_step_func=forward_step, data_iterator=[iter(micro_batches(m)) for _ in chunks],
        model=chunks, num_microbatches=m, config=settings, pp_group=state.pp,
    )  # fmt: skip
    mp_state.destroy()
    if shared:  # the chunks' backwards in the order they ran
        return [one.backwards]
    return [log.backwards for log in logs]


@pytest.mark.parametrize("pp,vpp,m,group", [(2, 2, 4, None), (2, 2, 5, 3), (2, 4, 4, None)])
def test_interleaved_each_chunk_reduces_in_its_own_last_backward(pp, vpp, m, group):
    """Each chunk's no_sync is held for its first m - 1 backwards and left before its
    last, wherever that falls in the schedule: a sharded chunk (FSDP2) reduces its
    gradients in that backward or never. A context shared by the chunks is held until the
    last backward of all."""
    ranks = run_on_ranks(sync_body, pp, pp, vpp, m, group, False, timeout=120)
    for rank, chunks in enumerate(ranks):
        for chunk, held in enumerate(chunks):
            assert held == [True] * (m - 1) + [False], (rank, chunk, held)
    for rank, [held] in enumerate(run_on_ranks(sync_body, pp, pp, vpp, m, group, True)):
        assert held == [True] * (m * vpp - 1) + [False], (rank, held)


def test_interleaved_needs_one_iterator_per_chunk():
    group = RankGroup("pp", (0, 1), 0, None)
    with pytest.raises(ValueError, match="one data iterator per model chunk"):
        get_forward_backward_func(2, 2)(
            forward_step_func=forward_step, data_iterator=iter([]), model=[stack(0, 2, True)] * 2,
            num_microbatches=2, config=config(), pp_group=group,
        )  # fmt: skip
