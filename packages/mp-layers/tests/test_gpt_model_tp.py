"""GPTModel at TP 1, 2, 4, with and without sequence parallelism: same loss, same gradients;
also with fewer query groups than TP ranks (each group shared by 2 or 4 ranks), and with
OLMo 2's (with Granite's multipliers) and Gemma 3's layers.

On a CPU, attention_backend "auto" runs the blocked attention at these sizes;
the Llama style is also run through SDPA ("flash")."""

import pytest
import torch

import mp_state
from mp_ckpt import ShardedTensor, check_tiling
from mp_layers import GPTModel, ModelGroups, TransformerConfig, all_reduce_sequence_parallel_grads
from mp_state import ParallelConfig
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

VOCAB, SEQ, BATCH = 128, 16, 2
STYLES = {
    "gpt2": dict(num_layers=2, hidden_size=64, num_attention_heads=4),
    "llama": dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                  kv_channels=8, position_embedding_type="rope", normalization="RMSNorm",
                  activation="swiglu", ffn_hidden_size=96, add_bias_linear=False,
                  untie_embeddings_and_output_weights=True),
    # fewer query groups than TP ranks: one group shared by 2 and by 4 ranks
    "one-group": dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=1,
                      kv_channels=8, position_embedding_type="rope", normalization="RMSNorm",
                      add_qkv_bias=True),
    # Qwen3-Next's attention (output gate, QK norm): two groups, each shared by 2 ranks at TP4
    "gated-two-groups": dict(num_layers=2, hidden_size=64, num_attention_heads=8,
                             num_query_groups=2, kv_channels=8, attention_output_gate=True,
                             qk_layernorm=True, position_embedding_type="rope",
                             normalization="RMSNorm", add_bias_linear=False),
    # OLMo 2's norms: each sublayer's output normalized, queries and keys over all heads
    # (their sums of squares added up over the TP ranks, whose gradients come back summed);
    # with Granite's multipliers of the embeddings, the residual branches and the logits
    "olmo2": dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                  kv_channels=8, position_embedding_type="rope", normalization="RMSNorm",
                  activation="swiglu", ffn_hidden_size=96, add_bias_linear=False,
                  qk_layernorm=True, qk_layernorm_scope="all_heads", sublayer_norm="output",
                  word_embedding_multiplier=3.0, residual_multiplier=0.5, logits_scaling=4.0),
    # Gemma 3's layers: input and output normalized, zero-centred norm weights, head norms,
    # gated tanh-GELU, scaled embeddings and scores
    "gemma3": dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                   kv_channels=8, position_embedding_type="rope", normalization="RMSNorm",
                   apply_layernorm_1p=True, add_bias_linear=False, qk_layernorm=True,
                   sublayer_norm="both", activation="geglu", openai_gelu=True,
                   ffn_hidden_size=96, scale_word_embeddings=True, query_pre_attn_scalar=12),
}  # fmt: skip
LAYOUTS = [(1, False), (2, False), (4, False), (2, True), (4, True)]


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


def losses_and_grads(style: str, attention_backend: str) -> list:
    results = []
    for tp, sequence_parallel in LAYOUTS:
        state = mp_state.initialize(ParallelConfig(tensor_model_parallel_size=tp))
        tracker = mp_state.set_random_seeds(1234, state)
        config = TransformerConfig(**STYLES[style], hidden_dropout=0.0, attention_dropout=0.0,
                                   sequence_parallel=sequence_parallel,
                                   attention_backend=attention_backend)  # fmt: skip
        groups = ModelGroups.of(state)
        model = GPTModel(config, "local", VOCAB, SEQ, groups=groups, rng_tracker=tracker)
        generator = torch.Generator().manual_seed(5)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        loss = model(ids, labels=labels)
        loss.mean().backward()
        # as mp-pipeline's finalize step: the sequence-parallel norms' and the QK norms'
        # partial gradients summed over TP
        all_reduce_sequence_parallel_grads(model, state.tp)
        results.append((loss.detach(), grad_pieces(model)))
        mp_state.destroy()
    return results


def assemble(pieces: list[ShardedTensor]) -> dict[str, torch.Tensor]:
    check_tiling(pieces)
    tensors: dict[str, torch.Tensor] = {}
    for p in pieces:
        if p.replica_id == 0:
            full = tensors.setdefault(p.key, torch.zeros(p.global_shape))
            full[p.global_slices] = p.data
    return tensors


@pytest.mark.parametrize(
    ("style", "attention_backend"),
    [("gpt2", "auto"), ("llama", "auto"), ("llama", "flash"), ("one-group", "auto"),
     ("gated-two-groups", "flash"), ("olmo2", "auto"), ("gemma3", "auto")],
)  # fmt: skip
def test_every_tensor_parallel_layout_gives_the_same_loss_and_gradients(style, attention_backend):
    torch.testing.assert_close(torch.zeros(1), torch.zeros(1))  # warm imports before forking
    per_rank = run_on_ranks(losses_and_grads, 4, style, attention_backend, timeout=180)
    reference_loss, _ = per_rank[0][0]
    reference = assemble(list(per_rank[0][0][1].values()))
    for i, (tp, sequence_parallel) in enumerate(LAYOUTS):
        for rank in range(tp):
            torch.testing.assert_close(per_rank[rank][i][0], reference_loss, rtol=1e-5, atol=1e-6)
        grads = assemble([p for rank in range(tp) for p in per_rank[rank][i][1].values()])
        assert grads.keys() == reference.keys()
        for key, want in reference.items():
            torch.testing.assert_close(
                grads[key], want, rtol=1e-5, atol=1e-6,
                msg=lambda m, k=key, t=tp, s=sequence_parallel: f"{k} at TP{t} SP={s}: {m}",
            )  # fmt: skip
    assert any(g.abs().sum() > 0 for g in reference.values())
