"""GPT through the pipeline schedules equals no pipelining over the same global batch.

The Llama-style model of mp-layers at PP 2, PP 4 and PP 2 x VPP 2, and at
PP 2 x TP 2 x DP 2 on 8 ranks; the GPT-2-style model (embeddings tied across
the first and last stage) at PP 2 and at PP 2 x TP 2 x DP 2 with sequence
parallelism. Each layout wraps its chunks in mp_optim's DDP and finalizes
with finalize_model_grads; its gathered gradients (by logical name) and its
losses must equal forward_backward_no_pipelining of the whole model (fp32,
1e-5 relative).
"""

import functools

import pytest
import torch
import torch.distributed as dist

import mp_state
from mp_ckpt import ShardedTensor, assemble
from mp_layers import GPTModel, ModelGroups, TransformerConfig
from mp_optim import DistributedDataParallel, OptimizerConfig
from mp_pipeline import (
    PipelineConfig,
    finalize_model_grads,
    forward_backward_no_pipelining,
    get_forward_backward_func,
    stage_layers,
)
from mp_state import ParallelConfig, RankGroup
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

VOCAB, SEQ, BATCH, HIDDEN, LAYERS = 64, 8, 2, 32, 4
STYLES = {
    "llama": dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4,
                  num_query_groups=2, position_embedding_type="rope", normalization="RMSNorm",
                  activation="swiglu", ffn_hidden_size=48, add_bias_linear=False,
                  untie_embeddings_and_output_weights=True),
    "gpt2": dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4),
}  # fmt: skip
SINGLE = RankGroup("single", (0,), 0, None)


def transformer_config(style: str, sequence_parallel: bool = False) -> TransformerConfig:
    return TransformerConfig(**STYLES[style], hidden_dropout=0.0, attention_dropout=0.0,
                             sequence_parallel=sequence_parallel)  # fmt: skip


def micro_batches(n: int):
    generator = torch.Generator().manual_seed(7)
    ids = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator) for _ in range(n)]
    return [(i, torch.roll(i, -1, dims=1)) for i in ids]


def forward_step(data_iterator, model):
    ids, labels = next(data_iterator)

    def loss_func(per_token):
        loss = per_token.mean()
        return loss, {"loss": loss.detach()}

    return model(ids, labels=labels), loss_func


def grad_pieces(model: torch.nn.Module) -> list[ShardedTensor]:
    """The model's sharding description laid over its gradients (.main_grad under DDP)."""
    params = list(model.parameters())
    grads = [p.main_grad if hasattr(p, "main_grad") else p.grad for p in params]
    saved = [p.data for p in params]
    for p, g in zip(params, grads, strict=True):
        p.data = g
    try:
        return [ShardedTensor(v.key, v.data.detach().clone(), v.global_shape, v.global_offset,
                              v.replica_id)
                for v in model.sharded_state_dict().values()]  # fmt: skip
    finally:
        for p, d in zip(params, saved, strict=True):
            p.data = d


def whole_model(style: str) -> GPTModel:
    torch.manual_seed(0)
    return GPTModel(transformer_config(style), "local", VOCAB, SEQ, groups=ModelGroups.single())


def reference(style: str, m: int):
    model = whole_model(style)
    losses = forward_backward_no_pipelining(
        forward_step_func=forward_step, data_iterator=iter(micro_batches(m)), model=model,
        num_microbatches=m, config=PipelineConfig(),
    )  # fmt: skip
    return [r["loss"] for r in losses], assemble(grad_pieces(model))


