"""mlp_chunks_for_training (Megatron's --mlp-chunks-for-training): in training each dense
MLP runs on pieces of the sequence, with the loss and every gradient of the whole-sequence
MLP, at TP1 and TP2 with sequence parallelism (each rank's pieces of its part); not in
evaluation; refused in a MoE model."""

import pytest
import torch

import mp_state
from mp_layers import GPTModel, ModelGroups, TransformerConfig, all_reduce_sequence_parallel_grads
from mp_state import ParallelConfig
from mp_state.testing import run_on_ranks

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
            normalization="RMSNorm", activation="swiglu", position_embedding_type="rope",
            add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
VOCAB, SEQ = 64, 16


def loss_and_grads(chunks: int, tp: int = 1) -> tuple[torch.Tensor, dict]:
    state = mp_state.initialize(ParallelConfig(tensor_model_parallel_size=tp))
    tracker = mp_state.set_random_seeds(7, state)
    config = TransformerConfig(**BASE, mlp_chunks_for_training=chunks, sequence_parallel=tp > 1)
    model = GPTModel(config, "local", VOCAB, SEQ, groups=ModelGroups.of(state),
                     rng_tracker=tracker)  # fmt: skip
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    loss = model(ids, labels=torch.roll(ids, -1, 1))
    loss.sum().backward()
    if tp > 1:
        all_reduce_sequence_parallel_grads(model, state.tp)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    mp_state.destroy()
    return loss.detach(), grads


def body(tp: int):
    torch.set_num_threads(1)
    return loss_and_grads(1, tp), loss_and_grads(3, tp)


@pytest.mark.multirank
@pytest.mark.parametrize("tp", [1, 2])
def test_pieces_of_the_sequence_give_the_whole_mlps_loss_and_gradients(tp):
    for (loss, grads), (chunked, chunked_grads) in run_on_ranks(body, tp, tp, timeout=120):
        torch.testing.assert_close(chunked, loss, rtol=1e-6, atol=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-5, atol=1e-6,
                                       msg=name)  # fmt: skip


def test_evaluation_runs_the_mlp_whole_and_a_moe_model_refuses():
    torch.manual_seed(0)
    config = TransformerConfig(**BASE, mlp_chunks_for_training=4)
    model = GPTModel(config, "local", VOCAB, SEQ, groups=ModelGroups.single()).eval()
    calls = []
    mlp = model.decoder.layers[0].mlp
    mlp.register_forward_hook(lambda *args: calls.append(1))
    with torch.no_grad():
        model(torch.zeros(1, SEQ, dtype=torch.long))
    model.train()
    model(torch.zeros(1, SEQ, dtype=torch.long))
    assert len(calls) == 1 + 4
    with pytest.raises(ValueError, match="mlp_chunks_for_training=2 in a MoE model"):
        TransformerConfig(**BASE, mlp_chunks_for_training=2, num_moe_experts=4)
