"""Multi-token prediction in a hybrid model (Megatron's unified pattern "<main>/<mtp>/..."):

- "*-*E/*E/*E" computes what a GPT model of two layers (the second MoE) with two MTP
  modules computes, given the same weights: its losses, the modules' recorded losses and
  every gradient (an attention layer then an MLP layer are a transformer layer);
- a module with a Mamba layer ("M*/M-") trains through the MTP loss, under Megatron's names;
- the pattern gives mtp_num_layers (a conflicting one is replaced with a warning, as
  Megatron-LM does) and its parts are checked; "|" splits the decoder's layers into
  pipeline segments.
"""

import re

import pytest
import torch

from mp_layers import (
    GPTModel,
    ModelGroups,
    TransformerConfig,
    hybrid_layer_kinds,
    hybrid_pipeline_segments,
)
from mp_layers.config_mtp import mtp_layer_kinds

VOCAB, SEQ, BATCH = 64, 12, 2


def config(moe: bool = True, **changes) -> TransformerConfig:
    settings = dict(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=40, normalization="RMSNorm", activation="squared_relu",
        add_bias_linear=False, position_embedding_type="rope",
        untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.1, mtp_num_layers=2, mtp_loss_scaling_factor=0.5,
        mamba_num_heads=4, mamba_head_dim=8, mamba_num_groups=2, mamba_state_dim=8,
    )  # fmt: skip
    if moe:
        settings |= dict(
            num_moe_experts=4, moe_layer_freq=[0, 1], moe_ffn_hidden_size=16, moe_router_topk=2,
            moe_shared_expert_intermediate_size=24, moe_aux_loss_coeff=0.0,
        )  # fmt: skip
    return TransformerConfig(**(settings | changes))


_SPLIT = re.compile(r"^(decoder\.layers\.(\d+)|mtp\.layers\.(\d+)\.transformer_layer)\.(\w+)\.")


def hybrid_name(name: str) -> str:
    """A GPT parameter's name in the hybrid model: a transformer layer's attention half in
    one layer, its MLP half in the next."""
    match = _SPLIT.match(name)
    if match is None:
        return name
    mlp_half = match.group(4) in ("pre_mlp_layernorm", "mlp")
    rest = name[match.end(1) :]
    if match.group(2) is not None:
        return f"decoder.layers.{2 * int(match.group(2)) + mlp_half}{rest}"
    return f"mtp.layers.{match.group(3)}.mtp_model_layer.layers.{int(mlp_half)}{rest}"


def test_attention_then_mlp_layers_compute_what_transformer_layers_compute():
    gpt = GPTModel(config(), "local", VOCAB, SEQ, groups=ModelGroups.single(), init_seed=5)
    hybrid_config = config(num_layers=4, hybrid_layer_pattern="*-*E/*E/*E", moe_layer_freq=[1])
    hybrid = GPTModel(hybrid_config, "local", VOCAB, SEQ, groups=ModelGroups.single(), init_seed=9)
    params = dict(hybrid.named_parameters())
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            params.pop(hybrid_name(name)).copy_(p)
    assert not params, sorted(params)  # every hybrid parameter has its GPT twin

    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    mask = (torch.rand(BATCH, SEQ, generator=generator) > 0.2).float()
    for model in (gpt, hybrid):
        ((model(ids, labels=labels, loss_mask=mask) * mask).sum() / mask.sum()).backward()
    torch.testing.assert_close(hybrid.mtp.take_losses(), gpt.mtp.take_losses())
    hybrid_params = dict(hybrid.named_parameters())
    for name, p in gpt.named_parameters():
        got = hybrid_params[hybrid_name(name)].grad
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    # the modules' gradients come from their losses alone, and they are not nothing
    assert hybrid.mtp.layers[1].mtp_model_layer.layers[1].mlp.router.weight.grad.abs().sum() > 0


