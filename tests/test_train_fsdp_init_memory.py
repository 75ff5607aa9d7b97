"""Under ZeRO-3 with --init-model-with-meta-device a rank never holds the whole model: each
transformer layer is sharded as soon as it is built, and its parallel linear weights are
never allocated whole: they are created on the meta device and each rank draws only its
shard's rows (mp_layers.tensor_parallel.deferred_init). So one more layer raises the
rank's peak memory by what it keeps of the layer (its parameter and gradient shards), and
no allocation while the layers are built is larger than the largest parameter shard.
Measured with torch's profiler (every CPU tensor allocation and free while `setup_run`
builds and wraps the model) on data-parallel rank 0 of four, for the tiny config at 8 and
16 layers, with and without the flag, at DP2 x TP2, and on the tiny MoE config at EP2
(the experts and the router drawn shard by shard too). The embedding and output layer
are drawn shard by shard too, on one pipeline stage and across two (untied, and tied
with a multi-token prediction layer: the last stage's copy drawn as the first stage's
embedding). The weights are the same either
way (bitwise, shard by shard), and so is the generator afterwards. Training under the
flag, against DDP: tests/test_train_fsdp.py."""

import os

import pytest
import torch

from mp_gpt.testing import tiny_moe_options, tiny_options
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

ZERO3 = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
BY_LAYER = ["--init-model-with-meta-device"]


