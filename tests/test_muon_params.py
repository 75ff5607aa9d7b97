"""Which of mp_layers' parameters Muon takes, and how it sees them split, over the model
families at TP2 (x ETP2 for the experts): Megatron's rule (matrices, not the embedding,
the output layer, norms, biases, Mamba's in_proj or the convolutions' kernels; each
expert's weight a matrix), and every matrix whose pieces differ between the two
tensor-parallel ranks marked with the dimension and group it is split along (so Muon
orthogonalizes the whole matrix), the replicated ones not."""

import io

import pytest
import torch

import mp_state
from mp_layers import GPTModel, ModelGroups, TransformerConfig
from mp_optim.flat_ranges import locate
from mp_optim.muon_groups import layout_of, takes_muon
from mp_state import ParallelConfig
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

BASE = dict(
    num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
    ffn_hidden_size=48, normalization="RMSNorm", activation="swiglu",
    position_embedding_type="rope", add_bias_linear=False, hidden_dropout=0.0,
    attention_dropout=0.0, untie_embeddings_and_output_weights=True,
)  # fmt: skip
FAMILIES = {
    "gated attention with biases and QK norms": dict(
        attention_output_gate=True, qk_layernorm=True, add_bias_linear=True),
    "MoE with a shared expert": dict(
        num_moe_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2,
        moe_shared_expert_intermediate_size=16, moe_token_dispatcher_type="alltoall"),
    "multi-latent attention": dict(
        multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8,
        qk_pos_emb_head_dim=4, v_head_dim=6, qk_layernorm=True, num_query_groups=None,
        kv_channels=None),
    "Mamba hybrid": dict(
        hybrid_layer_pattern="M*-", num_layers=3, mamba_num_heads=8, mamba_head_dim=8,
        mamba_num_groups=2, mamba_state_dim=16, position_embedding_type="none"),
    "gated DeltaNet": dict(
        experimental_attention_variant="gdn", linear_attention_freq=2, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4),
}  # fmt: skip
# the matrices Muon leaves to Adam: the embedding, the output layer, Mamba's in_proj
# (Megatron's use_muon=False) and the convolutions' kernels ([C, 1, width] in Megatron)
SCALAR = ("embedding.", "output_layer.", "mixer.in_proj.", "conv1d_weight")


def audit(settings: dict) -> dict[str, list]:
    """On a TP2 rank: the names Muon takes, and the matrices whose split the layout gets
    wrong (split: this rank's pieces are not copies of the other rank's)."""
    torch.set_num_threads(1)
    experts = "num_moe_experts" in settings
    etp = 2 if experts else None
    state = mp_state.initialize(
        ParallelConfig(tensor_model_parallel_size=2, expert_tensor_parallel_size=etp)
    )
    config = TransformerConfig(**BASE | settings, sequence_parallel=True)
    model = GPTModel(config, "local", 64, 16, groups=ModelGroups.of(state), init_seed=1)
    groups = {"tp": state.tp, "expert_tp": state.expert_tp}
    names = {id(p): n for n, p in model.named_parameters()}
    params = list(model.parameters())
    split: dict[int, bool] = {}
    for piece, param, _ in locate(model.sharded_state_dict().values(), params):
        batch = 1 if param.dim() == 3 else 0  # the experts' dimension is not a TP split
        cut = any(g != n for g, n in zip(piece.global_shape[batch:],
                                         piece.data.shape[batch:], strict=True))  # fmt: skip
        split[id(param)] = split.get(id(param), False) or (cut and piece.replica_id == 0)
    taken, wrong = {}, []
    for param in params:
        taken[names[id(param)]] = (param.dim(), takes_muon(param))
        if not takes_muon(param):
            continue
        layout = layout_of(param, groups)
        if layout.split != split.get(id(param), False):
            wrong.append((names[id(param)], layout.partition_dim, split.get(id(param))))
        elif layout.split and layout.group.size != 2:
            wrong.append((names[id(param)], "group", layout.group.size))
    # a parameter pickles (the ranks send theirs home): it holds no process group
    torch.save(params, io.BytesIO())
    return {"taken": taken, "wrong": wrong}


@pytest.mark.parametrize("family", FAMILIES)
def test_muon_takes_the_matrices_whole(family):
    ranks = run_on_ranks(audit, 2, FAMILIES[family], timeout=180)
    for rank in ranks:
        assert not rank["wrong"], rank["wrong"]
    taken = ranks[0]["taken"]
    for name, (dim, muon) in taken.items():
        assert muon == (dim in (2, 3) and not any(s in name for s in SCALAR)), name
    assert any(muon for _, muon in taken.values())
