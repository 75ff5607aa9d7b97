"""A Mamba-hybrid model in a checkpoint: saved at TP2 (each rank its groups of Mamba heads),
loaded at one rank and back at TP2 (with sequence parallelism), the model gives the
saving model's per-token losses and the loss of its multi-token prediction module (a
Mamba layer and an MLP layer); the checkpoint holds Megatron's logical Mamba tensors
(in_proj and conv1d by part, group by group), whatever the TP size."""

import pytest
import torch

import mp_state
from mp_ckpt import Checkpointer, checkpoint_dir, load_checkpoint, read_metadata
from mp_layers import GPTModel, ModelGroups, TransformerConfig
from mp_state import ParallelConfig
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

VOCAB, SEQ, H = 64, 12, 32
HEADS, P, GROUPS, N = 8, 8, 2, 16
MODEL = dict(
    num_layers=3, hidden_size=H, num_attention_heads=4, num_query_groups=2,
    ffn_hidden_size=64, hybrid_layer_pattern="M*-/M-", mamba_num_heads=HEADS, mamba_head_dim=P,
    mamba_num_groups=GROUPS, mamba_state_dim=N, normalization="RMSNorm",
    activation="squared_relu", add_bias_linear=False, position_embedding_type="none",
    untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
    init_method_std=0.1,
)  # fmt: skip
MAMBA_TENSORS = {  # Megatron's [G x rows, ...] as [G, rows, ...]
    "in_proj.z.weight": [GROUPS, HEADS // GROUPS * P, H],
    "in_proj.x.weight": [GROUPS, HEADS // GROUPS * P, H],
    "in_proj.B.weight": [GROUPS, N, H], "in_proj.C.weight": [GROUPS, N, H],
    "in_proj.dt.weight": [GROUPS, HEADS // GROUPS, H],
    "conv1d.x.weight": [GROUPS, HEADS // GROUPS * P, 4], "conv1d.B.bias": [GROUPS, N],
    "dt_bias": [HEADS], "A_log": [HEADS], "D": [HEADS], "norm.weight": [HEADS * P],
    "out_proj.weight": [H, HEADS * P],
}  # fmt: skip


def build(tp: int, seed: int) -> GPTModel:
    torch.set_num_threads(1)
    state = mp_state.initialize(ParallelConfig(tensor_model_parallel_size=tp))
    config = TransformerConfig(**MODEL, sequence_parallel=tp > 1)
    return GPTModel(config, "local", VOCAB, SEQ, groups=ModelGroups.of(state), init_seed=seed)


def losses(model: GPTModel) -> torch.Tensor:
    """The per-token losses, then the MTP module's (a training forward: dropout is 0)."""
    generator = torch.Generator().manual_seed(3)
    ids, labels = torch.randint(0, VOCAB, (2, 2, SEQ), generator=generator)
    per_token = model(ids, labels=labels).detach()
    return torch.cat([per_token.flatten(), model.mtp.take_losses()])


def save_at_tp2(root: str):
    model = build(2, seed=11)
    checkpointer = Checkpointer(root)
    checkpointer.save(1, model.sharded_state_dict())
    checkpointer.finalize()
    return losses(model)


def load_at(root: str, tp: int):
    model = build(tp, seed=99)  # another init: the load must replace it
    load_checkpoint(root, model.sharded_state_dict())
    return losses(model)


def test_a_hybrid_model_reshards_through_a_checkpoint(tmp_path):
    saved = run_on_ranks(save_at_tp2, 2, str(tmp_path), timeout=120)
    torch.testing.assert_close(saved[0], saved[1])
    tensors = read_metadata(checkpoint_dir(tmp_path, 1))["tensors"]
    for name, shape in MAMBA_TENSORS.items():
        assert tensors[f"decoder.layers.0.mixer.{name}"]["shape"] == shape, name
    assert "decoder.layers.0.norm.weight" in tensors
    assert not any(k.startswith("decoder.layers.1.mlp") for k in tensors)  # attention only
    assert not any(k.startswith("decoder.layers.2.self_attention") for k in tensors)  # MLP only
    module = "mtp.layers.0.mtp_model_layer.layers."
    assert (
        tensors[f"{module}0.mixer.in_proj.z.weight"]["shape"] == MAMBA_TENSORS["in_proj.z.weight"]
    )
    assert f"{module}1.mlp.linear_fc1.weight" in tensors
    (one,) = run_on_ranks(load_at, 1, str(tmp_path), 1, timeout=120)
    torch.testing.assert_close(one, saved[0], rtol=1e-5, atol=1e-6)
    for got in run_on_ranks(load_at, 2, str(tmp_path), 2, timeout=120):
        torch.testing.assert_close(got, saved[0], rtol=1e-5, atol=1e-6)
