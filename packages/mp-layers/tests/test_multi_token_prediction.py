"""Multi-token prediction (DeepSeek-V3's MTP modules) in GPTModel.

- Two modules on a tiny MLA + MoE model: the losses GPTModel records and the gradients
  it gives equal a direct computation of DeepSeek-V3's formula (embedding of the tokens
  k ahead, enorm/hnorm, eh_proj on [embedding, hidden], the module's layer, its final
  norm, the shared output layer against the labels k ahead under the rolled mask) with
  the language model's mean loss plus mtp_loss_scaling_factor / D times the modules'.
- One module applied at both depths (mtp_use_repeated_layer) gives that formula with its
  weights at both, and a checkpoint of mtp.layers.0 alone.
- Evaluation and generation leave the modules out; the checkpoint keys are Megatron's.
- A training step's shared scales reach the routers and the MTP modules: the MTP
  gradients follow the "mtp" scale set after the forward.
- roll_left at CP2 equals rolling the whole sequence and taking each rank's chunks.
"""

import pytest
import torch
import torch.nn.functional as F

import mp_state
from mp_layers import GPTModel, KVCache, ModelGroups, TransformerConfig
from mp_layers.context_parallel import shard_sequence
from mp_layers.moe import AuxLossScale, routers_of, share_aux_loss_scale
from mp_layers.transformer.multi_token_prediction import roll_left
from mp_state import ParallelConfig
from mp_state.testing import run_on_ranks

VOCAB, SEQ, BATCH, FACTOR = 96, 16, 2, 0.3


def tiny_config(**changes) -> TransformerConfig:
    settings = dict(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
        normalization="RMSNorm", activation="swiglu", add_bias_linear=False,
        position_embedding_type="rope", untie_embeddings_and_output_weights=True,
        multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8,
        qk_pos_emb_head_dim=4, v_head_dim=8, qk_layernorm=True, rope_type="rope",
        num_moe_experts=4, moe_layer_freq=[0, 1], moe_ffn_hidden_size=16, moe_router_topk=2,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_shared_expert_intermediate_size=16, moe_aux_loss_coeff=0.0,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.1,
        mtp_num_layers=2, mtp_loss_scaling_factor=FACTOR,
    )  # fmt: skip
    return TransformerConfig(**(settings | changes))


def reference_loss(model: GPTModel, ids, labels, mask, per_token: bool = False):
    """The language model's masked mean loss plus FACTOR / D times each module's, computed
    directly from the model's weights (its transformer layers as they are); per_token:
    all of it times the tokens (the language model's loss a sum), as Megatron's per-token
    loss has it."""
    rotary = model._rotary(model.rotary, SEQ)
    hidden = model.decoder(model.embedding(ids.t()), rotary, None)  # normalized [s, b, h]
    weight_out, weight_in = model.output_layer.weight, model.embedding.weight

    def token_losses(h, targets):
        logits = h @ weight_out.t()  # [s, b, v]
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.t().reshape(-1),
                               reduction="none").view(SEQ, BATCH).t()  # fmt: skip

    tokens = mask.sum()
    total = (token_losses(hidden, labels) * mask).sum() / tokens
    modules = []
    for k in range(1, model.mtp.depths + 1):
        layer = model.mtp.module(k - 1)
        shifted = torch.zeros_like(ids)
        shifted[:, :-k] = ids[:, k:]
        targets = torch.zeros_like(labels)
        targets[:, :-k] = labels[:, k:]
        kept = torch.zeros_like(mask)
        kept[:, :-k] = mask[:, k:]
        embedded = F.embedding(shifted.t(), weight_in)
        joined = torch.cat([layer.enorm(embedded), layer.hnorm(hidden)], dim=-1)
        x = joined @ layer.eh_proj.weight.t()
        hidden = layer.final_layernorm(layer.transformer_layer(x, rotary, None))
        loss = (token_losses(hidden, targets) * kept).sum() / kept.sum()
        modules.append(float(loss.detach()))
        total = total + FACTOR / model.mtp.depths * loss
    return (total * tokens if per_token else total), modules


