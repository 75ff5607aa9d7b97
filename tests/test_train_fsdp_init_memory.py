"""Under ZeRO-3 with --init-model-with-meta-device a rank never holds the whole model: each
transformer layer is sharded as soon as it is built, so one more layer raises the rank's
peak memory by what it keeps of the layer (its parameter and gradient shards), not by the
layer. Measured with torch's profiler (every CPU tensor allocation and free while
`setup_run` builds and wraps the model) on data-parallel rank 0 of four, for the tiny
config at 8 and 16 layers, with and without the flag. The weights are the same either way
(bitwise, shard by shard). Training under the flag, against DDP: tests/test_train_fsdp.py."""

import os

import pytest
import torch

from mp_gpt.testing import tiny_options
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

ZERO3 = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
BY_LAYER = ["--init-model-with-meta-device"]


def peak_while(fn):
    """fn()'s result, the most bytes of CPU tensors it had allocated at once, and the bytes
    still allocated at its end."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()

    # An operator's event carries what it allocated itself; "[memory]" events the frees.
    def change(e):
        return e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage

    changes = sorted((e.time_range.start, change(e)) for e in prof.events())
    live = peak = 0
    for _, delta in changes:
        live += delta
        peak = max(peak, live)
    return result, peak, live


def build_on_rank(argv: list[str]) -> dict:
    torch.set_num_threads(1)
    os.environ.setdefault("MP_RUN_DIR", "/nonexistent")
    from mp_gpt.gpt import model_provider
    from mp_train import parse_config
    from mp_train.loop.setup import initialize, setup_run

    config = parse_config(argv)
    initialized = initialize(config)
    run, peak, kept = peak_while(lambda: setup_run(config, model_provider, initialized))
    params = list(run.model[0].parameters())
    return {
        "peak": peak,
        "kept": kept,  # the shards of the parameters and their gradients
        "whole": sum(p.numel() for p in params) * 4,  # fp32, the unsharded sizes
        "shards": torch.cat([p.to_local().detach().reshape(-1) for p in params]),
    }


def test_a_rank_holds_one_layer_whole_at_most_while_the_model_is_built(tmp_path):
    built = {}
    for name, layers, flags in (("whole", 8, []), ("by-layer", 8, BY_LAYER),
                                ("by-layer", 16, BY_LAYER)):  # fmt: skip
        argv = tiny_options(tmp_path, "--num-layers", str(layers), "--peak-tflops", "1",
                            *ZERO3, *flags)  # fmt: skip
        built[name, layers] = run_on_ranks(build_on_rank, 4, argv, timeout=200)[0]
    whole, by_layer = built["whole", 8], built["by-layer", 8]
    assert torch.equal(by_layer["shards"], whole["shards"])
    # Built whole, the model is all there at once (the measure sees it) ...
    assert whole["peak"] >= whole["whole"], whole
    # ... built and sharded layer by layer, eight more layers raise the peak by what the
    # rank keeps of them alone: a quarter of their parameters and as much gradient (10%
    # for the profiler's attribution of allocations to operators).
    more = {k: built["by-layer", 16][k] - by_layer[k] for k in ("peak", "whole", "kept")}
    assert more["kept"] == pytest.approx(more["whole"] / 2, rel=1e-3), more
    assert more["peak"] <= 1.1 * more["kept"], more
    assert built["by-layer", 16]["peak"] < 0.75 * built["by-layer", 16]["whole"], built
