"""How a model's build draws its weights.

skipping_draws(): a model built to have a checkpoint loaded over it draws none of its
weight matrices (a dense model leaves the default generator where it was; a MoE model
still draws the router's small bias), and, once the whole model's weights are loaded
over its undrawn ones (set to NaN first), computes what the drawn model computes.

building_on(device): a model built on its device with its weights drawn there. On the
CPU it changes nothing; on a GPU every tensor is created there, each master is drawn
whole from the GPU's generator (the CPU's does not move) and a tensor-parallel rank keeps
its slice of it, so the model does not depend on the tensor-parallel size."""

import dataclasses
import functools

import pytest
import torch

from mp_layers import GPTModel, ModelGroups, TransformerConfig, building_on, skipping_draws
from mp_layers.tensor_parallel.initialization import draw_device, init_partitioned_weight
from mp_state import RankGroup

SINGLE = ModelGroups.single()
CONFIG = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                           num_query_groups=2, hidden_dropout=0.0, attention_dropout=0.0,
                           normalization="RMSNorm", activation="swiglu",
                           position_embedding_type="rope")  # fmt: skip
MOE = dataclasses.replace(CONFIG, num_moe_experts=4, moe_router_topk=2)
NORMAL = functools.partial(torch.nn.init.normal_, std=0.02)


def test_no_weight_is_drawn_and_a_loaded_model_computes_as_the_drawn_one():
    for config in (CONFIG, MOE):
        torch.manual_seed(3)
        drawn = GPTModel(config, "local", 64, 16, groups=SINGLE).eval()
        state = torch.get_rng_state()
        with skipping_draws():
            built = GPTModel(config, "local", 64, 16, groups=SINGLE).eval()
        if config is CONFIG:
            assert torch.equal(torch.get_rng_state(), state), "the generator moved"
        # Undrawn memory may hold anything, even a freed master's values (malloc hands
        # the block back): NaN everywhere, so that any weight the load missed shows.
        with torch.no_grad():
            for param in built.parameters():
                param.fill_(float("nan"))
        built.load_state_dict(drawn.state_dict())
        ids = torch.randint(0, 64, (2, 16))
        with torch.no_grad():
            assert torch.equal(built(ids), drawn(ids))


def test_outside_the_context_weights_are_drawn_again():
    with skipping_draws():
        pass
    torch.manual_seed(3)
    a = GPTModel(CONFIG, "local", 64, 16, groups=SINGLE)
    torch.manual_seed(3)
    b = GPTModel(CONFIG, "local", 64, 16, groups=SINGLE)
    assert torch.equal(a.decoder.layers[0].mlp.linear_fc1.weight,
                       b.decoder.layers[0].mlp.linear_fc1.weight)  # fmt: skip
    assert a.decoder.layers[0].mlp.linear_fc1.weight.std() > 0.01


def _built(config, device=None):
    torch.manual_seed(3)
    if device is None:
        return GPTModel(config, "local", 64, 16, groups=SINGLE)
    with building_on(device):
        return GPTModel(config, "local", 64, 16, groups=SINGLE)


def _piece(master_shape, dim, rank, size):
    """Rank `rank` of `size` tensor-parallel ranks' piece of a weight, drawn under the
    current building_on."""
    shape = list(master_shape)
    if dim is not None:
        shape[dim] //= size
    weight = torch.empty(shape)
    group = RankGroup("tp", tuple(range(size)), rank, group=None)
    init_partitioned_weight(weight, master_shape, dim, group, NORMAL)
    return weight


@pytest.mark.parametrize("config", [CONFIG, MOE], ids=["dense", "moe"])
def test_on_the_cpu_nothing_changes(config):
    plain = _built(config)
    on_cpu = _built(config, "cpu")
    assert plain.state_dict().keys() == on_cpu.state_dict().keys()
    for name, tensor in plain.state_dict().items():
        assert torch.equal(tensor, on_cpu.state_dict()[name]), name


def test_the_draw_device_is_the_contexts_and_returns_after():
    assert draw_device() == torch.device("cpu")
    with building_on("meta"):  # a device other than the CPU, for the context alone
        assert draw_device() == torch.device("meta")
        assert torch.empty(1).device == torch.device("meta")
    assert draw_device() == torch.device("cpu")
    assert torch.empty(1).device == torch.device("cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("config", [CONFIG, MOE], ids=["dense", "moe"])
def test_on_a_gpu_every_tensor_is_made_there_and_the_cpu_generator_stays(config):
    torch.manual_seed(3)
    cpu_state = torch.get_rng_state()
    with building_on("cuda"):
        model = GPTModel(config, "local", 64, 16, groups=SINGLE)
    assert torch.equal(torch.get_rng_state(), cpu_state), "weights were drawn on the CPU"
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert tensor.device.type == "cuda", name
    fc1 = model.decoder.layers[0].mlp
    weight = (fc1.experts.linear_fc1 if config is MOE else fc1.linear_fc1).weight
    assert 0.01 < weight.float().std().item() < 0.03


@pytest.mark.cuda
@pytest.mark.parametrize("dim", [0, 1])
def test_on_a_gpu_the_pieces_of_two_ranks_are_the_one_ranks_weight(dim):
    shape = (64, 48)
    with building_on("cuda"):
        torch.manual_seed(5)
        whole = _piece(shape, None, 0, 1)
        torch.manual_seed(5)
        expected = torch.empty(shape, device="cuda").normal_(std=0.02)
        pieces = []
        for rank in range(2):
            torch.manual_seed(5)  # each rank's generator, seeded alike
            pieces.append(_piece(shape, dim, rank, 2))
    assert whole.device.type == "cuda" and torch.equal(whole, expected)
    assert torch.equal(torch.cat(pieces, dim=dim), whole)
