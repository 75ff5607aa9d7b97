"""Output-discarding recompute (selective "layernorm", "moe_act", "mla_up_proj", with
"shared_experts"): the same loss and gradients as none, the named functions run again in
backward, and the tensors kept for backward take less memory by at least the outputs
discarded."""

import pytest
import torch

import mp_state
from mp_layers import GPTModel, ModelGroups, TransformerConfig
from mp_layers.moe import MoELayer
from mp_layers.moe.experts import GroupedExperts
from mp_layers.transformer.multi_latent_attention import MultiLatentAttention
from mp_layers.transformer.output_recompute import OutputRecompute
from mp_state import TENSOR_PARALLEL_RNG, ParallelConfig, RNGStatesTracker
from mp_state.testing import run_on_ranks

VOCAB, SEQ, BATCH = 64, 16, 2
MODELS = {
    "llama": dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                  position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
                  ffn_hidden_size=64, add_bias_linear=False),
    # DeepSeek-V3's parts: MLA, a dense first layer, then routed and shared experts
    "deepseek": dict(num_layers=2, hidden_size=32, num_attention_heads=4,
                     multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=12,
                     qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, qk_layernorm=True,
                     normalization="RMSNorm", position_embedding_type="rope",
                     activation="swiglu", ffn_hidden_size=64, add_bias_linear=False,
                     num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
                     moe_layer_freq=[0, 1], moe_shared_expert_intermediate_size=16,
                     moe_grouped_gemm=True, moe_aux_loss_coeff=1e-2),
}  # fmt: skip
DISCARDING = ["layernorm", "moe_act", "mla_up_proj"]


def step(model_name: str, modules: list[str] | None, groups=None, tracker=None, **extra):
    """Loss, gradients, calls of the recomputed functions and the bytes kept for backward
    at the end of forward (unique storages of every saved tensor), from fixed seeds."""
    recompute = {} if modules is None else dict(recompute_granularity="selective",
                                                recompute_modules=modules)  # fmt: skip
    config = TransformerConfig(**MODELS[model_name], **recompute, **extra,
                               hidden_dropout=0.1, attention_dropout=0.1)  # fmt: skip
    torch.manual_seed(0)
    if tracker is None:
        tracker = RNGStatesTracker("cpu")
        tracker.add(TENSOR_PARALLEL_RNG, 77)
    groups = groups or ModelGroups.single()
    model = GPTModel(config, "local", VOCAB, SEQ, groups=groups, rng_tracker=tracker).train()
    calls = {"norm": 0, "activation": 0, "up_projections": 0, "shared": 0}
    _count_calls(model, calls)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = model(ids, labels=labels).mean()
    kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    forward_calls = dict(calls)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    again = {k: calls[k] - forward_calls[k] for k in calls}
    return loss.detach(), grads, again, sum(kept.values()) - kept.get(0, 0)


def _count_calls(model: torch.nn.Module, calls: dict) -> None:
    def counting(owner, name, kind):
        function = getattr(owner, name)

        def counted(*args, **kwargs):
            calls[kind] += 1
            return function(*args, **kwargs)

        setattr(owner, name, counted)

    for name, module in model.named_modules():
        if name.endswith(("input_layernorm", "pre_mlp_layernorm")):
            counting(module, "forward", "norm")
        if isinstance(module, GroupedExperts):
            counting(module, "_activate", "activation")
        if isinstance(module, MultiLatentAttention):
            counting(module, "_up_projections", "up_projections")
        if isinstance(module, MoELayer) and module.shared_experts is not None:
            counting(module.shared_experts, "forward", "shared")


def _assert_same(got, want) -> None:
    (loss, grads), (want_loss, want_grads) = got, want
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=0)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize(
    ("model", "modules", "again"),
    [
        ("llama", ["layernorm"], {"norm": 4}),
        ("llama", ["core_attn", "mlp", "layernorm"], {"norm": 4}),
        ("deepseek", ["layernorm"], {"norm": 4}),
        ("deepseek", ["moe_act"], {"activation": 1}),
        ("deepseek", ["mla_up_proj"], {"up_projections": 2}),
        ("deepseek", ["shared_experts"], {"shared": 1}),
        (
            "deepseek",
            ["core_attn", "mla_up_proj", "layernorm", "moe_act", "shared_experts"],
            {"norm": 4, "activation": 1, "up_projections": 2, "shared": 1},
        ),
        # inside the recomputed MoE layer the activation is not discarded again; the MoE
        # layer (its shared expert included) runs again as a whole
        ("deepseek", ["moe", "moe_act"], {"activation": 1, "shared": 1}),
    ],
)
def test_recompute_modules_equal_none(model, modules, again):
    want_loss, want_grads, plain_again, plain_bytes = step(model, None)
    loss, grads, calls, kept_bytes = step(model, modules)
    _assert_same((loss, grads), (want_loss, want_grads))
    assert plain_again == {k: 0 for k in plain_again}
    assert calls == {k: again.get(k, 0) for k in calls}
    assert kept_bytes < plain_bytes


