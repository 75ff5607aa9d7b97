"""The router and expert biases in a checkpoint: saved at EP2, loaded at one rank and at
EP2 x TP2 x expert-TP2 (another expert split, the fc1 biases cut on F, the fc2 bias a
replica), the model gives the saving model's per-token losses and holds its tensors."""

import zlib

import pytest
import torch

import mp_state
from mp_ckpt import Checkpointer, ShardedTensor, checkpoint_dir, load_checkpoint, read_metadata
from mp_layers import GPTModel, ModelGroups, TransformerConfig
from mp_layers.moe import is_expert_key
from mp_state import ParallelConfig
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

VOCAB, SEQ = 64, 8
E, F_MOE, H = 4, 32, 64
MODEL = dict(
    num_layers=2, hidden_size=H, num_attention_heads=4, ffn_hidden_size=64,
    position_embedding_type="rope", normalization="RMSNorm", quick_geglu=True,
    glu_linear_offset=1.0, activation_func_clamp_value=7.0, add_bias_linear=True,
    num_moe_experts=E, moe_ffn_hidden_size=F_MOE, moe_router_topk=2,
    moe_token_dispatcher_type="alltoall", untie_embeddings_and_output_weights=True,
    hidden_dropout=0.0, attention_dropout=0.0,
)  # fmt: skip
NEW_TENSORS = {
    "mlp.router.bias": [E], "mlp.experts.linear_fc1.gate.bias": [E, F_MOE],
    "mlp.experts.linear_fc1.up.bias": [E, F_MOE], "mlp.experts.linear_fc2.bias": [E, H],
}  # fmt: skip


def build(tp: int, ep: int, etp: int, seed: int) -> tuple[GPTModel, mp_state.ParallelState]:
    torch.set_num_threads(1)
    state = mp_state.initialize(
        ParallelConfig(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                       expert_tensor_parallel_size=etp)
    )  # fmt: skip
    config = TransformerConfig(**MODEL, sequence_parallel=tp > 1)
    model = GPTModel(config, "local", VOCAB, SEQ, groups=ModelGroups.of(state), init_seed=seed)
    return model.eval(), state


def pieces_of(model: GPTModel, state) -> dict[str, ShardedTensor]:
    """The model's description, copies on data-parallel ranks > 0 marked as replicas."""
    out = {}
    for key, v in model.sharded_state_dict().items():
        dp = state.expert_dp if is_expert_key(key) else state.dp
        replica = v.replica_id * dp.size + dp.rank
        out[key] = ShardedTensor(key, v.data, v.global_shape, v.global_offset, replica)
    return out


def losses(model: GPTModel) -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    ids, labels = torch.randint(0, VOCAB, (2, 2, SEQ), generator=generator)
    with torch.no_grad():
        return model(ids, labels=labels)


def save_at_ep2(root: str):
    model, state = build(1, 2, 1, seed=11)
    with torch.no_grad():  # biases away from 0 (the experts' start there)
        for key, piece in model.sharded_state_dict().items():
            if key.endswith("bias"):
                generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
                piece.data.copy_(torch.randn(piece.global_shape, generator=generator)
                                 [piece.global_slices] * 0.02)  # fmt: skip
    checkpointer = Checkpointer(root)
    checkpointer.save(1, pieces_of(model, state))
    checkpointer.finalize()
    return losses(model)


def load_at(root: str, tp: int, ep: int, etp: int):
    model, state = build(tp, ep, etp, seed=99)  # another init: the load must replace it
    load_checkpoint(root, pieces_of(model, state))
    return losses(model)


def test_expert_and_router_biases_reshard_through_a_checkpoint(tmp_path):
    saved = run_on_ranks(save_at_ep2, 2, str(tmp_path), timeout=120)
    torch.testing.assert_close(saved[0], saved[1])
    tensors = read_metadata(checkpoint_dir(tmp_path, 1))["tensors"]
    for layer in (0, 1):
        for name, shape in NEW_TENSORS.items():
            assert tensors[f"decoder.layers.{layer}.{name}"]["shape"] == shape
    (one,) = run_on_ranks(load_at, 1, str(tmp_path), 1, 1, 1, timeout=120)
    torch.testing.assert_close(one, saved[0], rtol=1e-5, atol=1e-6)
    for got in run_on_ranks(load_at, 4, str(tmp_path), 2, 2, 2, timeout=120):
        torch.testing.assert_close(got, saved[0], rtol=1e-5, atol=1e-6)