@pytest.mark.parametrize(("recompute", "per_token", "repeated"),
                         [(False, False, False), (True, False, False), (False, True, False),
                          (False, False, True)],
                         ids=["", "full-recompute", "per-token-loss", "repeated"])  # fmt: skip
def test_mtp_losses_and_gradients_equal_deepseeks_formula(recompute, per_token, repeated):
    """repeated: one module makes both depths' predictions (mtp_use_repeated_layer)."""
    torch.manual_seed(0)
    full = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    config = tiny_config(**(full if recompute else {}), mtp_use_repeated_layer=repeated)
    model = GPTModel(config, "local", VOCAB, SEQ, groups=ModelGroups.single(), init_seed=3,
                     calculate_per_token_loss=per_token)  # fmt: skip
    twin = GPTModel(config, "local", VOCAB, SEQ, groups=ModelGroups.single(), init_seed=3)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    mask = (torch.rand(BATCH, SEQ, generator=generator) > 0.2).float()

    losses = model(ids, labels=labels, loss_mask=mask)
    main = (losses * mask).sum()
    (main if per_token else main / mask.sum()).backward()
    recorded = model.mtp.take_losses()
    expected, modules = reference_loss(twin, ids, labels, mask, per_token)
    expected.backward()

    assert recorded.tolist() == pytest.approx(modules, rel=1e-5)
    assert all(m > 0 for m in modules)
    params = dict(twin.named_parameters())
    for name, p in model.named_parameters():
        want = params[name].grad
        assert p.grad is not None and want is not None, name
        torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-6, msg=name)
    # The modules' layers and the token embedding copy train through the MTP loss alone.
    assert model.mtp.layers[-1].eh_proj.weight.grad.abs().sum() > 0
    assert len(model.mtp.layers) == (1 if repeated else 2) and len(recorded) == 2
    if repeated:
        assert not any(k.startswith("mtp.layers.1.") for k in model.sharded_state_dict())


