"""A forward without a backward (an evaluation, under no_grad) leaves FullyShardedDataParallel
sharded, so that the checkpoint saved after it holds every parameter's shard and optimizer
state (2 ranks, ZeRO-3 and ZeRO-2).

FSDP2 frees what a forward gathered in the backward that follows it: the root module
(which FSDP2 never reshards after its forward) and, under ZeRO-2, every unit stayed whole
after an evaluation, their parameters plain tensors in place of the sharded ones. A
checkpoint saved then (an evaluation at the save interval, as is common) lacked the
optimizer state of those parameters and could not be loaded, at any layout."""

import pytest
import torch

import mp_state
from mp_ckpt import ShardedTensor
from mp_optim import FullyShardedDataParallel, OptimizerConfig, get_optimizer
from mp_optim.fsdp_sharding import is_dtensor
from mp_state import ParallelConfig
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank


class Unit(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class Chunk(torch.nn.Sequential):
    """Two units, then a linear layer of the root's own."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(Unit(), Unit(), torch.nn.Linear(8, 1))

    def sharded_state_dict(self, prefix=""):
        whole = {prefix + name: p for name, p in self.named_parameters()}
        return {
            k: ShardedTensor(k, p.data, tuple(p.shape), (0,) * p.dim()) for k, p in whole.items()
        }


def after_evaluation(strategy: str) -> tuple[list[str], dict, dict]:
    """A step, then a forward under no_grad: the parameters that are not sharded, and the
    model's and the optimizer's checkpoint pieces (key: flattened range)."""
    torch.set_num_threads(1)
    state = mp_state.initialize(ParallelConfig())
    config = OptimizerConfig(
        lr=0.1, use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy
    )
    model = FullyShardedDataParallel(config, Chunk(), dp_group=state.dp, units=(Unit,))
    optimizer = get_optimizer(config, [model], mp_group=state.mp)
    x = torch.full((2, 8), state.dp.rank + 1.0)
    model(x).sum().backward()
    model.finish_grad_sync()
    optimizer.step()
    with torch.no_grad():
        model(x)
    whole = [name for name, p in model.module.named_parameters() if not is_dtensor(p)]
    pieces = {k: p.flattened_range for k, p in model.sharded_state_dict().items()}
    state_pieces = optimizer.sharded_state_dict()["state"]
    optimizer_pieces = {k: p.flattened_range for k, p in state_pieces.items()}
    mp_state.destroy()
    return whole, pieces, optimizer_pieces


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads"])
def test_a_checkpoint_after_an_evaluation_holds_every_shard_and_its_state(strategy):
    names = {"0.linear.bias", "0.linear.weight", "1.linear.bias", "1.linear.weight", "2.bias",
             "2.weight"}  # fmt: skip
    held, states = set(), set()
    for rank, (whole, pieces, optimizer_pieces) in enumerate(
        run_on_ranks(after_evaluation, 2, strategy, timeout=120)
    ):
        assert whole == [], (rank, whole)
        # each rank describes its rows of a parameter: a flattened range of the whole
        assert None not in pieces.values(), (rank, pieces)
        assert None not in optimizer_pieces.values(), (rank, optimizer_pieces)
        held |= set(pieces)
        states |= set(optimizer_pieces)
    assert held == names
    assert states == {f"optimizer.{s}.{n}" for s in ("exp_avg", "exp_avg_sq") for n in names}
