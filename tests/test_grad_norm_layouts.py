"""The optimizer's global gradient norm of one GPT model is the same at every layout.

TP 1 and 2, PP 1 and 2 (embeddings tied across the first and last stage), and
TP 2 x PP 2: the replicas that the model's sharding description names (layer
norms on tensor-parallel ranks > 0, the last stage's copy of the embedding)
must not be counted twice. The pipeline is run by hand for one micro-batch:
stage 0's output is sent to stage 1 and its input gradient sent back.
"""

import pytest
import torch
import torch.distributed as dist

import mp_state
from mp_layers import GPTModel, ModelGroups, TransformerConfig, all_reduce_sequence_parallel_grads
from mp_optim import DistributedDataParallel, OptimizerConfig, get_optimizer
from mp_state import ParallelConfig, RankGroup
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

VOCAB, SEQ, BATCH, HIDDEN = 64, 8, 2, 32
MODEL = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, hidden_dropout=0.0,
             attention_dropout=0.0)  # fmt: skip
SINGLE = RankGroup("single", (0,), 0, None)


def batch():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return ids, torch.roll(ids, -1, dims=1)


def whole_model() -> GPTModel:
    torch.manual_seed(0)
    return GPTModel(TransformerConfig(**MODEL), "local", VOCAB, SEQ, groups=ModelGroups.single())


def reference_norm() -> float:
    model = whole_model()
    ids, labels = batch()
    model(ids, labels=labels).mean().backward()
    return float(torch.sqrt(sum(p.grad.square().sum() for p in model.parameters())))


def layout_body(tp: int, pp: int, distributed: bool, sequence_parallel: bool = False):
    torch.set_num_threads(1)
    state = mp_state.initialize(
        ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    )
    first, last = state.is_pipeline_first_stage(), state.is_pipeline_last_stage()
    whole = whole_model()
    config = TransformerConfig(**MODEL, sequence_parallel=sequence_parallel)
    stage = GPTModel(
        config, "local", VOCAB, SEQ, groups=ModelGroups.of(state), pre_process=first,
        post_process=last,
        layer_offset=state.pp.rank * (2 // pp), num_layers=2 // pp,
    )  # fmt: skip
    logical = {k: p.data for k, p in whole.sharded_state_dict().items()}
    with torch.no_grad():
        for key, piece in stage.sharded_state_dict().items():
            piece.data.copy_(logical[key][piece.global_slices])
    config = OptimizerConfig(lr=0.1, clip_grad=1e9, use_distributed_optimizer=distributed)
    model = DistributedDataParallel(config, stage, dp_group=state.dp)
    optimizer = get_optimizer(config, [model], mp_group=state.mp)

    ids, labels = batch()
    shape = (SEQ, BATCH, HIDDEN)
    if pp == 1:
        model(ids, labels=labels).mean().backward()
    elif first:
        hidden = model(ids)
        dist.send(hidden.detach().contiguous(), dst=state.pp.ranks[1])
        grad = torch.empty(shape)
        dist.recv(grad, src=state.pp.ranks[1])
        hidden.backward(grad)
    else:
        hidden = torch.empty(shape)
        dist.recv(hidden, src=state.pp.ranks[0])
        hidden.requires_grad_(True)
        model(None, labels=labels, decoder_input=hidden).mean().backward()
        dist.send(hidden.grad.contiguous(), dst=state.pp.ranks[0])
    model.finish_grad_sync()
    all_reduce_sequence_parallel_grads(stage, state.tp)  # norms' partial sums, in .main_grad
    if pp > 1:  # the pipeline's finalize step: sum the tied embedding's two gradients
        tied = stage.embedding.weight if first else stage.output_layer.weight
        dist.all_reduce(tied.main_grad, group=state.embedding.group)
    norm = optimizer.step().grad_norm
    mp_state.destroy()
    dist.barrier()
    return norm


@pytest.mark.parametrize(
    "tp,pp,distributed,sequence_parallel",
    [
        (1, 1, False, False), (2, 1, False, False), (1, 2, False, False), (2, 2, False, False),
        (1, 1, True, False), (2, 1, False, True),
    ],
    ids=["tp1-pp1", "tp2", "pp2", "tp2-pp2", "dp2-distributed", "tp2-sequence-parallel"],
)  # fmt: skip
def test_same_grad_norm_at_every_layout(tp, pp, distributed, sequence_parallel):
    want = reference_norm()
    world = tp * pp * (2 if distributed else 1)
    norms = run_on_ranks(layout_body, world, tp, pp, distributed, sequence_parallel, timeout=120)
    for rank, norm in enumerate(norms):
        assert norm == pytest.approx(want, rel=1e-5), f"rank {rank}: {norm} against {want}"


def test_counting_replicas_twice_would_show():
    """Without the replica rule, TP 2 would count the layer norms twice: a distinct norm."""
    model = whole_model()
    ids, labels = batch()
    model(ids, labels=labels).mean().backward()
    norms = [p.grad.square().sum() for n, p in model.named_parameters() if "layernorm" in n]
    assert float(sum(norms)) > 1e-8