@pytest.mark.parametrize("tied", [False, True])
def test_detached_heads_train_the_modules_alone(tied):
    """mtp_detach_heads: the modules' gradients are those without detaching (the same
    losses through the same modules); every other parameter's is the language model's
    loss alone (no MTP gradient reaches the decoder, the embedding or the output layer);
    the modules' parameters carry grad_norm_group "mtp"."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    untie = {"untie_embeddings_and_output_weights": not tied}
    models = {}
    for name, changes in (("detached", {"mtp_detach_heads": True}), ("attached", {}),
                          ("none", {"mtp_num_layers": None})):  # fmt: skip
        model = GPTModel(tiny_config(**changes, **untie), "local", VOCAB, SEQ,
                         groups=ModelGroups.single(), init_seed=3)  # fmt: skip
        model(ids, labels=labels).mean().backward()
        models[name] = dict(model.named_parameters())
    detached, attached, alone = models["detached"], models["attached"], models["none"]
    assert detached.keys() == attached.keys()
    moved = 0
    for name, param in detached.items():
        if name.startswith("mtp."):
            assert param.grad_norm_group == "mtp", name
            torch.testing.assert_close(param.grad, attached[name].grad, rtol=1e-5, atol=1e-7)
        else:
            assert getattr(param, "grad_norm_group", None) is None, name
            torch.testing.assert_close(param.grad, alone[name].grad, rtol=1e-5, atol=1e-7)
            moved += not torch.allclose(attached[name].grad, alone[name].grad)
    assert moved > 10  # without detaching, the MTP losses reach the rest of the model
    with pytest.raises(ValueError, match=r"mtp_detach_heads=True detaches .* mtp_num_layers"):
        tiny_config(mtp_num_layers=None, mtp_detach_heads=True)


def test_shared_scales_reach_the_routers_and_the_mtp_modules():
    config = tiny_config(mtp_num_layers=1)
    model = GPTModel(config, "local", VOCAB, SEQ, groups=ModelGroups.single(), init_seed=3)
    moe, mtp = AuxLossScale("moe"), AuxLossScale("mtp")
    # One MoE layer in the decoder, one in the module (shaped as the last layer).
    assert share_aux_loss_scale([model], moe) == len(routers_of([model])) == 2
    assert share_aux_loss_scale([model], mtp) == 1 and model.mtp.aux_loss_scale is mtp
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    grads = []
    for scale in (1.0, 2.5):
        model.zero_grad()
        loss = model(ids, labels=ids).mean()
        mtp.set(scale)  # read when backward runs
        (loss * 0).backward()  # the MTP loss's gradient alone
        grads.append(model.mtp.layers[0].eh_proj.weight.grad.clone())
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], 2.5 * grads[0])


def test_evaluation_and_generation_leave_the_modules_out():
    config = tiny_config(mtp_num_layers=1)
    model = GPTModel(config, "local", VOCAB, SEQ, groups=ModelGroups.single(), init_seed=3)
    plain = GPTModel(tiny_config(mtp_num_layers=None), "local", VOCAB, SEQ,
                     groups=ModelGroups.single(), init_seed=3)  # fmt: skip
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    model.eval(), plain.eval()
    with torch.no_grad():
        assert torch.equal(model(ids, labels=ids), plain(ids, labels=ids))
        assert torch.equal(model(ids), plain(ids))
        # Cached generation: the prompt, then one token, the same logits as without MTP.
        caches = [KVCache(torch.zeros(BATCH, dtype=torch.long), SEQ) for _ in range(2)]
        for step in (ids[:, :-1], ids[:, -1:]):
            got, want = (m(step, kv_cache=c) for m, c in zip((model, plain), caches, strict=True))
            assert torch.equal(got, want)
    assert model.mtp.take_losses().tolist() == [0.0]
    keys = set(model.sharded_state_dict())
    layer = "mtp.layers.0."
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight",
                 "transformer_layer.self_attention.linear_kv_down_proj.weight",
                 "transformer_layer.mlp.router.weight"):  # fmt: skip
        assert layer + name in keys, (name, sorted(k for k in keys if k.startswith(layer)))


def test_refused_with_learned_positions_and_yarn():
    """Megatron-LM's rule: rope or none (an MLA model's YaRN is rope_type under rope)."""
    with pytest.raises(
        ValueError,
        match="mtp_num_layers=1 with position_embedding_type="
        "'learned_absolute': multi-token prediction takes 'rope' or 'none'",
    ):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, mtp_num_layers=1)
    plain = dict(num_layers=1, hidden_size=8, num_attention_heads=2, mtp_num_layers=1)
    with pytest.raises(ValueError, match="position_embedding_type='yarn': multi-token"):
        TransformerConfig(**plain, position_embedding_type="yarn")
    for position in ("rope", "none"):
        assert TransformerConfig(**plain, position_embedding_type=position).mtp_num_layers
    assert tiny_config(rope_type="yarn").mtp_num_layers  # MLA's YaRN
    with pytest.raises(ValueError, match="mtp_num_layers=0"):
        tiny_config(mtp_num_layers=0)
    with pytest.raises(ValueError, match="mtp_use_repeated_layer=True repeats a multi-token"):
        tiny_config(mtp_num_layers=None, mtp_use_repeated_layer=True)


def _roll_on_rank() -> list[bool]:
    state = mp_state.initialize(ParallelConfig(context_parallel_size=2))
    whole = torch.arange(2 * 16).view(2, 16) + 1
    want = torch.roll(whole, -1, dims=1)
    want[:, -1] = 0
    local = shard_sequence(whole, 2, state.cp.rank, dim=1)
    got = roll_left(local, state.cp)
    return torch.equal(got, shard_sequence(want, 2, state.cp.rank, dim=1))


@pytest.mark.multirank
def test_roll_left_at_cp2_equals_the_whole_sequences_roll():
    assert run_on_ranks(_roll_on_rank, 2, timeout=120) == [True, True]
