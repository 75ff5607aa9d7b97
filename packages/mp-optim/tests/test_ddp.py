"""DDP behaviour: overlapped reductions start during the backward, no_sync accumulates,
average_in_collective, check_for_nan_in_grad, and the overlapped parameter gather."""

import contextlib
import gc
import weakref

import pytest
import torch
import torch.distributed as dist

import mp_state
from mp_optim import DistributedDataParallel, OptimizerConfig, get_optimizer
from mp_state import ParallelConfig
from mp_state.testing import RankFailure, run_on_ranks

pytestmark = pytest.mark.multirank


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def overlap_body():
    torch.set_num_threads(1)
    state = mp_state.initialize(ParallelConfig())
    config = OptimizerConfig(lr=0.1, overlap_grad_reduce=True, bucket_size=10)
    model = DistributedDataParallel(config, make_model(), dp_group=state.dp)
    seen = {}
    x = torch.full((2, 8), float(dist.get_rank() + 1))
    with model.no_sync():
        model(x).sum().backward()
    seen["launched_under_no_sync"] = len(model._grad_work)

    # When the gradient reaches the first layer's output, the last layer's bucket is
    # complete and started; the first layer's buckets are not.
    def record(grad):
        seen["launched_mid_backward"] = len(model._grad_work)

    model.module[0].register_forward_hook(lambda m, i, out: out.register_hook(record) and None)
    model(x).sum().backward()
    seen["buckets"] = len(model.buckets)
    seen["launched_after_backward"] = len(model._grad_work)
    model.finish_grad_sync()
    # Two micro-batches of inputs 1 and 2 on rank 0, 2 and 2... averaged over ranks.
    seen["bias_grad"] = model.module[2].bias.main_grad.clone()
    mp_state.destroy()
    dist.barrier()
    return seen


def test_overlap_starts_buckets_during_the_backward():
    results = run_on_ranks(overlap_body, 2, timeout=60)
    for seen in results:
        assert seen["buckets"] >= 3
        assert seen["launched_under_no_sync"] == 0
        assert 1 <= seen["launched_mid_backward"] < seen["buckets"]
        assert seen["launched_after_backward"] == seen["buckets"]
        # d(sum of outputs)/d(last bias) = batch size 2 per backward, 2 backwards, averaged.
        torch.testing.assert_close(seen["bias_grad"], torch.full((4,), 4.0))


def average_body(average_in_collective: bool):
    torch.set_num_threads(1)
    state = mp_state.initialize(ParallelConfig())
    config = OptimizerConfig(lr=0.1, average_in_collective=average_in_collective)
    model = DistributedDataParallel(config, make_model(), dp_group=state.dp)
    x = torch.full((1, 8), float(dist.get_rank()))
    model(x).sum().backward()
    model.finish_grad_sync()
    grads = [p.main_grad.clone() for p in model.module.parameters()]
    mp_state.destroy()
    dist.barrier()
    return grads


