"""On a GPU: apps/gpt trains in bf16 under torchrun with NCCL, from weights drawn on the
GPU (--use-device-initialization; the suite's smoke step trains from CPU draws), and
saves; generation from that checkpoint on CUDA gives the greedy tokens it gives on the
CPU (both in fp32: the generator takes the model's settings, not the run's precision,
from a checkpoint). The same for a Mamba-hybrid model (its plain-torch scan, and its
states in the cache, on CUDA)."""

import math

import pytest

from mp_gpt.testing import HYBRID_OPTIONS, greedy_on_rank, metrics_records, tiny_options
from mp_state.testing import TorchrunJob, run_on_ranks


@pytest.mark.cuda
@pytest.mark.parametrize("model", [(), HYBRID_OPTIONS], ids=["gpt", "hybrid"])
def test_train_bf16_under_torchrun_then_generate_on_cuda(tmp_path, model):
    checkpoint = tmp_path / "checkpoints"
    # The CUDA-only paths of two Megatron flags ride along: the caching allocator emptied
    # at every point (--empty-unused-memory-level 2), bf16 matmuls without reduced-precision
    # reductions.
    options = tiny_options(tmp_path, "--bf16", "--use-device-initialization",
                           "--save", str(checkpoint), "--empty-unused-memory-level", "2",
                           "--disable-bf16-reduced-precision-matmul", *model)  # fmt: skip
    with TorchrunJob(["-m", "mp_gpt.pretrain", *options], tmp_path, nproc=1,
                     device="cuda") as job:  # fmt: skip
        job.wait(timeout=300)
    assert job.returncode == 0, job.output()[-4000:]
    assert "backend nccl, device cuda:0" in job.output()
    losses = [record["lm loss"] for record in metrics_records(tmp_path)]
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses), losses
    # Weights drawn at std 0.02 predict about uniformly: the first loss is near ln(vocab).
    assert abs(losses[0] - math.log(1024)) < 0.5, losses

    prompts, new = [[1, 2, 3], [7]], 12
    [on_cuda] = run_on_ranks(greedy_on_rank, 1, str(checkpoint), [], prompts, new,
                             device="cuda", timeout=300)  # fmt: skip
    [on_cpu] = run_on_ranks(greedy_on_rank, 1, str(checkpoint), [], prompts, new, timeout=120)
    assert [len(tokens) for tokens in on_cuda] == [new, new]
    assert on_cuda == on_cpu
