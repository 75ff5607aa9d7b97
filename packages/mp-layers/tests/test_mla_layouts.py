"""A GPTModel with multi-latent attention (query latent, YaRN, values narrower than the
keys) gives the one-rank losses and gradients of every logical tensor at TP2, at TP2 with
sequence parallelism and selective recompute, and under context parallelism of each comm
type (values padded for the ring and the all-gather, heads split by the all-to-all)."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

import mp_state
from mp_ckpt import assemble
from mp_layers import GPTModel, ModelGroups, TransformerConfig, all_reduce_sequence_parallel_grads
from mp_layers.context_parallel import shard_sequence
from mp_state import ParallelConfig
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

VOCAB, SEQ, BATCH = 64, 16, 2
MLA = dict(
    num_layers=2, hidden_size=32, num_attention_heads=4, multi_latent_attention=True,
    q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
    qk_layernorm=True, normalization="RMSNorm", position_embedding_type="rope",
    yarn_rotary_scaling_factor=4.0, yarn_original_max_position_embeddings=16,
    yarn_mscale_all_dim=0.9, add_bias_linear=False, hidden_dropout=0.0,
    attention_dropout=0.0, init_method_std=0.05,
)  # fmt: skip
# (tp, cp, sequence parallel and selective recompute, cp_comm_type); the first is the
# one-rank reference.
LAYOUTS = [
    (1, 1, False, "p2p"),
    (2, 1, False, "p2p"),
    (2, 1, True, "p2p"),
    (1, 2, False, "p2p"),
    (1, 2, False, "all_gather"),
    (1, 2, False, "a2a"),
]


def losses_and_grads() -> list:
    results = []
    for tp, cp, sequence_parallel, comm_type in LAYOUTS:
        parallel = ParallelConfig(tensor_model_parallel_size=tp, context_parallel_size=cp)
        state = mp_state.initialize(parallel)
        tracker = mp_state.set_random_seeds(1234, state)
        recompute = "selective" if sequence_parallel else None
        config = TransformerConfig(
            **MLA, sequence_parallel=sequence_parallel, recompute_granularity=recompute,
            cp_comm_type=comm_type,
        )  # fmt: skip
        model = GPTModel(config, "local", VOCAB, SEQ, groups=ModelGroups.of(state),
                         rng_tracker=tracker, init_seed=7)  # fmt: skip
        generator = torch.Generator().manual_seed(5)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        local = [shard_sequence(t, cp, state.cp.rank, dim=1) for t in (ids, labels)]
        loss = model(local[0], labels=local[1])
        (loss.sum() / (BATCH * SEQ)).backward()  # each context-parallel rank's share
        if sequence_parallel:
            all_reduce_sequence_parallel_grads(model, state.tp)
        for p in model.parameters():
            dist.all_reduce(p.grad, group=state.cp.group)
        # The sharding description, over the gradients instead of the weights.
        grads = [dataclasses.replace(piece, data=piece.data.grad.clone())
                 for piece in model.sharded_state_dict().values()]  # fmt: skip
        results.append((state.cp.rank, loss.detach(), grads))
        mp_state.destroy()
    return results


def test_mla_layouts_give_the_one_rank_losses_and_gradients():
    per_rank = run_on_ranks(losses_and_grads, 2, timeout=180)
    _, reference_loss, reference_pieces = per_rank[0][0]
    reference = assemble(reference_pieces)
    assert {key.split("self_attention.")[-1] for key in reference if "self_attention" in key} == {
        "linear_q_down_proj.weight", "q_layernorm.weight", "linear_q_up_proj.weight",
        "linear_kv_down_proj.weight", "kv_layernorm.weight", "linear_kv_up_proj.weight",
        "linear_proj.weight",
    }  # fmt: skip
    for i, (tp, cp, sp, comm_type) in enumerate(LAYOUTS[1:], start=1):
        where = f"TP{tp} CP{cp} SP={sp} {comm_type}"
        for rank in range(2):
            cp_rank, loss, _ = per_rank[rank][i]
            want = shard_sequence(reference_loss, cp, cp_rank, dim=1)
            torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6, msg=where)
        ranks = range(tp) if tp > 1 else range(1)  # CP ranks hold the same summed gradients
        grads = assemble([piece for rank in ranks for piece in per_rank[rank][i][2]])
        assert grads.keys() == reference.keys()
        for key, want in reference.items():
            torch.testing.assert_close(
                grads[key], want, rtol=1e-5, atol=1e-6,
                msg=lambda m, k=key, w=where: f"{k} at {w}: {m}",
            )  # fmt: skip
    assert all(g.abs().sum() > 0 for g in reference.values())
