"""Parameters of a separate grad_norm_group ("mtp": the multi-token prediction modules with
mtp_detach_heads) are left out of the reported gradient norm and clipped by their own.

A two-layer model whose second layer is tagged takes one SGD step (lr 1, no momentum)
from the global batch's gradient: the step reports the first layer's norm as grad_norm
and the second's under grad_norms_by_group, and each layer moves by its gradient clipped
by its own norm. One rank, plain and compiled, and two data-parallel ranks with the
distributed optimizer (whose shards cut a layer between ranks) or FSDP (each layer's
rows split) give the same.
"""

import pytest
import torch

import mp_state
from mp_ckpt import ShardedTensor
from mp_optim import (
    DistributedDataParallel,
    FullyShardedDataParallel,
    OptimizerConfig,
    get_optimizer,
)
from mp_state import ParallelConfig
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

CLIP = 0.05


class Toy(torch.nn.Sequential):
    """linear, tanh, linear; whole tensors in its checkpoint description (FSDP lays its
    shards out from it)."""

    def sharded_state_dict(self, prefix=""):
        whole = {f"{prefix}{n}": p for n, p in self.named_parameters()}
        return {
            k: ShardedTensor(k, p.data, tuple(p.shape), (0,) * p.dim()) for k, p in whole.items()
        }


def toy() -> Toy:
    torch.manual_seed(0)
    module = Toy(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    for param in module[2].parameters():
        param.grad_norm_group = "mtp"
    return module


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=generator), torch.randn(8, 4, generator=generator)


def expected() -> tuple[dict[str, torch.Tensor], float, float]:
    """The parameters after the step, computed by hand, and the two norms."""
    module = toy()
    x, y = batch()
    torch.nn.functional.mse_loss(module(x), y).backward()
    main = [p for n, p in module.named_parameters() if n.startswith("0.")]
    heads = [p for n, p in module.named_parameters() if n.startswith("2.")]
    norms = [float(torch.cat([p.grad.reshape(-1) for p in ps]).norm()) for ps in (main, heads)]
    after = {}
    for name, param in module.named_parameters():
        norm = norms[0] if name.startswith("0.") else norms[1]
        after[name] = param.detach() - param.grad * min(1.0, CLIP / (norm + 1e-6))
    return after, norms[0], norms[1]


def body(distributed: bool, compiled: bool, fsdp: bool = False):
    import mp_optim.optimizer

    torch.set_num_threads(1)
    state = mp_state.initialize(ParallelConfig())
    config = OptimizerConfig(optimizer="adam" if compiled else "sgd", lr=1.0, clip_grad=CLIP,
                             sgd_momentum=0.0, weight_decay=0.0,
                             use_distributed_optimizer=distributed, use_torch_fsdp2=fsdp,
                             torch_compile_optimizer=compiled, bucket_size=40)  # fmt: skip
    module = toy()
    if fsdp:  # each linear layer sharded over dp: the tag travels to the sharded parameters
        model = FullyShardedDataParallel(config, module, dp_group=state.dp,
                                         units=(torch.nn.Linear,))  # fmt: skip
    else:
        model = DistributedDataParallel(config, module, dp_group=state.dp)
    optimizer = get_optimizer(config, [model], mp_group=state.mp)
    seen = {}  # what the compiled update is given: each main parameter's gradient and scale
    real = mp_optim.optimizer.adamw_step

    def recording(torch_optimizer, views, scale, scales=None):
        for name, param in module.named_parameters():
            main = optimizer.shards[param][0].main_param
            seen[name] = (main.grad.clone(), (scales or {}).get(id(main), scale))
        return real(torch_optimizer, views, scale, scales)

    mp_optim.optimizer.adamw_step = recording
    x, y = batch()
    rows = slice(state.dp.rank * 8 // state.dp.size, (state.dp.rank + 1) * 8 // state.dp.size)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
    model.finish_grad_sync()
    grads = {} if fsdp else {n: p.main_grad.clone() for n, p in module.named_parameters()}
    result = optimizer.step()
    model.finish_param_sync()
    params = {n: (p.full_tensor() if fsdp else p).detach().clone()
              for n, p in module.named_parameters()}  # fmt: skip
    groups = optimizer.grad_norm_groups
    mp_optim.optimizer.adamw_step = real
    mp_state.destroy()
    return result, params, seen if compiled else grads, groups


@pytest.mark.parametrize(("world", "distributed", "fsdp"),
                         [(1, False, False), (2, True, False), (2, False, True)],
                         ids=["dp1", "dp2-dist", "dp2-fsdp"])  # fmt: skip
def test_a_separate_group_is_clipped_by_its_own_norm(world, distributed, fsdp):
    after, main_norm, head_norm = expected()
    assert head_norm > CLIP and main_norm > CLIP  # both clipped, by different factors
    for result, params, _, groups in run_on_ranks(body, world, distributed, False, fsdp,
                                                  timeout=90):  # fmt: skip
        assert groups == ["mtp"]
        assert result.grad_norm == pytest.approx(main_norm, rel=1e-5)
        assert result.grad_norms_by_group == {"mtp": pytest.approx(head_norm, rel=1e-5)}
        for name, want in after.items():
            torch.testing.assert_close(params[name], want, rtol=1e-5, atol=1e-6, msg=name)


def test_the_compiled_update_scales_only_the_main_gradients():
    """torch_compile_optimizer applies the main norm's clipping inside the update: it is
    given the main gradients unclipped with that scale, and the group's clipped already,
    with scale 1."""
    result, _, seen, _ = run_on_ranks(body, 1, False, True, timeout=180)[0]
    _, main_norm, head_norm = expected()
    assert result.grad_norm == pytest.approx(main_norm, rel=1e-5)
    assert result.grad_norms_by_group["mtp"] == pytest.approx(head_norm, rel=1e-5)
    norms = {}
    for name, (grad, scale) in seen.items():
        layer = name.split(".")[0]
        want = CLIP / (main_norm + 1e-6) if layer == "0" else 1.0
        assert scale == pytest.approx(want, rel=1e-6), name
        norms[layer] = norms.get(layer, 0.0) + float(grad.square().sum())
    assert norms["0"] ** 0.5 == pytest.approx(main_norm, rel=1e-5)  # as reduced
    assert norms["2"] ** 0.5 == pytest.approx(CLIP, rel=1e-4)  # clipped by its own norm


def test_an_unknown_group_is_refused():
    from mp_optim.grad_norm_groups import grad_norm_group

    param = torch.nn.Parameter(torch.zeros(2))
    param.grad_norm_group = "vision"
    message = r"^decoder\.w: grad_norm_group='vision': the optimizer clips apart only mtp"
    with pytest.raises(ValueError, match=message):
        grad_norm_group(param, "decoder.w")