def layout_body(style: str, tp: int, pp: int, vpp: int | None, m: int, sequence_parallel: bool):
    torch.set_num_threads(1)
    state = mp_state.initialize(ParallelConfig(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
    ))  # fmt: skip
    config = transformer_config(style, sequence_parallel)
    logical = {k: p.data for k, p in whole_model(style).sharded_state_dict().items()}
    optim_config = OptimizerConfig(lr=0.1, overlap_grad_reduce=True, bucket_size=2000)
    chunks = []
    for vp_stage in range(vpp or 1):
        where = stage_layers(
            LAYERS, pp, state.pp.rank, virtual_pipeline_model_parallel_size=vpp, vp_stage=vp_stage
        )
        stage = GPTModel(
            config, "local", VOCAB, SEQ, groups=ModelGroups.of(state),
            pre_process=where.pre_process,
            post_process=where.post_process, layer_offset=where.offset, num_layers=where.count,
        )  # fmt: skip
        with torch.no_grad():
            for key, piece in stage.sharded_state_dict().items():
                if piece.replica_id == 0 or not key.startswith("embedding.word"):
                    piece.data.copy_(logical[key][piece.global_slices])
        tied_across_stages = pp > 1 and style == "gpt2"
        if tied_across_stages and (where.pre_process or where.post_process):
            stage.sync_tied_embeddings(state.embedding)
        chunks.append(DistributedDataParallel(optim_config, stage, dp_group=state.dp))
    dp = state.dp
    mine = micro_batches(dp.size * m)[dp.rank * m : (dp.rank + 1) * m]
    pipeline_config = PipelineConfig(
        seq_length=SEQ, micro_batch_size=BATCH, hidden_size=HIDDEN,
        tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
        no_sync_func=[c.no_sync for c in chunks],
        finalize_model_grads_func=functools.partial(finalize_model_grads, state=state),
    )  # fmt: skip
    losses = get_forward_backward_func(pp, vpp)(
        forward_step_func=forward_step, data_iterator=[iter(mine) for _ in chunks],
        model=chunks, num_microbatches=m, config=pipeline_config, pp_group=state.pp,
    )  # fmt: skip
    pieces = [p for c in chunks for p in grad_pieces(c.module)] if dp.rank == 0 else []
    reported = [r["loss"] for r in losses] if state.tp.rank == 0 else []
    result = {"losses": reported, "pieces": pieces, "dp": dp.rank}
    mp_state.destroy()
    dist.barrier()
    return result


LAYOUTS = [
    ("llama", 1, 2, None, 4, False), ("llama", 1, 4, None, 4, False),
    ("llama", 1, 2, 2, 4, False), ("llama", 2, 2, None, 2, False),
    ("gpt2", 1, 2, None, 3, False), ("gpt2", 2, 2, None, 2, True),
]  # fmt: skip


@pytest.mark.parametrize(
    "style,tp,pp,vpp,m,sequence_parallel", LAYOUTS,
    ids=[f"{s}-tp{t}-pp{p}-vpp{v}-m{m}{'-sp' if sp else ''}" for s, t, p, v, m, sp in LAYOUTS],
)  # fmt: skip
def test_pipeline_equals_no_pipelining(style, tp, pp, vpp, m, sequence_parallel):
    dp = 2 if tp == 2 else 1
    world = tp * pp * dp
    want_losses, want_grads = reference(style, dp * m)
    results = run_on_ranks(layout_body, world, style, tp, pp, vpp, m, sequence_parallel,
                           timeout=240)  # fmt: skip
    got_grads = assemble(p for r in results for p in r["pieces"])
    assert set(got_grads) == set(want_grads)
    for key, want in want_grads.items():
        # The keys' bias has a zero gradient in exact arithmetic (softmax ignores a shift
        # common to all keys; here about 1e-11): a floor of 1e-5 keeps its noise out.
        error = float((got_grads[key] - want).norm() / (want.norm() + 1e-5))
        assert error < 1e-5, f"{key}: gradients differ by {error:.2e} relative"
    # Last stages (tensor-parallel rank 0) report; dp rank d had micro-batches d*m .. d*m+m-1.
    got_losses = [loss for r in sorted(results, key=lambda r: r["dp"]) for loss in r["losses"]]
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-5, atol=1e-6)