def test_memory_kept_drops_by_the_discarded_outputs():
    """Each discarded output is gone from what backward keeps: the norms' outputs [s, b, h]
    (two per layer), the activation's [N, f] (N = s b topk copies) and the queries, keys
    and values of each MLA layer; each function's inner tensors go too."""
    c = MODELS["deepseek"]
    s_b, h, fp32 = SEQ * BATCH, c["hidden_size"], 4
    heads, dn, dr, dv = c["num_attention_heads"], c["qk_head_dim"], c["qk_pos_emb_head_dim"], \
        c["v_head_dim"]  # fmt: skip
    least = {
        "layernorm": 2 * c["num_layers"] * s_b * h * fp32,
        "moe_act": s_b * c["moe_router_topk"] * c["moe_ffn_hidden_size"] * fp32,
        "mla_up_proj": c["num_layers"] * s_b * heads * (2 * (dn + dr) + dv) * fp32,
    }
    *_, plain = step("deepseek", None)
    for module, bytes_ in least.items():
        *_, kept = step("deepseek", [module])
        assert plain - kept >= bytes_, (module, plain - kept, bytes_)


def test_output_is_freed_and_rebuilt_in_place():
    weight = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    runs = []

    def norm(t):
        runs.append(1)
        return torch.nn.functional.rms_norm(t, (8,)) * 2

    def loss_of(recompute: bool):
        kept = OutputRecompute(recompute)
        normed = kept.run(norm, x)
        out = normed @ weight  # saves normed
        kept.discard(out)
        if recompute:
            assert normed.untyped_storage().nbytes() == 0
        return out.square().sum(), normed

    want, _ = loss_of(False)
    want_grads = torch.autograd.grad(want, (x, weight))
    loss, normed = loss_of(True)
    grads = torch.autograd.grad(loss, (x, weight))
    assert len(runs) == 3  # the plain run, the discarding run and its rerun
    assert normed.untyped_storage().nbytes() == normed.numel() * 4  # refilled
    torch.testing.assert_close(loss, want, rtol=0, atol=0)
    for got, expected in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_inactive_without_gradients():
    kept = OutputRecompute(True)
    with torch.no_grad():
        out = kept.run(torch.nn.functional.silu, torch.ones(3, requires_grad=True))
    kept.discard(out)
    assert not kept.active and out.untyped_storage().nbytes() == 12


def tensor_parallel_steps() -> list:
    results = []
    for modules in (None, ["core_attn", "mla_up_proj", "layernorm", "moe_act", "shared_experts"]):
        state = mp_state.initialize(ParallelConfig(tensor_model_parallel_size=2))
        tracker = mp_state.set_random_seeds(1234, state)
        loss, grads, again, _ = step("deepseek", modules, ModelGroups.of(state), tracker,
                                     sequence_parallel=True)  # fmt: skip
        results.append((loss, grads, again))
        mp_state.destroy()
    return results


@pytest.mark.multirank
def test_recompute_modules_with_tensor_and_sequence_parallel():
    torch.testing.assert_close(torch.zeros(1), torch.zeros(1))  # warm imports before forking
    for (loss, grads, _), (loss2, grads2, again) in run_on_ranks(tensor_parallel_steps, 2,
                                                                 timeout=120):  # fmt: skip
        _assert_same((loss2, grads2), (loss, grads))
        assert again == {"norm": 4, "activation": 1, "up_projections": 2, "shared": 1}


def test_compiled_layers_discard_and_rebuild():
    """Under compile_layers (AOTAutograd's saved tensors) the discarded outputs are rebuilt
    as in eager mode: the gradients of no recompute."""
    from mp_layers import compile_layers

    want_loss, want_grads, _, _ = step("deepseek", None)
    build = GPTModel.__init__

    def compiled(self, *args, **kwargs):
        build(self, *args, **kwargs)
        assert compile_layers(self, backend="aot_eager") == 2

    try:
        GPTModel.__init__ = compiled
        loss, grads, again, _ = step("deepseek", DISCARDING)
    finally:
        GPTModel.__init__ = build
    _assert_same((loss, grads), (want_loss, want_grads))
    assert again == {"norm": 4, "activation": 1, "up_projections": 2, "shared": 0}
