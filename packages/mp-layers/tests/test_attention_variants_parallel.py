"""A gpt-oss-style GPTModel (learnable sinks, a sliding window on every other layer, YaRN)
at TP2 and at CP2 with all-to-all, the ring, all-gather and hierarchically (a2a+p2p, as
2 x 1 and 1 x 2) gives the one-rank losses and gradients, through the
blocked ("local") and the banded ("flash") attention paths; the sinks' gradient included,
assembled from each TP rank's heads by their sharding description."""

import pytest
import torch
import torch.distributed as dist

import mp_state
from mp_ckpt import ShardedTensor, check_tiling
from mp_layers import GPTModel, ModelGroups, TransformerConfig
from mp_layers.context_parallel import shard_sequence
from mp_state import ParallelConfig
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

VOCAB, SEQ, BATCH = 64, 16, 2
SINK = "decoder.layers.{}.self_attention.core_attention.softmax_offset"
LAYOUTS = [(1, 1, "a2a", None), (2, 1, "a2a", None), (1, 2, "a2a", None),
           (1, 2, "p2p", None), (1, 2, "all_gather", None), (1, 2, "a2a+p2p", [2, 1]),
           (1, 2, "a2a+p2p", [1, 2])]  # fmt: skip
"""(tp, cp, cp_comm_type, hierarchical sizes): at CP2 the 16 positions are chunks of 4, so
the window of 3 keys back masks some blocks in part and skips others."""


def grad_pieces(model: GPTModel) -> dict[str, ShardedTensor]:
    """The model's sharding description, laid over the gradients instead of the weights."""
    params = list(model.parameters())
    for p in params:
        p.data, p.grad = p.grad, p.data
    try:
        return {k: ShardedTensor(k, v.data.clone(), v.global_shape, v.global_offset, v.replica_id)
                for k, v in model.sharded_state_dict().items()}  # fmt: skip
    finally:
        for p in params:
            p.data, p.grad = p.grad, p.data


def run(backend: str) -> list:
    torch.set_num_threads(1)
    results = []
    for tp, cp, comm, levels in LAYOUTS:
        parallel = ParallelConfig(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                  hierarchical_context_parallel_sizes=levels)  # fmt: skip
        state = mp_state.initialize(parallel)
        config = TransformerConfig(
            num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
            kv_channels=8, normalization="RMSNorm", add_bias_linear=True,
            softmax_type="learnable", window_size=(3, 0), window_attn_skip_freq=2,
            position_embedding_type="yarn", yarn_rotary_scaling_factor=4.0,
            yarn_original_max_position_embeddings=8, cp_comm_type=comm,
            hidden_dropout=0.0, attention_dropout=0.0, attention_backend=backend,
            init_method_std=0.05,
        )  # fmt: skip
        model = GPTModel(config, "local", VOCAB, SEQ, groups=ModelGroups.of(state), init_seed=3)
        generator = torch.Generator().manual_seed(5)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        local = [shard_sequence(t, cp, state.cp.rank, dim=1) for t in (ids, labels)]
        loss = model(local[0], labels=local[1])
        (loss.sum() / (BATCH * SEQ)).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=state.cp.group)
        results.append((state.cp.rank, loss.detach(), grad_pieces(model)))
        mp_state.destroy()
    return results


def both_backends() -> dict:
    return {backend: run(backend) for backend in ("local", "flash")}


def assemble(pieces: list[ShardedTensor]) -> dict[str, torch.Tensor]:
    check_tiling(pieces)
    tensors: dict[str, torch.Tensor] = {}
    for p in pieces:
        if p.replica_id == 0:
            full = tensors.setdefault(p.key, torch.zeros(p.global_shape))
            full[p.global_slices] = p.data
    return tensors


def test_sinks_windows_and_yarn_at_tp2_and_every_cp2_equal_one_rank():
    per_rank = run_on_ranks(both_backends, 2, timeout=120)
    for backend in ("local", "flash"):
        _, reference_loss, reference_pieces = per_rank[0][backend][0]
        reference = assemble(list(reference_pieces.values()))
        assert reference[SINK.format(0)].abs().sum() > 0 and SINK.format(1) in reference
        for i, (tp, cp, comm, levels) in enumerate(LAYOUTS):
            where = f"{backend} TP{tp} CP{cp} {comm} {levels}"
            for rank in range(2):
                cp_rank, loss, _ = per_rank[rank][backend][i]
                want = shard_sequence(reference_loss, cp, cp_rank, dim=1)
                torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6, msg=where)
            if cp > 1:  # each CP rank holds the whole model: compare rank 0's
                grads = assemble(list(per_rank[0][backend][i][2].values()))
            else:
                grads = assemble(
                    [p for r in range(tp) for p in per_rank[r][backend][i][2].values()]
                )
            assert grads.keys() == reference.keys()
            for key, want in reference.items():
                torch.testing.assert_close(
                    grads[key], want, rtol=1e-5, atol=1e-6,
                    msg=lambda m, k=key, w=where: f"{k} at {w}: {m}",
                )  # fmt: skip