def measure(fn):
    """fn()'s result; the most bytes of CPU tensors it had allocated at once; the bytes
    still allocated at its end; and the largest allocation of one operator inside a
    "build the model" range."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()

    # An operator's event carries what it allocated itself; "[memory]" events the frees.
    def change(e):
        return e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage

    events = list(prof.events())
    changes = sorted((e.time_range.start, change(e)) for e in events)
    live = peak = 0
    for _, delta in changes:
        live += delta
        peak = max(peak, live)
    building = [e.time_range for e in events if e.name == "build the model"]
    largest = max(e.self_cpu_memory_usage for e in events if e.name != "[memory]"
                  and any(r.start <= e.time_range.start <= r.end for r in building))  # fmt: skip
    return result, peak, live, largest


def build_on_rank(argv: list[str]) -> dict:
    torch.set_num_threads(1)
    os.environ.setdefault("MP_RUN_DIR", "/nonexistent")
    from mp_gpt.gpt import model_provider
    from mp_train import parse_config
    from mp_train.loop.setup import initialize, setup_run

    def provider(**kwargs):
        with torch.profiler.record_function("build the model"):
            return model_provider(**kwargs)

    config = parse_config(argv)
    initialized = initialize(config)
    run, peak, kept, largest = measure(lambda: setup_run(config, provider, initialized))
    params = list(run.model[0].parameters())
    module = run.model[0].module
    # The word embedding, or the last stage's copy of it (tied output layer, MTP).
    copy = getattr(module, "embedding", None)
    if copy is None and module.share_embeddings_and_output_weights:
        copy = module.output_layer
    return {
        "stage": (run.state.pp.rank, run.state.dp.rank),
        "embedding": None if copy is None else copy.weight.to_local().detach().clone(),
        "peak": peak,
        "kept": kept,  # the shards of the parameters and their gradients
        "whole": sum(p.numel() for p in params) * 4,  # fp32, the unsharded sizes
        "shards": torch.cat([p.to_local().detach().reshape(-1) for p in params]),
        "generator": torch.get_rng_state(),
        "largest": largest,  # one operator's allocation while the model is built
        "largest_shard": max(p.to_local().numel() for p in params) * 4,
        "largest_weight": max(p.numel() for p in params) * 4,  # unsharded
    }


def test_a_rank_holds_one_layer_shard_at_most_while_the_model_is_built(tmp_path):
    built = {}
    for name, layers, flags in (("whole", 8, []), ("by-layer", 8, BY_LAYER),
                                ("by-layer", 16, BY_LAYER)):  # fmt: skip
        argv = tiny_options(tmp_path, "--num-layers", str(layers), *ZERO3, *flags)
        built[name, layers] = run_on_ranks(build_on_rank, 4, argv, timeout=200)[0]
    whole, by_layer = built["whole", 8], built["by-layer", 8]
    assert torch.equal(by_layer["shards"], whole["shards"])
    assert torch.equal(by_layer["generator"], whole["generator"])
    # Built whole, the largest weight is drawn whole; under the flag no allocation while
    # the model is built exceeds the largest parameter's shard.
    assert whole["largest"] >= whole["largest_weight"], whole
    for count in (8, 16):
        seen = built["by-layer", count]
        assert seen["largest"] <= seen["largest_shard"] < seen["largest_weight"], seen
    # Built whole, the model is all there at once (the measure sees it) ...
    assert whole["peak"] >= whole["whole"], whole
    # ... built and sharded layer by layer, eight more layers raise the peak by what the
    # rank keeps of them alone: a quarter of their parameters and as much gradient (10%
    # for the profiler's attribution of allocations to operators).
    more = {k: built["by-layer", 16][k] - by_layer[k] for k in ("peak", "whole", "kept")}
    assert more["kept"] == pytest.approx(more["whole"] / 2, rel=1e-3), more
    assert more["peak"] <= 1.1 * more["kept"], more
    assert built["by-layer", 16]["peak"] < 0.75 * built["by-layer", 16]["whole"], built


def built_both_ways(argv: list[str]) -> dict[str, list[dict]]:
    """Each rank's build_on_rank of `argv` whole and with BY_LAYER, on four ranks, checked
    alike: the shards and the generator afterwards bitwise the same, no allocation of the
    by-layer build above the largest parameter shard, and the whole build allocating a
    whole weight (so that the measure sees what it should)."""
    built = {name: run_on_ranks(build_on_rank, 4, [*argv, *flags], timeout=200)
             for name, flags in (("whole", []), ("by-layer", BY_LAYER))}  # fmt: skip
    for rank, (whole, by_layer) in enumerate(zip(built["whole"], built["by-layer"], strict=True)):
        assert torch.equal(by_layer["shards"], whole["shards"]), rank
        assert torch.equal(by_layer["generator"], whole["generator"]), rank
        assert by_layer["largest"] <= by_layer["largest_shard"], (rank, by_layer)
        assert whole["largest"] >= whole["largest_weight"], (rank, whole)
    return built


LAYOUTS = {
    "dp2-tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "dp2-pp2-untied": ["--pipeline-model-parallel-size", "2",
                       "--untie-embeddings-and-output-weights"],
    "dp2-pp2-tied-mtp": ["--pipeline-model-parallel-size", "2", "--mtp-num-layers", "1"],
}  # fmt: skip


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_model_parallel_shards_are_drawn_as_the_whole_weights(tmp_path, layout):
    """DP2 x TP2 with sequence parallelism; DP2 x PP2 with untied embeddings (the first
    stage's embedding and the last stage's output layer drawn shard by shard); and DP2 x
    PP2 with tied embeddings and a multi-token prediction layer (the last stage's copy of
    the embedding, which its MTP layer and tied output layer use, drawn shard by shard
    from the embedding's seeded draw): each rank's shards of its pieces (column-parallel
    rows, row-parallel columns, the gated MLP's reordered rows) equal the whole build's,
    bitwise, the generator ends in the same state, no allocation while the model is built
    exceeds the largest parameter shard, and the last stage's copy of the embedding is
    the first stage's, shard for shard."""
    built = built_both_ways(tiny_options(tmp_path, "--num-layers", "2", *LAYOUTS[layout],
                                         *ZERO3))  # fmt: skip
    if layout == "dp2-pp2-tied-mtp":
        copies = {r["stage"]: r["embedding"] for r in built["by-layer"]}
        for dp in (0, 1):
            assert torch.equal(copies[1, dp], copies[0, dp]), dp


def test_moe_expert_shards_are_drawn_as_the_whole_weights(tmp_path):
    """The tiny MoE config at EP2 on four ranks (each rank's two experts sharded over
    expert dp 2: one expert per rank): each rank's shards of the experts (drawn expert by
    expert), the router and the dense weights equal the whole build's, bitwise, the
    generator ends in the same state, and no allocation while the model is built exceeds
    the largest parameter shard (built whole, a rank stacks its two experts' weights)."""
    built_both_ways(tiny_moe_options(tmp_path, "--num-layers", "2",
                                     "--expert-model-parallel-size", "2", *ZERO3))  # fmt: skip
