"""FSDP2's collectives in one training step's torch.profiler trace on CPU ranks (gloo):
where each one ran, how much of it overlapped compute, and in which order FSDP issued it.

What the trace of a step holds (torch 2.11-2.15, CPU, gloo), and what is read from it:

- the main thread (the one running `FSDP::root_pre_forward`) runs the model and FSDP2's
  hooks, each hook a record_function range naming its unit: `FSDP::pre_forward
  (decoder.layers.1)`, `FSDP::forward_prefetch for decoder.layers.2`, `FSDP::all_gather
  (decoder.layers.2)`, `FSDP::post_forward (...)`, `FSDP::pre_backward (...)`,
  `FSDP::backward_prefetch for ...`, `FSDP::post_backward_reshard (...)`,
  `FSDP::post_backward_reduce (...)`; the root's (the chunk's own parameters) carry no
  name in brackets;
- the main thread issues each collective as a c10d operator (`c10d::_allgather_base_`,
  `c10d::allreduce_`, ...), which hands it to the process group;
- gloo runs it on one of its worker threads (`pt_gloo_runloop`), as a `gloo:all_gather`
  or `gloo:all_reduce` range there: the collective's own interval, from the moment a
  worker takes it to the moment the data has arrived (waiting for the peer included).

A process group's worker threads take its collectives in the order they were issued,
so the k-th collective operator on the main thread is the k-th gloo range (checked: the
kinds must agree). The enclosing FSDP range on the main thread says what it was: an
all-gather of a unit's parameters (`FSDP::all_gather (unit)`; forward or backward by
whether it starts before the first `FSDP::pre_backward`), a unit's gradient reduction
(`FSDP::post_backward_reduce (unit)`: on the CPU mp replaces FSDP2's reduce-scatter by
an all-reduce and a copy, mp_optim.fsdp_sharding), or something else (the loss and
gradient norm reductions of the step), which is counted apart.

Compute is the union of the intervals of the `aten::` operators on the main thread,
leaving out waits (any operator with "wait" in its name) and whatever runs inside a
c10d operator (handing a collective over is not compute). A collective's overlapped
time is the part of its gloo interval that this union covers.
"""

from __future__ import annotations

import itertools
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Event", "Step", "detail", "events_of", "read_step", "summarize"]

# The c10d operator that issues each kind of gloo collective (the kind is the name with
# its underscores dropped: gloo:all_gather and c10d::_allgather_base_ are "allgather").
_C10D = re.compile(r"^c10d::_?(allgather|allreduce|reduce_scatter|broadcast|alltoall)")
_KINDS = ("allgather", "allreduce", "reducescatter", "broadcast", "alltoall")
_PREFETCH = ("FSDP::forward_prefetch", "FSDP::backward_prefetch")
_UNIT = re.compile(r"\((.*)\)$")


@dataclass(frozen=True)
class Event:
    """One profiler range: its name, the (system) thread it ran on, start and end in µs."""

    name: str
    thread: int
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return (self.end - self.start) / 1e6


def events_of(prof) -> list[Event]:
    """The ranges of a finished torch.profiler.profile."""
    return [Event(e.name, e.thread, e.time_range.start, e.time_range.end) for e in prof.events()]


@dataclass(frozen=True)
class Collective:
    role: str
    """all_gather_forward, all_gather_backward, reduce_scatter or other."""
    unit: str
    """The unit's module name ("" for the root: the chunk's own parameters)."""
    issued: float
    """When the main thread handed it to gloo (µs)."""
    run: Event
    """Its interval on the gloo worker thread that ran it."""
    overlapped: float
    """Seconds of `run` during which the main thread computed."""
    prefetched: bool
    """Issued by a prefetch (FSDP::forward_prefetch / backward_prefetch), not by the
    unit's own hook."""


@dataclass(frozen=True)
class Step:
    """What one step's trace shows (see the module docstring)."""

    collectives: list[Collective]
    compute_s: float
    """Seconds the main thread computed (the union of its aten ranges)."""
    order: dict[str, list[bool]]
    """Per pair of neighbouring units, whether each ordering held (see `_order`)."""
    start: float
    """When the step's first FSDP hook began (µs)."""
    gloo_threads: int


