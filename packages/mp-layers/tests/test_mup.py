"""Maximal Update Parameterization (use_mup) in TransformerConfig and GPTModel: the derived
multipliers (Megatron-LM's rules), the refusals, the initialization by width, and the
forward: the logits times the output multiplier, the embedding's output times its own,
the attention scale, the same through the chunked loss and the MTP heads. Megatron-LM's
own logits for a muP checkpoint: tests/test_megatron_import_logits.py."""

import math

import pytest
import torch

from mp_layers import GPTModel, ModelGroups, TransformerConfig

SMALL = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 64,
         "normalization": "RMSNorm", "activation": "swiglu", "position_embedding_type": "rope",
         "untie_embeddings_and_output_weights": True, "add_bias_linear": False,
         "hidden_dropout": 0.0, "attention_dropout": 0.0, "init_method_std": 0.1}  # fmt: skip
VOCAB, SEQ = 64, 12


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_derived_multipliers_are_megatrons():
    config = TransformerConfig(**SMALL, use_mup=True, mup_base_hidden_size=16,
                               mup_embedding_mult=2.0, mup_base_head_dim=4)  # fmt: skip
    assert config.mup_width_mult == 2.0
    assert config.logit_multiplier == 0.5  # 1 / width unless set
    assert config.embedding_multiplier == 2.0
    assert config.softmax_scale == pytest.approx(math.sqrt(4) / 8)
    assert config.hidden_init_std == pytest.approx(0.1 / math.sqrt(2))
    assert config.output_layer_init_std == pytest.approx(0.1 / math.sqrt(2 * 2 * 2))
    assert config.embedding_init_std == 0.1
    set_output = TransformerConfig(**SMALL, use_mup=True, mup_base_hidden_size=16,
                                   mup_output_mult=0.25, mup_attn_scale_power=0.5)  # fmt: skip
    assert set_output.logit_multiplier == 0.25
    assert set_output.softmax_scale == pytest.approx(1 / math.sqrt(8))
    base = TransformerConfig(**SMALL, use_mup=True)  # the base model itself: width 1
    assert (base.mup_width_mult, base.logit_multiplier, base.hidden_init_std) == (1.0, 1.0, 0.1)
    assert base.softmax_scale == pytest.approx(1 / 8)  # muP's 1 / head width still
    plain = TransformerConfig(**SMALL, embedding_init_method_std=0.05)
    assert (plain.mup_width_mult, plain.logit_multiplier, plain.softmax_scale) == (1.0, 1.0, None)
    assert plain.output_layer_init_std == pytest.approx(0.1 / math.sqrt(4))
    assert plain.embedding_init_std == 0.05
    hybrid = TransformerConfig(**SMALL, hybrid_layer_pattern="M*", mamba_num_heads=4,
                               mamba_head_dim=16, mamba_num_groups=2,
                               mamba_state_dim=16)  # fmt: skip
    assert hybrid.output_layer_init_std == pytest.approx(0.1 / math.sqrt(2))  # Megatron's: L


@pytest.mark.parametrize(("field", "value", "message"), [
    ("mup_embedding_mult", 2.0, "mup_embedding_mult=2.0 applies with use_mup=True"),
    ("mup_base_hidden_size", 16, "mup_base_hidden_size=16 applies with use_mup=True"),
    ("embedding_init_method_std", 0.0, "embedding_init_method_std=0.0 must be > 0"),
])  # fmt: skip
def test_mup_fields_without_use_mup_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**SMALL, **{field: value})


@pytest.mark.parametrize(("field", "value", "message"), [
    ("mup_base_hidden_size", 0, "must be a positive integer"),
    ("mup_output_mult", -1.0, "mup_output_mult=-1.0 must be finite and > 0"),
    ("mup_attn_scale_power", math.inf, "mup_attn_scale_power=inf must be finite"),
])  # fmt: skip
def test_bad_mup_values_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**SMALL, use_mup=True, **{field: value})


def build(seed=0, **fields):
    torch.manual_seed(seed)
    config = TransformerConfig(**{**SMALL, **fields})
    return GPTModel(config, "local", VOCAB, SEQ, groups=ModelGroups.single())


