"""Point-to-point communication between adjacent pipeline stages.

Activations go forward (rank r to r + 1), their gradients backward (r + 1 to
r). The ranks form a ring: with virtual stages the last rank's output of
chunk k is the first rank's input of chunk k + 1. Every exchange is one batch
of isend/irecv operations, waited together, so a rank that sends and
receives at once (1F1B's steady state) cannot deadlock with its neighbour.

Ordering. Two adjacent ranks may exchange several messages in one batch
(with two stages, a rank's previous and next ranks are the same). Each rank
posts the forward-direction operations (send to next, receive from previous)
before the backward-direction ones (send to previous, receive from next), so
the messages between any two ranks are matched in the same order on both
sides; on gloo the two directions also carry different tags.

Overlap. `post` starts an exchange and returns it in flight (an `Exchange`); its
`wait` finishes it and gives what it received. The interleaved schedule under
overlap_p2p_comm computes the next micro-batch meanwhile. A sent tensor is a
detached view of the output (`_ready`), so the schedule may free the output's data
(deallocate_pipeline_outputs) while the send is in flight: the view keeps the
storage the send reads, and the exchange keeps the view until it is waited for.

Shapes. Every tensor crossing a stage boundary has the shape the caller
gives (for GPT [s / (tp if sequence parallel) / cp, micro-batch, hidden]).
With variable_seq_lengths the sender first sends the shape, so each micro-
batch may differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from mp_state import RankGroup

__all__ = ["Exchange", "P2PCommunicator"]

_FORWARD_TAG, _BACKWARD_TAG = 1, 2
_MAX_DIMS = 8


@dataclass
class P2PCommunicator:
    """Sends and receives one stage's boundary tensors over `pp_group`.

    Arguments:
        pp_group: the pipeline-parallel group (`state.pp`).
        tensor_shape: shape of every boundary tensor (None with variable_seq_lengths).
        dtype: dtype of the boundary tensors.
        device: where received tensors are allocated.
        variable_seq_lengths: exchange each tensor's shape before the tensor.
        timeout_s: how long one exchange may wait for the peer before raising.
    """

    pp_group: RankGroup
    tensor_shape: tuple[int, ...] | None
    dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"
    variable_seq_lengths: bool = False
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.tensor_shape is None and not self.variable_seq_lengths:
            raise ValueError("tensor_shape is required unless variable_seq_lengths=True")
        size, rank = self.pp_group.size, self.pp_group.rank
        self.next_rank = self.pp_group.ranks[(rank + 1) % size]
        self.prev_rank = self.pp_group.ranks[(rank - 1) % size]

    # The exchanges of Megatron's schedules. `None` in, `None` out: a stage
    # without a neighbour in that direction passes None and gets None.

    def recv_forward(self) -> torch.Tensor | None:
        return self.communicate(recv_prev=True)[0]

    def recv_backward(self) -> torch.Tensor | None:
        return self.communicate(recv_next=True)[1]

    def send_forward(self, output: torch.Tensor | None) -> None:
        self.communicate(send_next=output)

    def send_backward(self, input_grad: torch.Tensor | None) -> None:
        self.communicate(send_prev=input_grad)

    def send_forward_recv_backward(self, output: torch.Tensor | None) -> torch.Tensor | None:
        return self.communicate(send_next=output, recv_next=output is not None)[1]

    def send_backward_recv_forward(self, input_grad: torch.Tensor | None) -> torch.Tensor | None:
        return self.communicate(send_prev=input_grad, recv_prev=input_grad is not None)[0]

    def communicate(
        self,
        *,
        send_next: torch.Tensor | None = None,
        send_prev: torch.Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One batched exchange, waited for; returns (from previous rank, from next rank)."""
        return self.post(send_next=send_next, send_prev=send_prev, recv_prev=recv_prev,
                         recv_next=recv_next).wait()  # fmt: skip

    def post(
        self,
        *,
        send_next: torch.Tensor | None = None,
        send_prev: torch.Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
    ) -> Exchange:
        """Starts one batched exchange and returns it in flight. Its receive buffers
        (`from_prev`, `from_next`) hold their data once `wait` has returned. With
        variable_seq_lengths the shapes are exchanged first, waited for."""
        if self.pp_group.size == 1:
            return Exchange(None, None, [], (), self)
        shape_prev = shape_next = self.tensor_shape
        if self.variable_seq_lengths:
            shape_prev, shape_next = self._exchange_shapes(send_next, send_prev, recv_prev,
                                                           recv_next)  # fmt: skip
        from_prev = self._empty(shape_prev) if recv_prev else None
        from_next = self._empty(shape_next) if recv_next else None
        group = self.pp_group.group
        ops = []
        if send_next is not None:
            ops.append(dist.P2POp(dist.isend, _ready(send_next), self.next_rank, group,
                                  _FORWARD_TAG))  # fmt: skip
        if from_prev is not None:
            ops.append(dist.P2POp(dist.irecv, from_prev, self.prev_rank, group, _FORWARD_TAG))
        if send_prev is not None:
            ops.append(dist.P2POp(dist.isend, _ready(send_prev), self.prev_rank, group,
                                  _BACKWARD_TAG))  # fmt: skip
        if from_next is not None:
            ops.append(dist.P2POp(dist.irecv, from_next, self.next_rank, group, _BACKWARD_TAG))
        works = dist.batch_isend_irecv(ops) if ops else []
        return Exchange(from_prev, from_next, works, tuple(sorted({op.peer for op in ops})), self)

    def _empty(self, shape) -> torch.Tensor:
        return torch.empty(shape, dtype=self.dtype, device=self.device, requires_grad=True)

    def _exchange_shapes(self, send_next, send_prev, recv_prev, recv_next):
        """Sends the shapes of the tensors about to be sent; receives the awaited ones."""
        group = self.pp_group.group
        ops, received = [], {}
        if send_next is not None:
            ops.append(dist.P2POp(dist.isend, _encode(send_next.shape), self.next_rank, group,
                                  _FORWARD_TAG))  # fmt: skip
        if recv_prev:
            received["prev"] = torch.zeros(_MAX_DIMS + 1, dtype=torch.int64)
            ops.append(dist.P2POp(dist.irecv, received["prev"], self.prev_rank, group,
                                  _FORWARD_TAG))  # fmt: skip
        if send_prev is not None:
            ops.append(dist.P2POp(dist.isend, _encode(send_prev.shape), self.prev_rank, group,
                                  _BACKWARD_TAG))  # fmt: skip
        if recv_next:
            received["next"] = torch.zeros(_MAX_DIMS + 1, dtype=torch.int64)
            ops.append(dist.P2POp(dist.irecv, received["next"], self.next_rank, group,
                                  _BACKWARD_TAG))  # fmt: skip
        self._run(ops)
        return _decode(received.get("prev")), _decode(received.get("next"))

    def _run(self, ops: list[dist.P2POp]) -> None:
        """Posts the batch and waits for it."""
        if ops:
            peers = tuple(sorted({op.peer for op in ops}))
            Exchange(None, None, dist.batch_isend_irecv(ops), peers, self).wait()

    def _wait(self, works: list, peers: tuple[int, ...]) -> None:
        """Waits for an exchange's works; a peer silent past the timeout is an error."""
        try:
            for work in works:
                work.wait(timeout=timedelta(seconds=self.timeout_s))
        except RuntimeError as error:
            raise RuntimeError(
                f"pipeline rank {self.pp_group.rank} (global {self.pp_group.global_rank}): "
                f"exchange with global rank(s) {list(peers)} failed or timed out after "
                f"{self.timeout_s:g} s: {error}"
            ) from error


