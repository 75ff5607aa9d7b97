"""`estimate`'s activations under selective recompute's modules (--recompute-modules):
each module leaves out what it rebuilds in backward, by hand-worked figures. The base
model of test_estimate.py (L=2, h=64, a=4, f=4h, s=32, b=2, bf16) at t=2 with sequence
parallelism (every term / t): sbh = 4096, the scores 5as^2b = 40960."""

from __future__ import annotations

import pytest

from mp_data import DataConfig
from mp_layers import TransformerConfig
from mp_optim import OptimizerConfig
from mp_state import ParallelConfig
from mp_train.configuration.config import GPTConfig, RunConfig, TrainingConfig
from mp_train.estimate import estimate

MB = 2**20
SBH = 4096
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
           moe_shared_expert_intermediate_size=64, moe_grouped_gemm=True,
           moe_layer_freq=[1, 1])  # fmt: skip
MLA = dict(multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16,
           qk_pos_emb_head_dim=8, v_head_dim=16)  # fmt: skip


def make_config(tp: int = 1, **model) -> RunConfig:
    """test_estimate.py's base model ("local" attention keeps its probabilities)."""
    return RunConfig(
        model=TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                                attention_backend="local", add_bias_linear=False,
                                position_embedding_type="rope", bf16=True, **model),
        parallel=ParallelConfig(tensor_model_parallel_size=tp),
        gpt=GPTConfig(seq_length=32), optimizer=OptimizerConfig(bf16=True),
        data=DataConfig(vocab_size=100), training=TrainingConfig(micro_batch_size=2),
    )  # fmt: skip


def activation(modules=None, **model) -> float:
    selective = {} if modules is None else dict(recompute_granularity="selective",
                                                recompute_modules=modules)  # fmt: skip
    config = make_config(tp=2, sequence_parallel=True, **selective, **model)
    return estimate(config, world_size=2)["activation_mb"] * MB


def test_core_attention_alone_drops_the_scores():
    # the scores are split over t: 40960 / 2 a layer
    assert activation() - activation(["core_attn"]) == pytest.approx(2 * 40960 / 2)
    # naming other modules only keeps the scores (core attention runs once)
    assert activation() - activation(["mlp"]) == pytest.approx(2 * 4 * 4 * SBH / 2)


@pytest.mark.parametrize(
    ("modules", "model", "less_per_layer"),
    [
        # two norms' outputs: 2 * 2sbh
        (["layernorm"], {}, 4 * SBH / 2),
        # queries, keys and values: 6sbh
        (["mla_up_proj"], MLA, 6 * SBH / 2),
        # the routed activation output 2 k f_moe / h sbh = 2 * 2 * 32 / 64 sbh
        (["moe_act"], MOE, 2 * SBH / 2),
        # the shared expert's 4 f_shared / h sbh = 4sbh
        (["shared_experts"], MOE, 4 * SBH / 2),
        # the MoE layer's MLP part 4 (k f_moe + f_shared) / h sbh = 8sbh
        (["moe", "moe_act", "shared_experts"], MOE, 8 * SBH / 2),
        (["layernorm", "mla_up_proj", "moe_act"], MLA | MOE, (4 + 6 + 2) * SBH / 2),
    ],
)
def test_each_module_leaves_out_what_it_rebuilds(modules, model, less_per_layer):
    # against core attention alone (Megatron's default): the scores go in both
    base = activation(["core_attn"], **model)
    assert base - activation(["core_attn", *modules], **model) == pytest.approx(2 * less_per_layer)


def test_the_formula_names_the_modules():
    config = make_config(recompute_granularity="selective",
                         recompute_modules=["layernorm", "core_attn"])  # fmt: skip
    assert estimate(config, world_size=1)["activation_formula"] == (
        "selective recompute (layernorm core_attn)"
    )