def test_initialization_scales_with_width():
    """At width 4096 over a base of 1024 (m = 4) the hidden matrices are drawn with std
    init / 2, the projections into the residual init / sqrt(2 layers 4), the embedding and
    the untied output layer with the embedding's std, as Megatron-LM draws them."""
    wide = {"hidden_size": 1024, "ffn_hidden_size": 256, "num_attention_heads": 8}
    model = build(use_mup=True, mup_base_hidden_size=256, embedding_init_method_std=0.05,
                  **wide)  # fmt: skip
    stds = {n: p.std().item() for n, p in model.named_parameters() if p.dim() == 2}
    expected = {"embedding.weight": 0.05, "output_layer.weight": 0.05,
                "decoder.layers.0.self_attention.linear_qkv.weight": 0.1 / 2,
                "decoder.layers.0.mlp.linear_fc1.weight": 0.1 / 2,
                "decoder.layers.0.self_attention.linear_proj.weight": 0.1 / math.sqrt(16),
                "decoder.layers.1.mlp.linear_fc2.weight": 0.1 / math.sqrt(16)}  # fmt: skip
    for name, std in expected.items():
        assert stds[name] == pytest.approx(std, rel=0.02), name
    tied = build(use_mup=True, mup_base_hidden_size=256, untie_embeddings_and_output_weights=False,
                 **wide)  # fmt: skip
    assert tied.output_layer.weight is tied.embedding.weight


def same_weights(target: GPTModel, source: GPTModel) -> GPTModel:
    target.load_state_dict(source.state_dict())
    return target.eval()


def test_the_logits_and_the_embedding_are_scaled():
    """With the standard attention scale kept (power 0.5), a muP model's logits are the
    same weights' plain logits times 1 / width; the embedding's multiplier changes what the
    layers see (not a plain product of the logits)."""
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    plain = build().eval()
    mup = same_weights(build(use_mup=True, mup_base_hidden_size=8, mup_attn_scale_power=0.5),
                       plain)  # fmt: skip
    with torch.no_grad():
        expected = plain(tokens) * 0.25
        torch.testing.assert_close(mup(tokens), expected, rtol=1e-6, atol=1e-7)
        embedded = same_weights(
            build(
                use_mup=True,
                mup_base_hidden_size=8,
                mup_attn_scale_power=0.5,
                mup_embedding_mult=3.0,
            ),
            plain,
        )
        assert not torch.allclose(embedded(tokens), expected, atol=1e-3)
        # the embedding's multiplier is the decoder input's: scale the plain embedding
        plain.embedding.weight.mul_(3.0)
        torch.testing.assert_close(embedded(tokens), plain(tokens) * 0.25, rtol=1e-5, atol=1e-6)


def test_the_attention_scale_is_mups():
    """muP's scale 1 / head width equals the plain model's 1 / sqrt(head width) with the
    queries multiplied by 1 / sqrt(head width) (head width 8 here)."""
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    plain = build().eval()
    mup = same_weights(build(use_mup=True), plain)  # width 1: only the attention scale
    assert mup.decoder.layers[0].self_attention.core_attention.softmax_scale == 1 / 8
    with torch.no_grad():
        got = mup(tokens)
        assert not torch.allclose(got, plain(tokens), atol=1e-4)
        for layer in plain.decoder.layers:  # the query rows of each head's [q k v]
            weight = layer.self_attention.linear_qkv.weight.view(4, 3, 8, -1)
            weight[:, 0].mul_(1 / math.sqrt(8))
        torch.testing.assert_close(got, plain(tokens), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mtp", [None, 1])
def test_the_chunked_loss_and_mtp_heads_use_the_multiplier(mtp):
    """The loss through the chunked output layer (which scales its input) equals the
    unchunked one (which scales the logits), with the MTP module's losses and gradients."""
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    labels = torch.roll(tokens, -1, 1)
    fields = {"use_mup": True, "mup_base_hidden_size": 8, "mup_output_mult": 0.3,
              "mtp_num_layers": mtp}  # fmt: skip
    results = []
    for chunk in (0, 5):
        model = build(output_loss_chunk_tokens=chunk, **fields).train()
        loss = model(tokens, labels=labels)
        loss.sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((loss.detach(), grads, model.mtp.take_losses() if mtp else None))
    (loss, grads, mtp_losses), (chunked, chunked_grads, chunked_mtp) = results
    torch.testing.assert_close(chunked, loss, rtol=1e-6, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-5, atol=2e-6, msg=name)
    if mtp:
        torch.testing.assert_close(chunked_mtp, mtp_losses, rtol=1e-6, atol=1e-6)
    # and the multiplier is there: a plain model with the same weights has another loss
    plain = build(output_loss_chunk_tokens=0, mtp_num_layers=mtp).train()
    plain.load_state_dict(model.state_dict())
    assert not torch.allclose(plain(tokens, labels=labels).detach(), loss, atol=1e-3)


def test_the_model_marks_its_embedding_class_parameters():
    """mp_optim's muP groups read is_embedding_parameter (Megatron's attribute): the word
    and position embeddings and the output layer."""
    model = build(position_embedding_type="learned_absolute")
    marked = {n for n, p in model.named_parameters() if getattr(p, "is_embedding_parameter", 0)}
    assert marked == {"embedding.weight", "position_embeddings.weight", "output_layer.weight"}