def read_step(events: list[Event]) -> Step:
    """The collectives of one step's trace, their overlap with compute and their order."""
    roots = [e for e in events if e.name == "FSDP::root_pre_forward"]
    if not roots:
        raise RuntimeError("no FSDP::root_pre_forward in the trace: not an FSDP step")
    main = roots[0].thread
    on_main = sorted((e for e in events if e.thread == main), key=lambda e: e.start)
    issues = [e for e in on_main if _C10D.match(e.name)]
    runs = sorted((e for e in events if e.name.startswith("gloo:") and _kind(e.name) in _KINDS),
                  key=lambda e: e.start)  # fmt: skip
    if [_kind(e.name) for e in issues] != [_kind(e.name) for e in runs]:
        raise RuntimeError(
            "the collectives issued on the main thread "
            f"({[e.name for e in issues]}) do not match the ones gloo ran "
            f"({[e.name for e in runs]}): the trace cannot be read as one queue"
        )
    compute = _union(
        (e.start, e.end)
        for e in on_main
        if e.name.startswith("aten::")
        and "wait" not in e.name
        and not any(c.start <= e.start and e.end <= c.end for c in issues)
    )
    backward = min((e.start for e in on_main if e.name.startswith("FSDP::pre_backward")),
                   default=float("inf"))  # fmt: skip
    collectives = []
    for issue, run in zip(issues, runs, strict=True):
        role, unit, prefetched = _role(issue, on_main, backward)
        overlapped = _covered(compute, run.start, run.end) / 1e6
        collectives.append(Collective(role, unit, issue.start, run, overlapped, prefetched))
    return Step(
        collectives,
        compute_s=sum(end - start for start, end in compute) / 1e6,
        order=_order(on_main, collectives, backward),
        start=roots[0].start,
        gloo_threads=len({e.thread for e in runs}),
    )


def summarize(steps: list[Step]) -> dict:
    """Per role: collectives per step, their seconds and overlapped seconds per step
    (medians over the steps) and the overlapped fraction (over all steps, and per step);
    for the all-gathers the same over the prefetched ones alone; the order checks over
    all steps (held / pairs); the median delay from issue to a gloo thread starting a
    collective."""
    figures: dict = {}
    for role in ("all_gather_forward", "all_gather_backward", "reduce_scatter", "other"):
        per_step = [[c for c in step.collectives if c.role == role] for step in steps]
        figures[role] = _overlap(per_step)
        if role.startswith("all_gather"):
            prefetched = [[c for c in cs if c.prefetched] for cs in per_step]
            figures[role]["prefetched"] = _overlap(prefetched)
    fsdp = [c for step in steps for c in step.collectives if c.role != "other"]
    figures["issue_to_start_ms_median"] = round(
        statistics.median((c.run.start - c.issued) / 1e3 for c in fsdp), 3
    )
    figures["compute_s"] = round(statistics.median(s.compute_s for s in steps), 4)
    figures["order"] = {
        name: f"{sum(sum(s.order[name]) for s in steps)}/{sum(len(s.order[name]) for s in steps)}"
        for name in steps[0].order
    }
    figures["gloo_threads"] = max(s.gloo_threads for s in steps)
    return figures


def _overlap(per_step: list[list[Collective]]) -> dict:
    total = [sum(c.run.seconds for c in cs) for cs in per_step]
    overlapped = [sum(c.overlapped for c in cs) for cs in per_step]
    return {
        "per_step": statistics.median(len(cs) for cs in per_step),
        "seconds": round(statistics.median(total), 4),
        "overlapped_s": round(statistics.median(overlapped), 4),
        "overlapped_fraction": round(sum(overlapped) / sum(total), 3) if sum(total) else None,
        "overlapped_fraction_per_step": [
            round(o / t, 3) if t else None for o, t in zip(overlapped, total, strict=True)
        ],
    }


def detail(step: Step) -> list[list]:
    """Every collective of the step: role, unit, prefetched, where gloo started it (ms after
    the first FSDP hook), its ms on the gloo thread, the ms of those overlapped by
    compute."""
    return [
        [c.role, c.unit, c.prefetched, round((c.run.start - step.start) / 1e3, 2),
         round(c.run.seconds * 1e3, 2), round(c.overlapped * 1e3, 2)]
        for c in step.collectives
    ]  # fmt: skip


