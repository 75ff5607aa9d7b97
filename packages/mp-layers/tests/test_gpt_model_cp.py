"""GPTModel with context parallelism (every comm type, with TP and sequence parallelism):
each rank's per-token losses are the one-rank losses of its load-balanced chunks, and the
gradients summed over the context-parallel group are the one-rank gradients."""

import pytest
import torch
import torch.distributed as dist

import mp_state
from mp_layers import GPTModel, ModelGroups, TransformerConfig, all_reduce_sequence_parallel_grads
from mp_layers.context_parallel import shard_sequence
from mp_state import ParallelConfig
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

VOCAB, SEQ, BATCH = 128, 32, 2
STYLES = {
    "gpt2": dict(num_layers=2, hidden_size=64, num_attention_heads=4),
    "llama": dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                  kv_channels=8, position_embedding_type="rope", normalization="RMSNorm",
                  activation="swiglu", ffn_hidden_size=96, add_bias_linear=False,
                  untie_embeddings_and_output_weights=True),
}  # fmt: skip
# (tp, cp, sequence parallel, cp_comm_type); the first is the one-rank reference.
LAYOUTS = [
    (1, 1, False, "p2p"),
    (1, 2, False, "p2p"),
    (1, 2, False, "all_gather"),
    (1, 2, False, "a2a"),
    (2, 2, True, "p2p"),
    (2, 2, True, "a2a"),
    (1, 4, False, "p2p"),
    (1, 4, False, "a2a"),
]


def losses_and_grads(style: str) -> list:
    results = []
    for tp, cp, sequence_parallel, comm_type in LAYOUTS:
        parallel = ParallelConfig(tensor_model_parallel_size=tp, context_parallel_size=cp)
        state = mp_state.initialize(parallel)
        tracker = mp_state.set_random_seeds(1234, state)
        config = TransformerConfig(**STYLES[style], hidden_dropout=0.0, attention_dropout=0.0,
                                   sequence_parallel=sequence_parallel, cp_comm_type=comm_type,
                                   init_method_std=0.05)  # fmt: skip
        model = GPTModel(config, "local", VOCAB, SEQ, groups=ModelGroups.of(state),
                         rng_tracker=tracker, init_seed=7)  # fmt: skip
        generator = torch.Generator().manual_seed(5)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        local = [shard_sequence(t, cp, state.cp.rank, dim=1) for t in (ids, labels)]
        loss = model(local[0], labels=local[1])
        # The mean over the whole sequence: each rank's share of the sum.
        (loss.sum() / (BATCH * SEQ)).backward()
        if sequence_parallel:
            all_reduce_sequence_parallel_grads(model, state.tp)
        grads = {}
        for name, p in model.named_parameters():
            grad = p.grad.clone()
            dist.all_reduce(grad, group=state.cp.group)
            grads[name] = grad
        results.append((state.tp.rank, state.cp.rank, loss.detach(), grads))
        mp_state.destroy()
    return results


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_context_parallel_layouts_give_the_one_rank_losses_and_gradients(style):
    per_rank = run_on_ranks(losses_and_grads, 4, style, timeout=240)
    _, _, reference_loss, reference_grads = per_rank[0][0]
    for i, (tp, cp, sp, comm_type) in enumerate(LAYOUTS):
        where = f"TP{tp} CP{cp} SP={sp} {comm_type}"
        for rank in range(4):
            _, cp_rank, loss, grads = per_rank[rank][i]
            want = shard_sequence(reference_loss, cp, cp_rank, dim=1)
            torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6, msg=where)
            if tp == 1:
                for name, want_grad in reference_grads.items():
                    torch.testing.assert_close(
                        grads[name], want_grad, rtol=1e-5, atol=1e-6,
                        msg=lambda m, n=name, w=where: f"{n} at {w}: {m}",
                    )  # fmt: skip
        if tp > 1:  # the tensor-parallel pieces: compare the norms of each parameter
            for name, want_grad in reference_grads.items():
                pieces = [per_rank[r][i][3][name] for r in range(tp)]
                got = _norm(name, pieces, want_grad)
                torch.testing.assert_close(got, want_grad.norm(), rtol=1e-5, atol=1e-6,
                                           msg=f"{name} at {where}")  # fmt: skip
    assert any(g.abs().sum() > 0 for g in reference_grads.values())


def _norm(name: str, pieces: list[torch.Tensor], full: torch.Tensor) -> torch.Tensor:
    """The norm of a parameter's gradient from its tensor-parallel pieces (replicated ones
    are the same on every rank)."""
    if pieces[0].shape == full.shape:
        for piece in pieces[1:]:
            torch.testing.assert_close(piece, pieces[0], rtol=1e-5, atol=1e-6, msg=name)
        return pieces[0].norm()
    return torch.stack([p.norm() ** 2 for p in pieces]).sum().sqrt()