def test_a_module_with_a_mamba_layer_trains_under_megatrons_names():
    cfg = config(moe=False, hybrid_layer_pattern="M*/M-", mtp_num_layers=None)
    assert cfg.mtp_num_layers == 1
    assert hybrid_layer_kinds(cfg) == ["mamba", "attention"]
    assert mtp_layer_kinds(cfg) == [("mamba", False), ("mlp", False)]
    model = GPTModel(cfg, "local", VOCAB, SEQ, groups=ModelGroups.single(), init_seed=1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    (model(ids, labels=ids).mean() * 0).backward()  # the MTP loss's gradient alone
    (loss,) = model.mtp.take_losses().tolist()
    assert loss > 0
    module = model.mtp.layers[0].mtp_model_layer.layers
    assert module[0].mixer.in_proj.weight.grad.abs().sum() > 0
    assert module[1].mlp.linear_fc2.weight.grad.abs().sum() > 0
    assert model.decoder.layers[0].mixer.in_proj.weight.grad.abs().sum() > 0
    keys = set(model.sharded_state_dict())
    for name in ("mtp.layers.0.eh_proj.weight", "mtp.layers.0.final_layernorm.weight",
                 "mtp.layers.0.mtp_model_layer.layers.0.norm.weight",
                 "mtp.layers.0.mtp_model_layer.layers.0.mixer.A_log",
                 "mtp.layers.0.mtp_model_layer.layers.1.pre_mlp_layernorm.weight",
                 "mtp.layers.0.mtp_model_layer.layers.1.mlp.linear_fc1.weight"):  # fmt: skip
        assert name in keys, sorted(k for k in keys if k.startswith("mtp."))
    assert not any(".transformer_layer." in k for k in keys)


def test_the_pattern_gives_the_modules():
    dense = dict(moe=False, mtp_num_layers=None)
    assert config(hybrid_layer_pattern="M*/*-/*-", **dense).mtp_num_layers == 2
    with pytest.warns(UserWarning, match="mtp_num_layers=3 conflicts with the 2 multi-token"):
        assert (
            config(moe=False, hybrid_layer_pattern="M*/*-/*-", mtp_num_layers=3).mtp_num_layers == 2
        )
    # Trailing empty parts are no modules (Megatron's reading); a hybrid model's MTP needs
    # its layers in the pattern.
    assert config(hybrid_layer_pattern="M*/", **dense).mtp_num_layers is None
    with pytest.raises(ValueError, match="mtp_num_layers=2 in a hybrid model needs the layers"):
        config(moe=False, hybrid_layer_pattern="M*")
    with pytest.raises(ValueError, match="the first is '\\*-', module 2's 'M-'"):
        config(hybrid_layer_pattern="M*/*-/M-", **dense)
    with pytest.raises(ValueError, match="has 3 decoder layers, num_layers=2"):
        config(hybrid_layer_pattern="M*-/*-", **dense)
    with pytest.raises(ValueError, match="'x' is not a layer symbol"):
        config(hybrid_layer_pattern="M*/*x", **dense)
    with pytest.raises(ValueError, match="E layers: they need num_moe_experts"):
        config(hybrid_layer_pattern="M*/*E", **dense)


def test_pipeline_segments_split_the_decoder_layers_alone():
    cfg = config(moe=False, num_layers=6, hybrid_layer_pattern="M*|M-*|-/*-", mtp_num_layers=None)
    assert hybrid_pipeline_segments(cfg) == [2, 3, 1]
    assert hybrid_layer_kinds(cfg) == ["mamba", "attention", "mamba", "mlp", "attention", "mlp"]
    assert cfg.mtp_num_layers == 1 and mtp_layer_kinds(cfg) == [
        ("attention", False),
        ("mlp", False),
    ]
    plain = config(moe=False, hybrid_layer_pattern="M*/*-", mtp_num_layers=None)
    assert hybrid_pipeline_segments(plain) is None