def _order(on_main: list[Event], collectives: list[Collective], backward: float):
    """For units i, i+1 in forward order:

    - `forward_next_issued_before_compute_ends`: the all-gather of unit i+1 was issued
      before unit i's forward ended (its FSDP::post_forward began);
    - `forward_next_issued_at_own_pre_forward`: it was issued inside unit i+1's own
      FSDP::pre_forward;

    and for units i, i-1 in backward order (i's backward runs first):

    - `backward_reduce_before_previous_done`: unit i's gradient reduction was issued
      before unit i-1's backward was done (its FSDP::post_backward_reshard began);
    - `backward_previous_gathered_before_compute_ends`: unit i-1's backward all-gather
      was issued before unit i's backward was done.
    """

    def first(prefix: str, unit: str, after: float = -1.0) -> Event:
        name = f"{prefix} ({unit})"
        return next(e for e in on_main if e.name == name and e.start >= after)

    def issued(role: str, unit: str) -> float:
        return next(c.issued for c in collectives if c.role == role and c.unit == unit)

    forward = _units(on_main, "FSDP::pre_forward", end=backward)
    backward_units = _units(on_main, "FSDP::pre_backward", start=backward)
    order: dict[str, list[bool]] = {
        "forward_next_issued_before_compute_ends": [],
        "forward_next_issued_at_own_pre_forward": [],
        "backward_reduce_before_previous_done": [],
        "backward_previous_gathered_before_compute_ends": [],
    }
    for unit, following in itertools.pairwise(forward):
        gather = issued("all_gather_forward", following)
        own = first("FSDP::pre_forward", following)
        order["forward_next_issued_before_compute_ends"].append(
            gather < first("FSDP::post_forward", unit).start
        )
        order["forward_next_issued_at_own_pre_forward"].append(own.start <= gather <= own.end)
    for unit, previous in itertools.pairwise(backward_units):
        done = first("FSDP::post_backward_reshard", unit, backward).start
        previous_done = first("FSDP::post_backward_reshard", previous, backward).start
        order["backward_reduce_before_previous_done"].append(
            issued("reduce_scatter", unit) < previous_done
        )
        order["backward_previous_gathered_before_compute_ends"].append(
            issued("all_gather_backward", previous) < done
        )
    return order


def _units(on_main: list[Event], prefix: str, start: float = -1.0, end: float = float("inf")):
    """The units (named in brackets) of the `prefix` ranges in [start, end), in order."""
    found = []
    for e in on_main:
        match = _UNIT.search(e.name)
        if e.name.startswith(prefix + " (") and match and start <= e.start < end:
            found.append(match.group(1))
    return list(dict.fromkeys(found))


def _role(issue: Event, on_main: list[Event], backward: float) -> tuple[str, str, bool]:
    """What the innermost enclosing FSDP range says the collective was, its unit, and
    whether a prefetch range encloses it."""
    enclosing = [e for e in on_main if e.start <= issue.start and issue.end <= e.end]
    prefetched = any(e.name.startswith(_PREFETCH) for e in enclosing)
    for e in sorted(enclosing, key=lambda e: e.start, reverse=True):
        match = _UNIT.search(e.name)
        unit = match.group(1) if match else ""
        if e.name.startswith("FSDP::all_gather") and not e.name.startswith("FSDP::all_gather_copy"):
            role = "all_gather_forward" if e.start < backward else "all_gather_backward"
            return role, unit, prefetched
        if e.name.startswith("FSDP::post_backward_reduce"):
            return "reduce_scatter", unit, False
    return "other", "", False


def _kind(name: str) -> str:
    """gloo:all_gather, c10d::_allgather_base_ -> allgather."""
    match = _C10D.match(name)
    return (match.group(1) if match else name.removeprefix("gloo:")).replace("_", "")


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _covered(union: list[tuple[float, float]], start: float, end: float) -> float:
    """µs of [start, end] inside the (sorted, disjoint) intervals."""
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in union)
