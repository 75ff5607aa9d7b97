"""optimizer="muon" in the optimizer wrapper: Megatron's rules for the config, every
muon_* field reaching the Muon update, Muon over the matrices beside Adam over the rest
(state, state_dict, sharded state), and the layer-wise distributed optimizer's split:
balanced whole parameters per rank, every rank's update the plain one's, each parameter
broadcast from its owner."""

import copy

import pytest
import torch
import torch.distributed as dist

from mp_optim import DistributedDataParallel, OptimizerConfig, get_optimizer
from mp_optim.layer_wise import assign_owners, broadcast_from_owners
from mp_optim.lion import Lion
from mp_optim.muon import Muon
from mp_state import RankGroup
from mp_state.testing import run_on_ranks

SINGLE = RankGroup("single", (0,), 0, None)


@pytest.mark.parametrize("settings,message", [
    (dict(fp16=True), "Muon takes fp32 or bf16"),
    (dict(use_megatron_fsdp=True), "Muon needs whole matrices, FSDP shards each one"),
    (dict(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim"), "under FSDP"),
    (dict(muon_fp32_matmul_prec="low"), "torch has no such float32 matmul precision"),
    (dict(muon_coefficient_type="custom"), "muon_coefficient_type='custom'"),
    (dict(muon_num_ns_steps=0), "muon_num_ns_steps=0: at least 1"),
    (dict(use_distributed_optimizer=True, overlap_param_gather=True),
     "broadcasts the updated parameters right after the step"),
    (dict(use_precision_aware_optimizer=True, use_distributed_optimizer=True),
     "adam only"),
])  # fmt: skip
def test_megatrons_rules(settings, message):
    with pytest.raises(ValueError, match=message):
        OptimizerConfig(optimizer="muon", lr=1e-3, **settings)


def test_the_distributed_optimizer_becomes_layer_wise():
    config = OptimizerConfig(optimizer="muon", lr=1e-3, use_distributed_optimizer=True)
    assert config.use_layer_wise_distributed_optimizer
    assert not config.use_distributed_optimizer  # DDP all-reduces, as without it
    with pytest.raises(ValueError, match="needs optimizer='muon'"):
        OptimizerConfig(lr=1e-3, use_layer_wise_distributed_optimizer=True)


class Toy(torch.nn.Module):
    """An embedding, a matrix with a bias, a norm weight: what a language model holds."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(16, 8)
        self.embedding.weight.is_embedding_or_output_parameter = True
        self.linear = torch.nn.Linear(8, 12)
        self.norm = torch.nn.Parameter(torch.ones(12))

    def forward(self, ids):
        return (self.linear(self.embedding(ids)) * self.norm).square().mean()


def optimizer_of(**settings):
    config = OptimizerConfig(**({"optimizer": "muon", "lr": 1e-2} | settings))
    model = DistributedDataParallel(config, Toy(), dp_group=SINGLE)
    return model, get_optimizer(config, [model], mp_group=SINGLE)


def two_steps(model, optimizer, steps: int = 2):
    """Two (or `steps`) steps on one batch; the last StepResult."""
    ids = torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        optimizer.zero_grad()
        model(ids).backward()
        model.finish_grad_sync()
        result = optimizer.step()
    return result


def test_every_muon_field_reaches_the_update():
    settings = dict(muon_momentum=0.8, muon_nesterov=True, muon_split_qkv=False,
                    muon_scale_mode="unit_rms_norm", muon_extra_scale_factor=0.2,
                    muon_num_ns_steps=3, muon_coefficient_type="polar_express",
                    muon_fp32_matmul_prec="high", muon_tp_mode="distributed")  # fmt: skip
    _, optimizer = optimizer_of(**settings)
    muon, adam = optimizer.optimizer.optimizers
    assert isinstance(muon, Muon) and isinstance(adam, torch.optim.AdamW)
    got = dict(muon_momentum=muon.param_groups[0]["momentum"], muon_nesterov=muon.nesterov,
               muon_split_qkv=muon.split_qkv, muon_scale_mode=muon.scale_mode,
               muon_extra_scale_factor=muon.extra_scale_factor,
               muon_num_ns_steps=muon.num_ns_steps,
               muon_coefficient_type=muon.coefficient_type,
               muon_fp32_matmul_prec=muon.matmul_precision, muon_tp_mode=muon.tp_mode)  # fmt: skip
    assert got == settings


def test_muon_takes_the_matrix_and_adam_the_rest():
    model, optimizer = optimizer_of(weight_decay=0.1)
    muon, adam = optimizer.optimizer.optimizers
    matrices = [p for g in muon.param_groups for p in g["params"]]
    assert [p is model.module.linear.weight for p in matrices] == [True]
    assert len([p for g in adam.param_groups for p in g["params"]]) == 3
    assert two_steps(model, optimizer).update_successful
    state = optimizer.optimizer.state
    assert set(state[model.module.linear.weight]) == {"momentum_buffer"}
    assert set(state[model.module.norm]) == {"exp_avg", "exp_avg_sq", "step"}
    keys = set(optimizer.sharded_state_dict()["state"])
    assert "optimizer.momentum_buffer.linear.weight" in keys
    assert "optimizer.exp_avg.embedding.weight" in keys
    assert "optimizer.exp_avg.linear.weight" not in keys
    # the state_dict of both, restored into a fresh pair, continues the same
    saved = copy.deepcopy(optimizer.state_dict())  # torch's holds the live tensors
    model2, optimizer2 = optimizer_of(weight_decay=0.1)
    model2.module.load_state_dict(model.module.state_dict())
    optimizer2.load_state_dict(saved)
    for m, o in ((model, optimizer), (model2, optimizer2)):
        two_steps(m, o, steps=1)
    for a, b in zip(model.module.parameters(), model2.module.parameters(), strict=True):
        assert torch.equal(a, b)


def test_lion_takes_the_rest_with_muon_scalar_optimizer_lion():
    """--muon-scalar-optimizer lion: Lion (its betas, one momentum) over what Muon does not
    take, its state saved as exp_avg alone."""
    model, optimizer = optimizer_of(weight_decay=0.1, muon_scalar_optimizer="lion",
                                    lion_beta1=0.9, lion_beta2=0.99)  # fmt: skip
    muon, lion = optimizer.optimizer.optimizers
    assert isinstance(muon, Muon) and isinstance(lion, Lion)
    assert lion.param_groups[0]["betas"] == (0.9, 0.99)
    norm = model.module.norm
    before = norm.detach().clone()
    assert two_steps(model, optimizer).update_successful
    assert set(optimizer.optimizer.state[norm]) == {"exp_avg"}
    # each element moved by whole steps of the learning rate (the sign of its update;
    # norms take no weight decay), as far as the schedule's first two steps go
    lr = next(g["lr"] for g in lion.param_groups if any(p is norm for p in g["params"]))
    steps = (norm.detach() - before).abs() / lr
    assert torch.allclose(steps, steps.round(), atol=1e-4) and steps.max() > 0
    keys = set(optimizer.sharded_state_dict()["state"])
    assert "optimizer.exp_avg.norm" in keys and "optimizer.exp_avg_sq.norm" not in keys


def test_owners_balance_whole_parameters():
    params = [torch.empty(n) for n in (100, 10, 60, 50, 5, 30)]
    owners = assign_owners(params, 2)
    load = [sum(p.numel() for p, o in zip(params, owners, strict=True) if o == r)
            for r in range(2)]  # fmt: skip
    assert owners == assign_owners(params, 2)  # every rank computes the same
    assert sorted(load) == [125, 130]
    assert assign_owners(params, 1) == [0] * 6


def broadcast_on_rank() -> list[torch.Tensor]:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    group = RankGroup("dp", (0, 1), rank, dist.group.WORLD)
    params = [torch.full((3,), float(rank)), torch.full((2, 2), 10.0 + rank),
              torch.full((4,), 20.0 + rank, dtype=torch.bfloat16)]  # fmt: skip
    broadcast_from_owners(params, [1, 0, 1], group)
    return params


@pytest.mark.multirank
def test_each_parameter_comes_from_its_owner():
    for params in run_on_ranks(broadcast_on_rank, 2):
        assert torch.equal(params[0], torch.full((3,), 1.0))
        assert torch.equal(params[1], torch.full((2, 2), 10.0))
        assert torch.equal(params[2], torch.full((4,), 21.0, dtype=torch.bfloat16))


def layer_wise_on_rank() -> tuple[list[torch.Tensor], float, float, int]:
    """Two steps on a rank of 2 under the layer-wise distributed optimizer (both ranks
    given the same batch): the parameters, the parameters' norm before the steps and the
    gradient norm of the last, and how many parameters this rank steps."""
    torch.set_num_threads(1)
    dp = RankGroup("dp", (0, 1), dist.get_rank(), dist.group.WORLD)
    config = OptimizerConfig(optimizer="muon", lr=1e-2, use_distributed_optimizer=True)
    model = DistributedDataParallel(config, Toy(), dp_group=dp)
    optimizer = get_optimizer(config, [model], mp_group=SINGLE)
    params_norm = optimizer.main_params_norm()
    result = two_steps(model, optimizer)
    owned = len(optimizer._all_shards())
    return [p.detach() for p in model.module.parameters()], params_norm, result.grad_norm, owned


@pytest.mark.multirank
def test_layer_wise_steps_as_one_rank_does():
    model, optimizer = optimizer_of()
    params_norm = optimizer.main_params_norm()
    result = two_steps(model, optimizer)
    ranks = run_on_ranks(layer_wise_on_rank, 2)
    # the embedding (128 elements) on one rank, the matrix (96), bias and norm (12 each) on
    # the other
    assert sorted(owned for *_, owned in ranks) == [1, 3]
    for params, norm, grad_norm, _ in ranks:
        assert norm == pytest.approx(params_norm, rel=1e-6)
        assert grad_norm == pytest.approx(result.grad_norm, rel=1e-6)
        for got, want in zip(params, model.module.parameters(), strict=True):
            assert torch.allclose(got, want, atol=1e-6, rtol=0)
