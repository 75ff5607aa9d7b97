"""A GPTModel with DeepSeek sparse attention (each layer's indexer choosing 6 of 16
positions, trained by its loss; a query latent, YaRN) gives the one-rank losses, indexer
losses and gradients of every logical tensor, the indexers' included, at TP2, at TP2
with sequence parallelism and selective recompute, and under context parallelism (each
rank's queries over the gathered keys, whatever the comm type). 16 indexer heads, so
that no key scores exactly 0 in every head (ties, which torch.topk breaks by the row's
length: sparse_attention.chosen_positions)."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

import mp_state
from mp_ckpt import assemble
from mp_layers import (
    GPTModel,
    LightningIndexer,
    ModelGroups,
    TransformerConfig,
    all_reduce_sequence_parallel_grads,
)
from mp_layers.context_parallel import shard_sequence
from mp_layers.moe.aux_losses import AuxLossScale
from mp_state import ParallelConfig
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

VOCAB, SEQ, BATCH = 64, 16, 2
DSA = dict(
    num_layers=2, hidden_size=32, num_attention_heads=4, multi_latent_attention=True,
    q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
    qk_layernorm=True, normalization="RMSNorm", position_embedding_type="rope",
    yarn_rotary_scaling_factor=4.0, yarn_original_max_position_embeddings=16,
    yarn_mscale_all_dim=0.9, add_bias_linear=False, hidden_dropout=0.0,
    attention_dropout=0.0, init_method_std=0.1, experimental_attention_variant="dsa",
    dsa_indexer_n_heads=16, dsa_indexer_head_dim=8, dsa_indexer_topk=6,
    dsa_indexer_loss_coeff=0.5,
)  # fmt: skip
# (tp, cp, sequence parallel and selective recompute, cp_comm_type); the first is the
# one-rank reference.
LAYOUTS = [(1, 1, False, "p2p"), (2, 1, True, "p2p"), (1, 2, False, "p2p"), (1, 2, False, "a2a")]


def losses_and_grads() -> list:
    results = []
    for tp, cp, sequence_parallel, comm_type in LAYOUTS:
        parallel = ParallelConfig(tensor_model_parallel_size=tp, context_parallel_size=cp)
        state = mp_state.initialize(parallel)
        tracker = mp_state.set_random_seeds(1234, state)
        recompute = "selective" if sequence_parallel else None
        config = TransformerConfig(
            **DSA,
            sequence_parallel=sequence_parallel,
            recompute_granularity=recompute,
            cp_comm_type=comm_type,
        )
        model = GPTModel(config, "local", VOCAB, SEQ, groups=ModelGroups.of(state),
                         rng_tracker=tracker, init_seed=7)  # fmt: skip
        indexers = [m for m in model.modules() if isinstance(m, LightningIndexer)]
        for indexer in indexers:  # each rank's loss is its queries' mean: the ranks' average
            indexer.aux_loss_scale = AuxLossScale("dsa", 1 / cp)
        generator = torch.Generator().manual_seed(5)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        local = [shard_sequence(t, cp, state.cp.rank, dim=1) for t in (ids, labels)]
        loss = model(local[0], labels=local[1])
        (loss.sum() / (BATCH * SEQ)).backward()  # each context-parallel rank's share
        indexer_loss = sum(indexer.take_loss() for indexer in indexers)
        if sequence_parallel:
            all_reduce_sequence_parallel_grads(model, state.tp)
        for p in model.parameters():
            dist.all_reduce(p.grad, group=state.cp.group)
        dist.all_reduce(indexer_loss, group=state.cp.group)
        # The sharding description, over the gradients instead of the weights.
        grads = [dataclasses.replace(piece, data=piece.data.grad.clone())
                 for piece in model.sharded_state_dict().values()]  # fmt: skip
        results.append((state.cp.rank, loss.detach(), indexer_loss / cp, grads))
        mp_state.destroy()
    return results


def test_dsa_layouts_give_the_one_rank_losses_and_gradients():
    per_rank = run_on_ranks(losses_and_grads, 2, timeout=180)
    _, reference_loss, reference_indexer_loss, reference_pieces = per_rank[0][0]
    reference = assemble(reference_pieces)
    indexer = {key for key in reference if ".indexer." in key}
    assert len(indexer) == 10 and float(reference_indexer_loss) > 0.01
    for i, (tp, cp, sp, comm_type) in enumerate(LAYOUTS[1:], start=1):
        where = f"TP{tp} CP{cp} SP={sp} {comm_type}"
        for rank in range(2):
            cp_rank, loss, indexer_loss, _ = per_rank[rank][i]
            want = shard_sequence(reference_loss, cp, cp_rank, dim=1)
            torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6, msg=where)
            torch.testing.assert_close(indexer_loss, reference_indexer_loss, rtol=1e-5,
                                       atol=0, msg=where)  # fmt: skip
        ranks = range(tp) if tp > 1 else range(1)  # CP ranks hold the same summed gradients
        grads = assemble([piece for rank in ranks for piece in per_rank[rank][i][3]])
        assert grads.keys() == reference.keys()
        for key, want in reference.items():
            torch.testing.assert_close(
                grads[key], want, rtol=1e-5, atol=1e-6,
                msg=lambda m, k=key, w=where: f"{k} at {w}: {m}",
            )  # fmt: skip
    assert all(g.abs().sum() > 0 for g in reference.values())