class Exchange:
    """One batch of sends and receives in flight (P2PCommunicator.post). `wait` finishes
    it (once; later calls return at once) and returns (from previous rank, from next
    rank), None where nothing was asked for."""

    def __init__(self, from_prev, from_next, works, peers, communicator) -> None:
        self.from_prev: torch.Tensor | None = from_prev
        self.from_next: torch.Tensor | None = from_next
        self._works, self._peers, self._communicator = works, peers, communicator

    @property
    def done(self) -> bool:
        """Whether it has been waited for."""
        return not self._works

    def wait(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self._works:
            works, self._works = self._works, []  # drops the sent tensors once finished
            self._communicator._wait(works, self._peers)
        return self.from_prev, self.from_next


def _ready(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous()


def _encode(shape: torch.Size) -> torch.Tensor:
    if len(shape) > _MAX_DIMS:
        raise ValueError(f"a boundary tensor has {len(shape)} dimensions; at most {_MAX_DIMS}")
    return torch.tensor([len(shape), *shape, *[0] * (_MAX_DIMS - len(shape))], dtype=torch.int64)


def _decode(encoded: torch.Tensor | None) -> tuple[int, ...] | None:
    if encoded is None:
        return None
    n = int(encoded[0])
    return tuple(int(x) for x in encoded[1 : n + 1])


class InFlight:
    """The exchanges a schedule under overlap_p2p_comm has posted and not yet waited for.

    Those that receive in a direction (forward: from the previous rank; backward: from
    the next) are waited for before a step uses what they bring (`ready`). One that
    sends is waited for once the next send in its direction is posted, as Megatron-LM
    does, so at most two sends per direction are in flight; `drain` waits for the rest
    before the schedule ends.
    """

    def __init__(self) -> None:
        self._receiving: dict[bool, list[Exchange]] = {True: [], False: []}
        self._sending: dict[bool, Exchange | None] = {True: None, False: None}

    def add(self, exchange: Exchange, *, forward: bool, receives: bool, sends: bool) -> None:
        if exchange.done:
            return
        if receives:
            self._receiving[forward].append(exchange)
        if sends:
            previous, self._sending[forward] = self._sending[forward], exchange
            if previous is not None:
                previous.wait()

    def ready(self, *, forward: bool) -> None:
        """Waits for every exchange receiving in this direction."""
        for exchange in self._receiving[forward]:
            exchange.wait()
        self._receiving[forward].clear()

    def drain(self) -> None:
        for forward in (True, False):
            self.ready(forward=forward)
            if self._sending[forward] is not None:
                self._sending[forward].wait()
                self._sending[forward] = None
