"""Megatron's pipeline schedules: no pipelining, 1F1B, interleaved 1F1B.

Every schedule has Megatron's signature:

    losses = forward_backward(
        forward_step_func=..., data_iterator=..., model=model_chunks,
        num_microbatches=m, pp_group=state.pp, config=PipelineConfig(...),
        forward_only=False,
    )

and returns, on the last pipeline stage, the report of every micro-batch's
loss function (an empty list elsewhere). p is the pipeline size, r this
rank's stage, v the number of model chunks per rank (virtual stages).

- No pipelining (p = 1): forward and backward of each micro-batch in turn,
  gradients accumulating; reduction held back (no_sync) until the last.
- 1F1B: p - r - 1 warm-up forwards, then one forward and one backward in
  turn, then the remaining backwards. Stage r holds at most p - r micro-
  batches' activations at once.
- Interleaved 1F1B: each rank holds v chunks (virtual stage c * p + r); the
  micro-batches go through in groups of g per chunk (g =
  microbatch_group_size_per_vp_stage, p by default; Megatron's schedule table), so
  that the bubble shrinks v-fold. p <= g <= m, and m % g is 0 or at least p.

docs/pipeline.md draws each as a timeline.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from mp_pipeline.config import PipelineConfig
from mp_pipeline.p2p import InFlight, P2PCommunicator
from mp_pipeline.step import ForwardStepFunc, StepRunner
from mp_state import RankGroup, select_device

__all__ = [
    "check_microbatch_group",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving",
    "get_forward_backward_func",
    "schedule_table",
]


def get_forward_backward_func(
    pipeline_model_parallel_size: int, virtual_pipeline_model_parallel_size: int | None = None
) -> Callable[..., list[Any]]:
    """The schedule for this layout (Megatron's get_forward_backward_func)."""
    if pipeline_model_parallel_size == 1:
        return forward_backward_no_pipelining
    if virtual_pipeline_model_parallel_size is not None:
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving


def forward_backward_no_pipelining(
    *,
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator | list[Iterator],
    model: torch.nn.Module | list[torch.nn.Module],
    num_microbatches: int,
    config: PipelineConfig,
    pp_group: RankGroup | None = None,
    forward_only: bool = False,
) -> list[Any]:
    """Gradient accumulation over micro-batches on one stage."""
    chunks, iterators = _as_lists(model, data_iterator)
    if len(chunks) != 1:
        raise ValueError(f"no pipelining takes one model chunk, got {len(chunks)}")
    _check_microbatches(num_microbatches)
    run = StepRunner(forward_step_func, iterators, chunks, num_microbatches, config)
    if not forward_only:
        run.disable_grad_sync()
    for i in range(num_microbatches):
        loss = run.forward(0, None, last_stage=True)
        if not forward_only:
            if i == num_microbatches - 1:
                run.enable_grad_sync()
            run.backward(None, loss, None)
    if not forward_only:
        run.finalize()
    return run.losses


def forward_backward_pipelining_without_interleaving(
    *,
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator | list[Iterator],
    model: torch.nn.Module | list[torch.nn.Module],
    num_microbatches: int,
    config: PipelineConfig,
    pp_group: RankGroup,
    forward_only: bool = False,
) -> list[Any]:
    """1F1B: warm-up forwards, one-forward-one-backward, cool-down backwards."""
    chunks, iterators = _as_lists(model, data_iterator)
    if len(chunks) != 1:
        raise ValueError(f"1F1B takes one model chunk per rank, got {len(chunks)}")
    _check_microbatches(num_microbatches)
    p, r, m = pp_group.size, pp_group.rank, num_microbatches
    first, last = r == 0, r == p - 1
    comm = _communicator(pp_group, config)
    run = StepRunner(forward_step_func, iterators, chunks, m, config)

    def recv_forward():
        return None if first else comm.recv_forward()

    def recv_backward():
        return None if last else comm.recv_backward()

    warmup = min(p - r - 1, m)
    remaining = m - warmup
    inputs: list[torch.Tensor | None] = []
    outputs: list[torch.Tensor] = []
    if not forward_only:
        run.disable_grad_sync()

    for _ in range(warmup):
        input_tensor = recv_forward()
        output = run.forward(0, input_tensor, last)
        if not last:
            comm.send_forward(output)
        if not forward_only:
            inputs.append(input_tensor)
            outputs.append(output)
            run.deallocate(output)

    input_tensor = recv_forward() if remaining > 0 else None
    for i in range(remaining):
        last_iteration = i == remaining - 1
        output = run.forward(0, input_tensor, last)
        if forward_only:
            if not last:
                comm.send_forward(output)
            input_tensor = None if last_iteration else recv_forward()
            continue
        output_grad = None if last else comm.send_forward_recv_backward(output)
        inputs.append(input_tensor)
        outputs.append(output)
        run.deallocate(output)
        if warmup == 0 and last_iteration:
            run.enable_grad_sync()
        input_grad = run.backward(inputs.pop(0), outputs.pop(0), output_grad)
        if last_iteration:
            input_tensor = None
            if not first:
                comm.send_backward(input_grad)
        else:
            input_tensor = None if first else comm.send_backward_recv_forward(input_grad)

    if not forward_only:
        for i in range(warmup):
            if i == warmup - 1:
                run.enable_grad_sync()
            output_grad = recv_backward()
            input_grad = run.backward(inputs.pop(0), outputs.pop(0), output_grad)
            if not first:
                comm.send_backward(input_grad)
        run.finalize()
    return run.losses


def forward_backward_pipelining_with_interleaving(
    *,
    forward_step_func: ForwardStepFunc,
    data_iterator: list[Iterator],
    model: list[torch.nn.Module],
    num_microbatches: int,
    config: PipelineConfig,
    pp_group: RankGroup,
    forward_only: bool = False,
) -> list[Any]:
    """Interleaved 1F1B over the v model chunks of this rank (virtual stages)."""
    if not isinstance(data_iterator, list | tuple):
        raise ValueError(
            "the interleaved schedule takes one data iterator per model chunk (a list): "
            "chunks sharing one iterator would each draw different micro-batches"
        )
    chunks, iterators = _as_lists(model, data_iterator)
    p, r, m, v = pp_group.size, pp_group.rank, num_microbatches, len(chunks)
    _check_microbatches(m)
    if v < 2:
        raise ValueError(f"the interleaved schedule needs >= 2 model chunks per rank, got {v}")
    if len(iterators) != v:
        raise ValueError(f"one data iterator per model chunk: {v} chunks, {len(iterators)}")
    group = config.microbatch_group_size_per_vp_stage or p
    check_microbatch_group(m, p, group)
    comm = _communicator(pp_group, config)
    run = StepRunner(forward_step_func, iterators, chunks, m, config)
    table = schedule_table(m, v, group)
    total = m * v

    def chunk_of(k: int, forward: bool) -> int:
        c = table[k % total]
        return c if forward else v - 1 - c

    def is_first(c: int) -> bool:
        return r == 0 and c == 0

    def is_last(c: int) -> bool:
        return r == p - 1 and c == v - 1

    def receives(k: int, forward: bool) -> tuple[bool, int]:
        """Whether a tensor arrives after step k (forward: from the rank before; backward:
        from the rank after), and the chunk it is for (Megatron's
        recv_tensor_from_previous_stage). The leading stage (the first in forward, the last
        in backward) receives what the other end of the ring sent p - 1 steps earlier."""
        step = 1 if forward else -1
        if r == (0 if forward else p - 1):
            if k < p - 1:  # the other end has sent nothing yet
                return False, chunk_of(k + 1, forward) + step
            sent_by = chunk_of(k - (p - 1), forward)
            return sent_by != (v - 1 if forward else 0), sent_by + step
        return True, chunk_of(k + 1, forward)

    arrived: list[list[torch.Tensor]] = [[] for _ in range(v)]  # received, not yet run
    inputs: list[list[torch.Tensor | None]] = [[] for _ in range(v)]  # run, kept for backward
    outputs: list[list[torch.Tensor]] = [[] for _ in range(v)]
    output_grads: list[list[torch.Tensor | None]] = [[] for _ in range(v)]

    def forward_k(k: int) -> torch.Tensor:
        c = chunk_of(k, forward=True)
        input_tensor = None if is_first(c) else arrived[c].pop(0)
        output = run.forward(c, input_tensor, is_last(c))
        if not forward_only:  # kept for the backward
            inputs[c].append(input_tensor)
            outputs[c].append(output)
        return output

    backwards_left = [m] * v

    def backward_k(k: int) -> torch.Tensor | None:
        c = chunk_of(k, forward=False)
        if is_last(c):
            output_grads[c].append(None)
        backwards_left[c] -= 1
        if backwards_left[c] == 0:  # the chunk's last micro-batch: its gradients reduce
            run.enable_grad_sync(c)
        if k == total - 1:
            run.enable_grad_sync()
        return run.backward(inputs[c].pop(0), outputs[c].pop(0), output_grads[c].pop(0))

    # Megatron's warm-up: (p - r - 1) x 2 forwards, plus (v - 1) groups of micro-batches.
    warmup = total if forward_only else min((p - r - 1) * 2 + (v - 1) * group, total)
    remaining = total - warmup
    if not forward_only:
        run.disable_grad_sync()
    # Under overlap_p2p_comm each exchange of the steady state is posted after its step's
    # compute and waited for before the step that needs it, so that it travels while the
    # other direction's step computes; with overlap_p2p_comm_warmup_flush the warm-up's
    # and the flush's too, a rank other than the leading one (the first in forward, the
    # last in backward, as in Megatron-LM) posting the next receive before its step.
    overlap = config.overlap_p2p_comm
    flush = overlap and config.overlap_p2p_comm_warmup_flush
    flight = InFlight()

    def post(forward: bool, send: torch.Tensor | None, recv: bool) -> torch.Tensor | None:
        """Posts one direction's exchange; returns its receive buffer, filled once
        flight.ready(forward) has returned."""
        if forward:
            exchange = comm.post(send_next=send, recv_prev=recv)
        else:
            exchange = comm.post(send_prev=send, recv_next=recv)
        flight.add(exchange, forward=forward, receives=recv, sends=send is not None)
        return exchange.from_prev if forward else exchange.from_next

    if not is_first(0):
        arrived[0].append(post(True, None, True) if flush else comm.recv_forward())
    for k in range(warmup):
        c = chunk_of(k, forward=True)
        recv_prev, next_c = receives(k, forward=True)
        recv_prev = recv_prev and k != total - 1
        prefetch = flush and recv_prev and r != 0
        if flush:
            flight.ready(forward=True)
            if prefetch:
                arrived[next_c].append(post(True, None, True))
        output = forward_k(k)
        send = None if is_last(c) else output
        first_backward_next = k == warmup - 1 and not forward_only and remaining > 0
        if flush:
            from_prev = post(True, send, recv_prev and not prefetch)
        elif first_backward_next and not overlap:
            recv_next = r != p - 1
            from_prev, from_next = comm.communicate(send_next=send, recv_prev=recv_prev,
                                                    recv_next=recv_next)  # fmt: skip
            if recv_next:
                output_grads[v - 1].append(from_next)
        else:
            from_prev, _ = comm.communicate(send_next=send, recv_prev=recv_prev)
        if recv_prev and not prefetch:
            arrived[next_c].append(from_prev)
        if first_backward_next and overlap and r != p - 1:
            output_grads[v - 1].append(post(False, None, True))
        if not forward_only:
            run.deallocate(output)

    for k in range(remaining):
        fk = k + warmup
        fc = chunk_of(fk, forward=True)
        bc = chunk_of(k, forward=False)
        # What arrives this round: the rank before sends its next forward input, the
        # rank after the next output gradient (ring included).
        recv_prev, next_fc = receives(fk, forward=True)
        recv_next, next_bc = receives(k, forward=False)
        if k == remaining - 1:
            recv_prev = False
        if overlap:
            flight.ready(forward=True)
            output = forward_k(fk)
            from_prev = post(True, None if is_last(fc) else output, recv_prev)
            run.deallocate(output)
            flight.ready(forward=False)
            input_grad = backward_k(k)
            from_next = post(False, None if is_first(bc) else input_grad, recv_next)
        else:
            output = forward_k(fk)
            input_grad = backward_k(k)
            from_prev, from_next = comm.communicate(
                send_next=None if is_last(fc) else output,
                send_prev=None if is_first(bc) else input_grad,
                recv_prev=recv_prev,
                recv_next=recv_next,
            )
            run.deallocate(output)
        if recv_prev:
            arrived[next_fc].append(from_prev)
        if recv_next:
            output_grads[next_bc].append(from_next)

    if not forward_only:
        if remaining == 0 and r != p - 1:
            output_grads[v - 1].append(post(False, None, True) if flush else comm.recv_backward())
        for k in range(remaining, total):
            bc = chunk_of(k, forward=False)
            recv_next, next_bc = receives(k, forward=False)
            recv_next = recv_next and k != total - 1
            prefetch = flush and recv_next and r != p - 1
            if overlap:
                flight.ready(forward=False)
            if prefetch:
                output_grads[next_bc].append(post(False, None, True))
            input_grad = backward_k(k)
            send = None if is_first(bc) else input_grad
            if flush:
                from_next = post(False, send, recv_next and not prefetch)
            else:
                _, from_next = comm.communicate(send_prev=send, recv_next=recv_next)
            if recv_next and not prefetch:
                output_grads[next_bc].append(from_next)
    flight.drain()
    if not forward_only:
        run.finalize()
    return run.losses


def schedule_table(m: int, v: int, group: int) -> list[int]:
    """The model chunk of each of the m x v forward steps of a rank in the interleaved
    schedule (Megatron's get_schedule_table): the micro-batches in groups of `group`, each
    group through chunk 0, then chunk 1, ..., a short last group taking the rest. For m = 5,
    v = 2, group = 3: chunks 0 0 0 1 1 1 0 0 1 1 for micro-batches 0 1 2 0 1 2 3 4 3 4."""
    table = []
    for start in range(0, m, group):
        size = min(group, m - start)
        table += [c for c in range(v) for _ in range(size)]
    return table


def check_microbatch_group(m: int, p: int, group: int) -> None:
    """Megatron's rules for microbatch_group_size_per_vp_stage: between p and m, and a
    last group (m % group micro-batches) of none or at least p (a shorter one would stall
    the pipeline)."""
    if not p <= group <= m:
        raise ValueError(
            f"the interleaved schedule runs micro-batches in groups of "
            f"microbatch_group_size_per_vp_stage={group} per model chunk, which must lie "
            f"between pipeline_model_parallel_size={p} and num_microbatches={m}"
        )
    if 0 < m % group < p:
        raise ValueError(
            f"num_microbatches={m} in groups of microbatch_group_size_per_vp_stage={group} "
            f"leaves a last group of {m % group}, fewer than "
            f"pipeline_model_parallel_size={p}: the pipeline would wait on it; choose a "
            "group size dividing num_microbatches, or leaving at least p"
        )


def _as_lists(model, data_iterator) -> tuple[list[torch.nn.Module], list]:
    chunks = list(model) if isinstance(model, list | tuple) else [model]
    if isinstance(data_iterator, list | tuple):
        iterators = list(data_iterator)
    else:
        iterators = [data_iterator] * len(chunks)
    return chunks, iterators


def _check_microbatches(m: int) -> None:
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"num_microbatches={m!r} must be a positive integer")


def _communicator(pp_group: RankGroup, config: PipelineConfig) -> P2PCommunicator:
    shape = config.tensor_shape()
    if shape is None and not config.variable_seq_lengths:
        raise ValueError(
            "PipelineConfig needs seq_length, micro_batch_size and hidden_size (the boundary "
            "tensors' shape), or variable_seq_lengths=True"
        )
    return P2PCommunicator(
        pp_group, shape, config.pipeline_dtype, device=select_device().device,
        variable_seq_lengths=config.variable_seq_lengths, timeout_s=config.p2p_timeout_s,
    )  # fmt: skip