def test_average_in_collective_equals_scaling_then_summing():
    scaled = run_on_ranks(average_body, 4, False, timeout=60)
    averaged = run_on_ranks(average_body, 4, True, timeout=60)
    for a, b in zip(scaled[0], averaged[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # The mean over ranks of inputs 0..3 times the weights, not any one rank's gradient.
    torch.testing.assert_close(scaled[0][-1], torch.ones(4))


def nan_body():
    torch.set_num_threads(1)
    state = mp_state.initialize(ParallelConfig())
    config = OptimizerConfig(lr=0.1, check_for_nan_in_grad=True)
    model = DistributedDataParallel(config, make_model(), dp_group=state.dp)
    value = float("nan") if dist.get_rank() == 1 else 1.0
    model(torch.full((1, 8), value)).sum().backward()
    model.finish_grad_sync()


def test_check_for_nan_in_grad_names_the_rank_group_and_parameter():
    message = r"rank 1: non-finite gradient .* reduction over dp in .*0\.weight"
    with pytest.raises(RankFailure, match=message):
        run_on_ranks(nan_body, 2, timeout=30)


def gather_body(overlap_param_gather: bool):
    torch.set_num_threads(1)
    state = mp_state.initialize(ParallelConfig())
    config = OptimizerConfig(
        lr=0.1, use_distributed_optimizer=True, overlap_param_gather=overlap_param_gather,
        bucket_size=40,
    )  # fmt: skip
    model = DistributedDataParallel(config, make_model(), dp_group=state.dp)
    optimizer = get_optimizer(config, [model], mp_group=state.mp)
    outputs = []
    x = torch.ones(2, 8)
    for _ in range(3):
        optimizer.zero_grad()
        out = model(x)
        outputs.append(out.detach().clone())
        out.sum().backward()
        model.finish_grad_sync()
        optimizer.step()
        in_flight = len(model._param_work)
    outputs.append(model(x).detach().clone())
    mp_state.destroy()
    dist.barrier()
    return outputs, in_flight


def bf16_reduce_body(grad_reduce_in_bf16: bool, distributed: bool):
    """Two steps of a bf16 model (rank-dependent inputs); the buffers' dtype and outputs."""
    torch.set_num_threads(1)
    state = mp_state.initialize(ParallelConfig())
    config = OptimizerConfig(lr=0.1, bf16=True, grad_reduce_in_bf16=grad_reduce_in_bf16,
                             use_distributed_optimizer=distributed)  # fmt: skip
    model = DistributedDataParallel(config, make_model().bfloat16(), dp_group=state.dp)
    optimizer = get_optimizer(config, [model], mp_group=state.mp)
    x = torch.linspace(-1, 1, 16).view(2, 8).bfloat16() * (dist.get_rank() + 1)
    for _ in range(2):
        optimizer.zero_grad()
        model(x).float().square().sum().backward()
        model.finish_grad_sync()
        optimizer.step()
    out = model(x).detach().float()
    mp_state.destroy()
    dist.barrier()
    return {str(b.grad_dtype) for b in model.buffers}, out


@pytest.mark.parametrize("distributed", [False, True])
def test_grad_reduce_in_bf16_reduces_bf16_gradients_under_ddp(distributed):
    # Megatron's --grad-reduce-in-bf16 with DDP or the distributed optimizer: the gradient
    # buffers (accumulated and reduced) are bf16; the fp32 main parameters step from them.
    fp32 = run_on_ranks(bf16_reduce_body, 2, False, distributed, timeout=60)
    bf16 = run_on_ranks(bf16_reduce_body, 2, True, distributed, timeout=60)
    assert fp32[0][0] == {"torch.float32"} and bf16[0][0] == {"torch.bfloat16"}
    for rank in (0, 1):
        torch.testing.assert_close(bf16[rank][1], fp32[rank][1], rtol=2e-2, atol=2e-2)


def test_overlapped_parameter_gather_equals_the_synchronous_one():
    sync = run_on_ranks(gather_body, 2, False, timeout=60)
    overlapped = run_on_ranks(gather_body, 2, True, timeout=60)
    assert sync[0][1] == 0 and overlapped[0][1] > 0  # gathers left running after the step
    for a, b in zip(sync[0][0], overlapped[0][0], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(sync[0][0][0], sync[0][0][-1])  # the steps changed the model


def test_gradients_accumulate_over_micro_batches_from_a_zeroed_buffer():
    """bf16 parameters, fp32 buffer: the first gradient after zero_grad_buffer is copied,
    later ones added; a parameter with no gradient stays zero; nothing survives a zero."""
    one = mp_state.RankGroup("dp", (0,), 0, None)

    class WithUnused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net, self.unused = make_model().bfloat16(), torch.nn.Linear(2, 2).bfloat16()

        def forward(self, x):
            return self.net(x)

    module = WithUnused()
    net = module.net
    reference = [p.detach().clone().requires_grad_() for p in net[0].parameters()]
    config = OptimizerConfig(lr=0.1, bf16=True, accumulate_allreduce_grads_in_fp32=True)
    model = DistributedDataParallel(config, module, dp_group=one)
    assert all(b.grad_dtype == torch.float32 for b in model.buffers)
    inputs = [torch.randn(2, 8, dtype=torch.bfloat16) for _ in range(3)]

    def expected(batches):
        total = [torch.zeros_like(p, dtype=torch.float32) for p in reference]
        for x in batches:
            out = torch.nn.functional.linear(x, *reference)
            grads = torch.autograd.grad(net[2](net[1](out)).sum(), reference)
            total = [t + g.float() for t, g in zip(total, grads, strict=True)]
        return total

    for round_ in range(2):
        model.zero_grad_buffer()
        batches = inputs if round_ == 0 else inputs[:1]
        for i, x in enumerate(batches):
            with model.no_sync() if i < len(batches) - 1 else contextlib.nullcontext():
                model(x).sum().backward()
        model.finish_grad_sync()
        got = [p.main_grad for p in net[0].parameters()]
        for g, e in zip(got, expected(batches), strict=True):
            torch.testing.assert_close(g, e)
        assert all(not p.main_grad.any() for p in module.unused.parameters())


def unused_here_body():
    """A parameter with a gradient on rank 1 only: after the reduction rank 0 holds rank 1's
    half; without zero_grad_buffer() a later gradient on rank 0 adds to it."""
    torch.set_num_threads(1)
    state = mp_state.initialize(ParallelConfig())
    model = DistributedDataParallel(OptimizerConfig(lr=0.1), make_model(), dp_group=state.dp)
    bias = model.module[2].bias
    x = torch.ones(2, 8)
    if dist.get_rank() == 1:
        model(x).sum().backward()  # rank 0 runs no backward at all
    model.finish_grad_sync()
    reduced = bias.main_grad.clone()  # rank 1's gradient / 2 on both ranks
    model(x).sum().backward()
    model.finish_grad_sync()
    mp_state.destroy()
    dist.barrier()
    return reduced, bias.main_grad.clone()


def test_a_reduced_buffer_is_added_to_until_it_is_zeroed():
    per_rank = run_on_ranks(unused_here_body, 2, timeout=60)
    (reduced0, after0), (reduced1, after1) = per_rank
    torch.testing.assert_close(reduced0, reduced1)
    own = 2 * reduced1  # one backward's bias gradient (both ranks see the same inputs)
    # Second round: each rank adds its own gradient, the sum is averaged again.
    torch.testing.assert_close(after0, (reduced0 + own + reduced1 + own) / 2)
    torch.testing.assert_close(after0, after1)


def test_a_wrapped_model_is_freed_when_the_last_reference_goes():
    """The gradient hooks hold the wrapper weakly: a model built twice in one process (the
    benchmarks do) no longer keeps the first one, its buffers and its GPU memory."""
    module = make_model()
    model = DistributedDataParallel(OptimizerConfig(lr=0.1), module,
                                    dp_group=mp_state.RankGroup("dp", (0,), 0, None))  # fmt: skip
    model(torch.randn(2, 8)).sum().backward()
    model.finish_grad_sync()
    assert all(p.main_grad.any() for p in module.parameters())
    dropped = weakref.ref(module)
    del model, module
    gc.collect()
    assert dropped() is None
