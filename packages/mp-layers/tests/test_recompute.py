"""Activation recompute gives the same loss and gradients as none, dropout included; the
modules it names (recompute_modules, Megatron's) run again in backward, and no other."""

import pytest
import torch

import mp_state
from mp_layers import GPTModel, ModelGroups, TransformerConfig
from mp_layers.moe import MoELayer
from mp_layers.transformer.core_attention import CoreAttention
from mp_layers.transformer.layer import TransformerLayer
from mp_layers.transformer.mlp import MLP
from mp_state import TENSOR_PARALLEL_RNG, ParallelConfig, RNGStatesTracker
from mp_state.testing import run_on_ranks

VOCAB, SEQ = 64, 16
STYLES = {
    "gpt2": dict(num_layers=3, hidden_size=32, num_attention_heads=4),
    "llama": dict(num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                  position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
                  ffn_hidden_size=64, add_bias_linear=False),
    "moe": dict(num_layers=3, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                add_bias_linear=False, num_moe_experts=4, moe_router_topk=2,
                moe_layer_freq=[1, 0, 1], moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3),
}  # fmt: skip
RECOMPUTE = {
    "none": {},
    "full_uniform_1": dict(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=1),
    "full_uniform_2": dict(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=2),
    "full_block_2": dict(recompute_granularity="full", recompute_method="block",
                         recompute_num_layers=2),
    "selective": dict(recompute_granularity="selective"),
    "moe_layer": dict(moe_layer_recompute=True),
    # Megatron's --recompute-modules: the dense MLPs with core attention; the MoE layers alone
    "modules_mlp": dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
    "modules_moe": dict(recompute_granularity="selective", recompute_modules=["moe"]),
}  # fmt: skip


def step(style: str, recompute: str, groups=None, tracker=None, **extra):
    """Loss and gradients of one training step, from fixed seeds; counts forward calls."""
    config = TransformerConfig(**STYLES[style], **RECOMPUTE[recompute], **extra,
                               hidden_dropout=0.2, attention_dropout=0.2)  # fmt: skip
    torch.manual_seed(0)
    if tracker is None:
        tracker = RNGStatesTracker("cpu")
        tracker.add(TENSOR_PARALLEL_RNG, 77)
    groups = groups or ModelGroups.single()
    model = GPTModel(config, "local", VOCAB, SEQ, groups=groups, rng_tracker=tracker).train()
    calls = {"layer": 0, "core_attention": 0, "moe": 0, "mlp": 0}
    for module in model.modules():
        kinds = {TransformerLayer: "layer", CoreAttention: "core_attention", MoELayer: "moe",
                 MLP: "mlp"}  # fmt: skip
        kind = kinds.get(type(module))
        if kind:
            # A pre-hook: a recomputation stops as soon as it has rebuilt every saved
            # tensor (torch's early stop), before a post-forward hook would run.
            module.register_forward_pre_hook(lambda *_, k=kind: calls.__setitem__(k, calls[k] + 1))
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    loss = model(ids, labels=labels).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, calls


_MOE_ONLY = {"moe_layer", "modules_moe"}
CASES = [(style, recompute) for style in STYLES for recompute in RECOMPUTE
         if recompute not in ("none", "modules_mlp")
         and (recompute in _MOE_ONLY) == (style == "moe")]  # fmt: skip
CASES += [("moe", "full_uniform_1"), ("llama", "modules_mlp")]


@pytest.mark.parametrize(("style", "recompute"), CASES)
def test_recompute_equals_no_recompute(style, recompute):
    want_loss, want_grads, plain_calls = step(style, "none")
    loss, grads, calls = step(style, recompute)
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=0)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)
    # The recomputation really happened: layers (or core attention) ran again in backward.
    recomputed = {"full_uniform_1": {"layer": 3}, "full_uniform_2": {"layer": 3},
                  "full_block_2": {"layer": 2}, "selective": {"core_attention": 3},
                  "moe_layer": {"moe": 2}, "modules_mlp": {"core_attention": 3, "mlp": 3},
                  "modules_moe": {"moe": 2}}  # fmt: skip
    if recompute.startswith(("full", "moe_layer")):  # (a layer's modules run again with it)
        kind, again = next(iter(recomputed[recompute].items()))
        assert calls[kind] == plain_calls[kind] + again
    else:  # these modules run again, no other
        again = recomputed[recompute]
        assert {k: calls[k] - plain_calls[k] for k in calls} == {k: again.get(k, 0) for k in calls}


def test_dropout_masks_follow_the_seeds():
    first, _, _ = step("gpt2", "none")
    again, _, _ = step("gpt2", "none")
    assert torch.equal(first, again)
    other_tracker = RNGStatesTracker("cpu")
    other_tracker.add(TENSOR_PARALLEL_RNG, 78)  # another attention-dropout stream
    different, _, _ = step("gpt2", "none", tracker=other_tracker)
    assert not torch.equal(first, different)


def tensor_parallel_steps() -> list:
    results = []
    for recompute in ("none", "full_uniform_1", "selective"):
        state = mp_state.initialize(ParallelConfig(tensor_model_parallel_size=2))
        tracker = mp_state.set_random_seeds(1234, state)
        groups = ModelGroups.of(state)
        loss, grads, _ = step("llama", recompute, groups, tracker, sequence_parallel=True)
        results.append((loss, grads))
        mp_state.destroy()
    return results


@pytest.mark.multirank
def test_recompute_with_tensor_and_sequence_parallel_dropout():
    torch.testing.assert_close(torch.zeros(1), torch.zeros(1))  # warm imports before forking
    for rank_results in run_on_ranks(tensor_parallel_steps, 2, timeout=120):
        (want_loss, want_grads), *others = rank_results
        for loss, grads in others:
            torch.testing.assert_close(loss, want_loss, rtol=0, atol=0)
            for name, grad in want_grads.items():
                torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)
