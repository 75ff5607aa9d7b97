"""Initialization of sharded weights, independent of the tensor-parallel size.

Shapes: a weight is described by its full (master) shape, e.g. [out, in]; the
local piece is that shape with the partition dimension divided by tp.

Every tensor-parallel rank builds the full master weight on the CPU in fp32,
fills it with `init_method` from the default CPU generator, keeps its own
contiguous slice along the partition dimension, and casts it to the
parameter's dtype and device. This is Megatron's CPU-initialization path
(`use_cpu_initialization`), and here it is the only one, because of what it
guarantees:

- Tensor-parallel ranks of one pipeline stage share the default generator's
  seed (mp_state.set_random_seeds: seed + 100 * pp_rank), and each draws the
  same numbers for every weight, split or not, so their default generators
  stay in step through the whole model.
- The draws depend on the master shape only, never on tp, so one seed gives
  the same global model at TP = 1, 2, 4, ...: a run can change its
  tensor-parallel size and start from the same point, and the parallel layers
  can be tested against torch.nn layers holding the same weights.
- CPU and GPU runs draw the same numbers (the CPU generator drives both).

The cost is that each rank fills tp times the numbers it keeps, on the CPU, at
about 4.6 ns a number: seconds for a 1B model, minutes for a 70B one at TP8.

`building_on(device)` is the opt-in for a GPU: the module's tensors are created
on the device and every master is drawn there, from the device's default
generator (torch.manual_seed and seeded_init seed it with the CPU's). Ranks
still draw whole masters and keep their slices, so the first two guarantees
hold: the same model at every tensor-parallel size, on one kind of GPU. The
third does not: the numbers are not the CPU's, and CUDA's normal_ spreads its
draws by the device's multiprocessor count, so another GPU model may draw
others.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch

from mp_layers.tensor_parallel import deferred_init
from mp_state import RankGroup

__all__ = [
    "InitMethod",
    "building_on",
    "draw_device",
    "draws_skipped",
    "init_partitioned_weight",
    "row_sharded_parameter",
    "skipping_draws",
]

_skipped: ContextVar[bool] = ContextVar("draws_skipped", default=False)
_CPU = torch.device("cpu")
_draw_device: ContextVar[torch.device] = ContextVar("draw_device", default=_CPU)

InitMethod = Callable[[torch.Tensor], object]
"""Fills a tensor in place, e.g. functools.partial(torch.nn.init.normal_, std=0.02)."""


def init_partitioned_weight(
    weight: torch.Tensor,
    master_shape: tuple[int, ...],
    partition_dim: int | None,
    group: RankGroup,
    init_method: InitMethod,
) -> None:
    """Fills `weight` (this rank's piece) with its slice of a freshly initialized master.

    `partition_dim` is the dimension split over `group` (None: not split, the
    whole master is kept). Every rank of the group must call this for the
    same weights in the same order, so that their generators stay in step. A weight on
    the meta device (deferred_init.deferred_weights) gets a recipe instead of values.
    """
    expected = list(master_shape)
    if partition_dim is not None:
        expected[partition_dim] = weight.shape[partition_dim]
        fits = (group.rank + 1) * weight.shape[partition_dim] <= master_shape[partition_dim]
    else:
        fits = True
    if not fits or tuple(expected) != tuple(weight.shape):
        raise ValueError(
            f"weight of shape {tuple(weight.shape)} is not a piece of the master "
            f"{tuple(master_shape)} split along dimension {partition_dim} over {group.size} ranks"
        )
    device = _draw_device.get()
    if weight.is_meta:  # deferred_weights(): filled once sharded (deferred_init.py)
        if device != _CPU:
            raise ValueError(
                f"a weight deferred to its shards is replayed from the CPU generator; it "
                f"cannot be drawn on {device} (building_on)"
            )
        deferred_init.record(weight, master_shape, partition_dim, group.rank, init_method)
        return
    if _skipped.get():  # skipping_draws(): a checkpoint fills it
        return
    master = torch.empty(master_shape, dtype=torch.float32, device=device)
    init_method(master)
    if partition_dim is not None:
        piece = weight.shape[partition_dim]
        master = master.narrow(partition_dim, group.rank * piece, piece)
    with torch.no_grad():
        weight.copy_(master)


@contextlib.contextmanager
def skipping_draws() -> Iterator[None]:
    """Inside, the weights init_partitioned_weight fills, and the routed experts', keep
    the memory they were allocated with, undrawn, and the default generator does not
    move for them: for a model that a checkpoint is then loaded over in full (a strict
    load: mp_gpt.generate's Generator). Norms, biases and other small tensors are built
    as ever. Most of a model's start-up is these draws (the CPU generator's normal_, 4.6
    ns a number on the 2-core CI machine)."""
    token = _skipped.set(True)
    try:
        yield
    finally:
        _skipped.reset(token)


@contextlib.contextmanager
def building_on(device: torch.device | str) -> Iterator[None]:
    """Inside, tensors are created on `device` (torch's device context) and the weights
    init_partitioned_weight fills are drawn there, whole, from the device's default
    generator: a model built on a GPU with its draws at the GPU's speed (the module
    docstring says what stays the same). On the CPU it changes nothing."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    token = _draw_device.set(device)
    try:
        with device:
            yield
    finally:
        _draw_device.reset(token)


def draw_device() -> torch.device:
    """Where init_partitioned_weight draws its masters: the CPU, or building_on's device."""
    return _draw_device.get()


def draws_skipped() -> bool:
    """Whether weights are built undrawn (inside skipping_draws())."""
    return _skipped.get()


def row_sharded_parameter(
    shape: tuple[int, ...], init: InitMethod, dtype: torch.dtype, group: RankGroup
) -> torch.nn.Parameter:
    """This rank's piece of a tensor of `shape` split along dimension 0 over `group` (a Mamba
    mixer's or a gated DeltaNet's per-head tensors), drawn as init_partitioned_weight draws
    (on the meta device under deferred_weights)."""
    local = (shape[0] // group.size, *shape[1:])
    device = deferred_init.weight_device(None)
    param = torch.nn.Parameter(torch.empty(local, dtype=dtype, device=device))
    init_partitioned_weight(param, shape, 0, group, init)
    return param
