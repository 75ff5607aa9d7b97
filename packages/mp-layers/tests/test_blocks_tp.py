"""MLP (gelu, swiglu, gpt-oss's clamped quick GEGLU with biases) and self-attention at TP 2
and 4 (with and without sequence parallelism) equal TP 1."""

import pytest
import torch
import torch.distributed as dist

import mp_state
from mp_ckpt import check_tiling
from mp_layers import LOCAL_SPEC, ModelGroups, TransformerConfig
from mp_layers.transformer.attention import SelfAttention
from mp_layers.transformer.mlp import MLP
from mp_layers.transformer.rope import RotaryEmbedding
from mp_state import ParallelConfig, RankGroup
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

S, B = 8, 2
CASES = {
    "gelu_mlp": (MLP, dict(num_layers=2, hidden_size=32, num_attention_heads=4)),
    "swiglu_mlp": (MLP, dict(num_layers=2, hidden_size=32, num_attention_heads=4,
                             activation="swiglu", ffn_hidden_size=48, add_bias_linear=False)),
    "gpt_oss_mlp": (MLP, dict(num_layers=2, hidden_size=32, num_attention_heads=4,
                              quick_geglu=True, glu_linear_offset=1.0,
                              activation_func_clamp_value=0.05, ffn_hidden_size=48)),
    "mha": (SelfAttention, dict(num_layers=2, hidden_size=32, num_attention_heads=4)),
    "gqa_rope_qknorm": (SelfAttention, dict(
        num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4,
        kv_channels=8, add_bias_linear=False, position_embedding_type="rope",
        normalization="RMSNorm", qk_layernorm=True)),
}  # fmt: skip


def run(module, x, rotary):
    out, bias = module(x, rotary) if isinstance(module, SelfAttention) else module(x)
    return out + bias if bias is not None else out


def compare(case: str, tp: int, sequence_parallel: bool):
    cls, kwargs = CASES[case]
    kwargs = kwargs | dict(hidden_dropout=0.0, attention_dropout=0.0)
    rank = dist.get_rank()
    state = mp_state.initialize(ParallelConfig(tensor_model_parallel_size=tp))
    alone = RankGroup("tp", (rank,), 0, None)
    if cls is SelfAttention:  # a model constructor: all its groups in one bundle
        alone = ModelGroups(tp=alone, cp=RankGroup("cp", (rank,), 0, None))
    spec = {"spec": LOCAL_SPEC} if cls is SelfAttention else {}
    torch.manual_seed(3)
    reference = cls(TransformerConfig(**kwargs), alone, **spec)
    torch.manual_seed(3)
    groups = ModelGroups.of(state) if cls is SelfAttention else state.tp
    config = TransformerConfig(**kwargs, sequence_parallel=sequence_parallel)
    parallel = cls(config, groups, **spec)
    torch.manual_seed(11)  # the same input and output weighting on every rank
    x = torch.randn(S, B, 32, requires_grad=True)
    weights = torch.randn(S, B, 32)
    rotary = RotaryEmbedding(kwargs.get("kv_channels", 8))(S)
    (run(reference, x, rotary) * weights).sum().backward()
    want_out = run(reference, x, rotary).detach()

    local_x = x.detach().chunk(tp)[state.tp.rank] if sequence_parallel else x.detach()
    local_x.requires_grad_(True)
    out = run(parallel, local_x, rotary)
    local_w = weights.chunk(tp)[state.tp.rank] if sequence_parallel else weights
    (out * local_w).sum().backward()
    if sequence_parallel:
        parts = [torch.empty_like(out) for _ in range(tp)]
        dist.all_gather(parts, out.detach().contiguous(), group=state.tp.group)
        got_out, want_grad = torch.cat(parts), x.grad.chunk(tp)[state.tp.rank]
    else:
        got_out, want_grad = out.detach(), x.grad
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(local_x.grad, want_grad, rtol=1e-5, atol=1e-5)
    pieces = {k: (v.global_shape, v.global_offset, v.replica_id, v.data.detach().clone())
              for k, v in parallel.sharded_state_dict().items()}  # fmt: skip
    mp_state.destroy()
    return pieces


LAYOUTS = [(2, False), (4, False), (2, True), (4, True)]


def compare_layouts(case: str) -> list:
    return [compare(case, tp, sequence_parallel) for tp, sequence_parallel in LAYOUTS]


@pytest.mark.parametrize("case", sorted(CASES))
def test_tensor_parallel_equals_one_rank(case):
    # Import assert_close's lazy dependencies once here, not in every forked rank.
    torch.testing.assert_close(torch.zeros(1), torch.zeros(1))
    per_rank = run_on_ranks(compare_layouts, 4, case, timeout=120)
    for i, (tp, _) in enumerate(LAYOUTS):
        described = [
            mp_state_piece(key, *value)
            for pieces in per_rank[:tp]
            for key, value in pieces[i].items()
        ]
        shapes = check_tiling(described)
        if case.startswith("gqa"):
            assert shapes["linear_qkv.q.weight"] == (4, 2, 8, 32)
            assert shapes["linear_qkv.k.weight"] == (4, 8, 32)
        if case.startswith(("swiglu", "gpt_oss")):
            assert shapes["linear_fc1.gate.weight"] == shapes["linear_fc1.up.weight"] == (48, 32)
        if case.startswith("gpt_oss"):
            assert shapes["linear_fc1.gate.bias"] == shapes["linear_fc1.up.bias"] == (48,)


def mp_state_piece(key, shape, offset, replica, data):
    from mp_ckpt import ShardedTensor

    return ShardedTensor(key, data, shape, offset, replica)
