"""QK-clip's parts in mp-layers: each head's largest attention logit (against the full
score matrix, under the causal mask, a window, documents, an explicit mask, GQA), kept
by the core attention in training only, and the row scales that bring a layer's largest
logit to the threshold (a query group's, a multi-latent attention head's) while the
values, the gates and the rotary key stay as they are; the config's rules."""

import pytest
import torch

from mp_layers import GPTModel, ModelGroups, TransformerConfig
from mp_layers.qk_clip import logit_layers, qk_clip_scales, reduce_max_logits
from mp_layers.transformer.max_logits import max_attention_logits

S, B, NQ, NG, D = 12, 2, 4, 2, 8


def brute_force(q, k, scale, allowed):
    """[nq]: the largest of q . k x scale over allowed [b, s, s] pairs, head by head."""
    heads = []
    for h in range(q.shape[2]):
        scores = torch.einsum("ibd,jbd->bij", q[:, :, h], k[:, :, h // (NQ // NG)]) * scale
        heads.append(scores.masked_fill(~allowed, -torch.inf).max())
    return torch.stack(heads)


@pytest.mark.parametrize("case", ["causal", "window", "documents", "mask"])
def test_the_largest_logit_is_the_score_matrix_largest(case):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(S, B, NQ, D, generator=g), torch.randn(S, B, NG, D, generator=g)
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    allowed = (j <= i).expand(B, S, S)
    kwargs = {}
    if case == "window":
        kwargs["window"] = 3
        allowed = allowed & (j >= i - 3)
    elif case == "documents":
        documents = torch.tensor([[0] * 5 + [1] * 7, [0] * 9 + [1] * 3])
        kwargs["documents"] = documents
        allowed = allowed & (documents[:, :, None] == documents[:, None, :])
    elif case == "mask":
        mask = torch.rand(B, 1, S, S, generator=g) < 0.3
        mask[..., 0] = False  # every query sees a key
        kwargs["attention_mask"] = mask
        allowed = ~mask[:, 0]
    got = max_attention_logits(q, k, 0.3, **kwargs)
    torch.testing.assert_close(got, brute_force(q, k, 0.3, allowed), rtol=1e-6, atol=1e-6)


CONFIG = {"num_layers": 1, "hidden_size": 64, "num_attention_heads": 8, "num_query_groups": 2,
          "ffn_hidden_size": 64, "normalization": "RMSNorm", "activation": "swiglu",
          "position_embedding_type": "rope", "add_bias_linear": False, "hidden_dropout": 0.0,
          "attention_dropout": 0.0, "init_method_std": 0.5}  # fmt: skip
MLA = {"multi_latent_attention": True, "kv_lora_rank": 16, "qk_head_dim": 8,
       "qk_pos_emb_head_dim": 4, "v_head_dim": 8, "q_lora_rank": 16,
       "num_query_groups": None}  # fmt: skip


def model(**fields) -> GPTModel:
    torch.manual_seed(0)
    config = TransformerConfig(**(CONFIG | {"qk_clip": True, "qk_clip_threshold": 5.0} | fields))
    return GPTModel(config, "local", 100, 16, groups=ModelGroups.single())


def layer_maxima(m: GPTModel, tokens) -> list[torch.Tensor]:
    m.train()
    m(tokens, labels=tokens)
    return reduce_max_logits(logit_layers([m]), ModelGroups.single().cp)


@pytest.mark.parametrize("fields", [{}, {"attention_output_gate": True}, MLA],
                         ids=["gqa", "gated", "mla"])  # fmt: skip
def test_the_clip_brings_each_group_to_the_threshold(fields):
    m = model(**fields)
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    (before,) = layer_maxima(m, tokens)
    layer = logit_layers([m])[0]
    mla = "multi_latent_attention" in fields
    groups = before if mla else before.view(2, 4).amax(dim=1)
    assert (groups > 5.0).any()  # something to clip
    weights = {n: p.detach().clone() for n, p in m.named_parameters()}
    for param, rows in qk_clip_scales(layer, before, m.config):
        param.data.mul_(rows.view(-1, 1))
    (after,) = layer_maxima(m, tokens)
    after_groups = after if mla else after.view(2, 4).amax(dim=1)
    expected = torch.clamp(groups, max=5.0)
    torch.testing.assert_close(after_groups, expected, rtol=1e-5, atol=1e-5)
    changed = {n for n, p in m.named_parameters() if not torch.equal(p, weights[n])}
    if mla:
        assert changed == {"decoder.layers.0.self_attention.linear_q_up_proj.weight",
                           "decoder.layers.0.self_attention.linear_kv_up_proj.weight"}  # fmt: skip
        kv = m.decoder.layers[0].self_attention.linear_kv_up_proj.weight.view(8, 16, -1)
        old = weights["decoder.layers.0.self_attention.linear_kv_up_proj.weight"].view(8, 16, -1)
        assert torch.equal(kv[:, 8:], old[:, 8:])  # the values
    else:
        assert changed == {"decoder.layers.0.self_attention.linear_qkv.weight"}
        per_group = 4 * 2 + 2 if fields else 4 + 2  # q heads [, gates], k, v
        qkv = m.decoder.layers[0].self_attention.linear_qkv.weight.view(2, per_group, 8, -1)
        old = weights["decoder.layers.0.self_attention.linear_qkv.weight"].view(2, per_group, 8, -1)
        assert torch.equal(qkv[:, -1], old[:, -1])  # v
        if fields:
            assert torch.equal(qkv[:, 4:8], old[:, 4:8])  # the gates
        eta = torch.clamp(5.0 / groups, max=1.0)
        alpha = m.config.qk_clip_alpha
        torch.testing.assert_close(qkv[:, 0], old[:, 0] * eta.view(2, 1, 1) ** alpha)
        torch.testing.assert_close(qkv[:, -2], old[:, -2] * eta.view(2, 1, 1) ** (1 - alpha))


def test_the_logits_are_kept_in_training_only_and_reset_when_taken():
    m = model()
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    core = logit_layers([m])[0].core_attention
    m.eval()
    with torch.no_grad():
        m(tokens)
    assert core.max_logits is None
    first = layer_maxima(m, tokens)[0]
    assert core.max_logits is None  # taken
    m(tokens[:1], labels=tokens[:1])
    m(tokens[1:], labels=tokens[1:])  # two micro-batches: the larger of each head's two
    torch.testing.assert_close(core.max_logits, first)
    assert not logit_layers([model(qk_clip=False, qk_clip_threshold=100.0)])


@pytest.mark.parametrize(("fields", "message"), [
    ({"qk_clip": True, "qk_clip_alpha": 1.0}, r"qk_clip_alpha=1.0 must be in \(0, 1\)"),
    ({"qk_clip": True, "qk_clip_threshold": 0.0}, "qk_clip_threshold=0.0 must be finite"),
    ({"qk_clip_alpha": 0.3}, "qk_clip_alpha=0.3 applies with qk_clip=True"),
])  # fmt: skip
def test_the_rules(fields, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**CONFIG, **fields)


def test_context_parallelism_needs_the_all_to_all():
    config = TransformerConfig(**(CONFIG | {"log_max_attention_logit": True}))
    config.check_parallel(1, 1)
    with pytest.raises(ValueError, match="use cp_comm_type='a2a'"):
        config.check_parallel(1, 2)
