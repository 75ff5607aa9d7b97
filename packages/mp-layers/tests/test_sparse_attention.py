"""DeepSeek sparse attention (transformer/sparse_attention.py): multi-latent attention with
the lightning indexer equals transformers' DeepseekV32Attention in fp32 with the same
weights (YaRN included, a top-k smaller than the sequence so that it chooses), through the
blocked attention and SDPA, with and without the Hadamard rotation; generation through a
KVCache gives the whole sequence's outputs; the indexer loss is the KL divergence it names
and trains the indexer alone; computed in blocks of queries the scores, loss and gradients
are those computed whole; layers that share a choice attend with their source's; and the
configuration is checked field by field."""

import os

import pytest
import torch

from mp_layers import LOCAL_SPEC, GPTModel, LightningIndexer, ModelGroups, TransformerConfig
from mp_layers.config_dsa import dsa_choice_source
from mp_layers.moe.aux_losses import AuxLossScale
from mp_layers.transformer import sparse_attention
from mp_layers.transformer.kv_cache import KVCache
from mp_layers.transformer.multi_latent_attention import MultiLatentAttention
from mp_layers.transformer.packed import PackedSeqParams
from mp_layers.transformer.rope import RotaryEmbedding, yarn_scaling
from mp_layers.transformer.sparse_attention import (
    chosen_positions,
    hadamard,
    index_scores,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v32 import modeling_deepseek_v32  # noqa: E402

H, HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V, SEQ = 32, 4, 16, 12, 8, 4, 6, 24
IDX_HEADS, IDX_DIM, TOPK = 4, 8, 5
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
            beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.9)  # fmt: skip


def hf_attention():
    torch.manual_seed(0)
    config = transformers.DeepseekV32Config(
        vocab_size=32, hidden_size=H, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=Q_LORA,
        kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V,
        index_n_heads=IDX_HEADS, index_head_dim=IDX_DIM, index_topk=TOPK,
        max_position_embeddings=64, attention_dropout=0.0, rope_parameters=YARN,
    )  # fmt: skip
    config._attn_implementation = "eager"
    attention = modeling_deepseek_v32.DeepseekV32Attention(config, layer_idx=0).eval()
    rotary = modeling_deepseek_v32.DeepseekV32RotaryEmbedding(config)
    with torch.no_grad():  # norms start at 1 (and 0): make them count
        for norm in (attention.q_a_layernorm, attention.kv_a_layernorm, attention.indexer.k_norm):
            norm.weight.uniform_(0.5, 1.5)
        attention.indexer.k_norm.bias.uniform_(-0.5, 0.5)
    return attention, rotary


def mp_config(**changes) -> TransformerConfig:
    settings = dict(
        num_layers=2, hidden_size=H, num_attention_heads=HEADS, multi_latent_attention=True,
        q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA, qk_head_dim=NOPE, qk_pos_emb_head_dim=ROPE,
        v_head_dim=V, qk_layernorm=True, normalization="RMSNorm", layernorm_epsilon=1e-6,
        add_bias_linear=False, position_embedding_type="rope", rotary_base=10000,
        yarn_rotary_scaling_factor=4.0, yarn_original_max_position_embeddings=16,
        yarn_mscale=0.707, yarn_mscale_all_dim=0.9, hidden_dropout=0.0, attention_dropout=0.0,
        experimental_attention_variant="dsa", dsa_indexer_n_heads=IDX_HEADS,
        dsa_indexer_head_dim=IDX_DIM, dsa_indexer_topk=TOPK,
    )  # fmt: skip
    return TransformerConfig(**(settings | changes))


NAMES = {
    "q_a_proj": "linear_q_down_proj", "q_a_layernorm": "q_layernorm",
    "q_b_proj": "linear_q_up_proj", "kv_a_proj_with_mqa": "linear_kv_down_proj",
    "kv_a_layernorm": "kv_layernorm", "kv_b_proj": "linear_kv_up_proj", "o_proj": "linear_proj",
    "indexer.wq_b": "indexer.linear_wq_b", "indexer.wk": "indexer.linear_wk",
    "indexer.k_norm": "indexer.k_norm", "indexer.weights_proj": "indexer.linear_weights_proj",
}  # fmt: skip


def copy_weights(hf, ours) -> None:
    theirs = dict(hf.named_parameters())
    mine = dict(ours.named_parameters())
    with torch.no_grad():
        for hf_name, our_name in NAMES.items():
            for kind in ("weight", "bias"):
                if f"{hf_name}.{kind}" in theirs:
                    mine.pop(f"{our_name}.{kind}").copy_(theirs[f"{hf_name}.{kind}"])
    assert not mine, f"not copied: {sorted(mine)}"


def inputs():
    x = torch.randn(2, SEQ, H, generator=torch.Generator().manual_seed(1))
    return x, torch.arange(SEQ)[None].expand(2, SEQ)


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("backend", ["local", "flash"])
def test_dsa_equals_deepseek_v32_attention(backend, rotate):
    hf, hf_rotary = hf_attention()
    x, positions = inputs()
    mask = torch.full((SEQ, SEQ), -torch.inf).triu(1)[None, None].expand(2, 1, SEQ, SEQ)
    with torch.no_grad():
        want = hf(x, hf_rotary(x, positions), mask)[0]
        dense = hf.indexer.index_topk
        hf.indexer.index_topk = SEQ  # every earlier position: the dense attention
        want_dense = hf(x, hf_rotary(x, positions), mask)[0]
        hf.indexer.index_topk = dense
    config = mp_config(attention_backend=backend, dsa_indexer_rotate_activation=rotate)
    ours = MultiLatentAttention(config, ModelGroups.single(), spec=LOCAL_SPEC).eval()
    copy_weights(hf, ours)
    rotary = RotaryEmbedding(ROPE, 1.0, 10000, yarn=yarn_scaling(config))(SEQ)
    with torch.no_grad():
        out, bias = ours(x.transpose(0, 1), rotary)
    assert bias is None
    torch.testing.assert_close(out.transpose(0, 1), want, rtol=1e-5, atol=1e-5)
    # the indexer chose: the dense attention differs past the first TOPK positions
    assert not torch.allclose(want[:, TOPK:], want_dense[:, TOPK:], atol=1e-3)
    torch.testing.assert_close(want[:, :TOPK], want_dense[:, :TOPK], rtol=1e-5, atol=1e-5)


def test_dsa_generation_through_a_cache_equals_the_whole_sequence():
    config = mp_config()
    torch.manual_seed(2)
    ours = MultiLatentAttention(config, ModelGroups.single(), spec=LOCAL_SPEC).eval()
    x = torch.randn(SEQ, 2, H, generator=torch.Generator().manual_seed(3))
    embedding = RotaryEmbedding(ROPE, 1.0, 10000, yarn=yarn_scaling(config))
    with torch.no_grad():
        whole = ours(x, embedding(SEQ))[0]
        cache = KVCache(torch.zeros(2, dtype=torch.long), SEQ)
        prompt = 9
        parts = [ours(x[:prompt], embedding(prompt), cache.attention_mask(prompt, "cpu"),
                      kv_cache=cache)[0]]  # fmt: skip
        cache.advance(prompt)
        for i in range(prompt, SEQ):
            rotary = embedding(i + 1)
            rotary = type(rotary)(rotary.cos[i:], rotary.sin[i:])
            parts.append(ours(x[i : i + 1], rotary, cache.attention_mask(1, "cpu"),
                              kv_cache=cache)[0])  # fmt: skip
            cache.advance(1)
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-5)


def test_hadamard_is_orthonormal_and_chosen_positions_are_the_allowed_topk():
    q = torch.randn(3, 16, dtype=torch.float64)
    torch.testing.assert_close(hadamard(q) @ hadamard(q).T, q @ q.T)
    scores = torch.tensor([[[3.0, 1.0, 2.0, 9.0], [0.0, 5.0, 4.0, 1.0]]])
    allowed = torch.tensor([[[True, True, True, False], [True, True, False, False]]])
    chosen = chosen_positions(scores, allowed, 2)
    assert chosen.tolist() == [[[True, False, True, False], [True, True, False, False]]]


def reference_indexer_loss(ours, x, rotary, sparse: bool) -> torch.Tensor:
    """The KL divergence written out from the layer's parts, one query at a time."""
    with torch.no_grad():
        q_in = ours.q_layernorm(ours.linear_q_down_proj(x)[0])
        c, k_rope = ours.linear_kv_down_proj(x)[0].split([KV_LORA, ROPE], -1)
        query, key, _ = ours._up_projections(q_in, ours.kv_layernorm(c), k_rope, rotary)
        scores = index_scores(*ours.indexer(x, q_in, rotary), relu=True)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()[None]
    chosen = chosen_positions(scores, causal, TOPK)
    total = 0.0
    for b in range(x.shape[1]):
        for i in range(SEQ):
            keep = chosen[b, i] if sparse else causal[0, i]
            logits = torch.einsum("nd,tnd->nt", query[i, b], key[:, b]) * ours.softmax_scale
            p = torch.softmax(logits[:, keep], -1).sum(0)
            p = p / p.sum()
            log_q = torch.log_softmax(scores[b, i, keep], -1)
            total += float((p * (p.log() - log_q)).sum())
    return torch.tensor(total / (x.shape[1] * SEQ))


@pytest.mark.parametrize("sparse", [False, True])
def test_indexer_loss_is_the_kl_divergence_and_trains_the_indexer_alone(sparse):
    config = mp_config(dsa_indexer_loss_coeff=0.5, dsa_indexer_use_sparse_loss=sparse)
    torch.manual_seed(4)
    ours = MultiLatentAttention(config, ModelGroups.single(), spec=LOCAL_SPEC).train()
    x = torch.randn(SEQ, 2, H, generator=torch.Generator().manual_seed(5), requires_grad=True)
    rotary = RotaryEmbedding(ROPE, 1.0, 10000, yarn=yarn_scaling(config))(SEQ)
    ours.indexer.aux_loss_scale = AuxLossScale("dsa", 2.0)
    out = ours(x, rotary)[0]
    loss = ours.indexer.take_loss()
    want = reference_indexer_loss(ours, x.detach(), rotary, sparse) * 0.5
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    # backward of a loss that ignores the output: only the indexer loss (times the
    # scale 2) reaches any gradient, and only the indexer's
    (out * 0).sum().backward()
    indexer = {f"indexer.{n}" for n, _ in ours.indexer.named_parameters()}
    for name, p in ours.named_parameters():
        has = p.grad is not None and bool(p.grad.abs().sum() > 0)
        assert has == (name in indexer), name
    assert x.grad is None or not x.grad.abs().sum()
    grads = {n: p.grad.clone() for n, p in ours.indexer.named_parameters()}
    ours.zero_grad()
    x.grad = None
    ours.indexer.aux_loss_scale = AuxLossScale("dsa", 1.0)
    (ours(x, rotary)[0] * 0).sum().backward()
    for n, p in ours.indexer.named_parameters():
        torch.testing.assert_close(grads[n], 2 * p.grad)


def test_without_the_loss_the_indexer_keeps_no_graph():
    ours = MultiLatentAttention(mp_config(), ModelGroups.single(), spec=LOCAL_SPEC).train()
    x = torch.randn(SEQ, 2, H, requires_grad=True)
    rotary = RotaryEmbedding(ROPE, 1.0, 10000)(SEQ)
    ours(x, rotary)[0].sum().backward()
    assert all(p.grad is None for p in ours.indexer.parameters())
    assert float(ours.indexer.take_loss()) == 0.0


def test_dsa_sharded_names_are_megatrons():
    ours = MultiLatentAttention(mp_config(), ModelGroups.single(), spec=LOCAL_SPEC)
    names = {n for n in ours.sharded_state_dict("a.") if "indexer" in n}
    assert names == {f"a.core_attention.indexer.{n}" for n in (
        "linear_wq_b.weight", "linear_wk.weight", "k_norm.weight", "k_norm.bias",
        "linear_weights_proj.weight")}  # fmt: skip


NO_YARN = dict(yarn_rotary_scaling_factor=1.0, yarn_original_max_position_embeddings=4096,
               yarn_mscale=1.0, yarn_mscale_all_dim=0.0)  # fmt: skip


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(multi_latent_attention=False, qk_layernorm=False, kv_lora_rank=32, qk_head_dim=128,
              qk_pos_emb_head_dim=64, v_head_dim=128, q_lora_rank=None, **NO_YARN),
         r"'dsa' needs multi_latent_attention=True"),
        (dict(dsa_indexer_topk=None), r"'dsa' needs dsa_indexer_topk"),
        (dict(dsa_indexer_n_heads=0), r"dsa_indexer_n_heads=0 must be a positive integer"),
        (dict(dsa_indexer_head_dim=12), r"needs dsa_indexer_head_dim a power of 2"),
        (dict(dsa_indexer_head_dim=2, dsa_indexer_rotate_activation=False),
         r"dsa_indexer_head_dim=2 < qk_pos_emb_head_dim=4"),
        (dict(dsa_kernel_backend="tilelang"), r"dsa_kernel_backend='tilelang' needs Megatron"),
        (dict(dsa_indexer_topk_freq=2, mtp_num_layers=2),
         r"mtp_num_layers=2: multi-token prediction depth 2 would reuse"),
        (dict(dsa_indexer_skip_topk_offset=-1), r"dsa_indexer_skip_topk_offset=-1 must be"),
        (dict(dsa_indexer_loss_coeff=-1.0), r"dsa_indexer_loss_coeff=-1.0 must be >= 0"),
        (dict(add_bias_linear=True), r"add_bias_linear=True with experimental_attention"),
        (dict(experimental_attention_variant=None), r"dsa_indexer_n_heads=4 needs experimental"),
    ],
)  # fmt: skip
def test_dsa_configuration_is_checked(changes, message):
    with pytest.raises(ValueError, match=message):
        mp_config(**changes)


def test_dsa_under_context_parallelism_refuses_tracking_the_largest_logit():
    mp_config().check_parallel(1, 2)
    with pytest.raises(ValueError, match=r"context_parallel_size=2 with experimental_"):
        mp_config(log_max_attention_logit=True, cp_comm_type="a2a").check_parallel(1, 2)


def sharing_model(**changes) -> GPTModel:
    """Four layers, the choice shared (freq 2, offset 1): layers 1 and 3 choose, 2 and 4
    reuse 1's and 3's (1-based; Megatron's rule). 16 indexer heads, so that no key scores
    exactly 0 in every head (chosen_positions: ties)."""
    config = mp_config(num_layers=4, dsa_indexer_topk_freq=2, dsa_indexer_skip_topk_offset=1,
                       init_method_std=0.2, dsa_indexer_n_heads=16, **changes)  # fmt: skip
    torch.manual_seed(6)
    return GPTModel(config, "local", 64, SEQ, groups=ModelGroups.single(),
                    parallel_output=False).eval()  # fmt: skip


def test_layers_that_share_attend_to_their_sources_choice():
    assert [
        dsa_choice_source(mp_config(dsa_indexer_topk_freq=3, dsa_indexer_skip_topk_offset=2), layer)
        for layer in range(8)
    ] == [0, 1, 1, 1, 4, 4, 4, 7]
    gpt = sharing_model()
    attentions = [layer.self_attention for layer in gpt.decoder.layers]
    assert [a.indexer is not None for a in attentions] == [True, False, True, False]
    names = {n for n in gpt.sharded_state_dict() if ".indexer." in n}
    assert {int(n.split(".")[2]) for n in names} == {0, 2}
    masks = {}
    for i, attention in enumerate(attentions):
        attention.core_attention.register_forward_pre_hook(
            lambda module, args, i=i: masks.__setitem__(i, args[3])
        )
    tokens = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        gpt(tokens)
    assert torch.equal(masks[1], masks[0]) and torch.equal(masks[3], masks[2])
    assert not torch.equal(masks[2], masks[0])  # layer 3 chose for itself
    assert int((~masks[2][:, :, -1]).sum(-1).max()) == TOPK  # the last query: TOPK positions


def test_shared_choices_generate_through_a_cache_as_the_whole_sequence():
    gpt = sharing_model()
    tokens = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        whole = gpt(tokens)[0]
        cache = KVCache(torch.zeros(1, dtype=torch.long), SEQ)
        steps = [gpt(tokens[:, :9], kv_cache=cache)[0, -1]]
        steps += [gpt(tokens[:, i : i + 1], kv_cache=cache)[0, -1] for i in range(9, SEQ)]
    torch.testing.assert_close(torch.stack(steps), whole[8:], rtol=1e-5, atol=1e-5)


def test_a_stage_must_hold_the_layer_whose_choice_it_reuses():
    config = mp_config(num_layers=4, dsa_indexer_topk_freq=2, dsa_indexer_skip_topk_offset=1)
    with pytest.raises(ValueError, match=r"layer 2 reuses the positions layer 1 chooses"):
        GPTModel(config, "local", 64, SEQ, groups=ModelGroups.single(), layer_offset=1,
                 num_layers=2, pre_process=False)  # fmt: skip
    GPTModel(
        config,
        "local",
        64,
        SEQ,
        groups=ModelGroups.single(),
        layer_offset=2,
        num_layers=2,
        pre_process=False,
    )  # layers 3 and 4: 3 chooses


def test_scores_and_loss_in_blocks_of_queries_equal_them_whole(monkeypatch):
    """CHUNK_BYTES small enough for blocks of 3 queries: the same scores, loss and
    gradients (the blocks' products recomputed in backward)."""
    config = mp_config(dsa_indexer_loss_coeff=1.0, init_method_std=0.3)  # a loss well above
    torch.manual_seed(9)  # the rounding of its near-uniform distributions
    ours = MultiLatentAttention(config, ModelGroups.single(), spec=LOCAL_SPEC).train()
    x = torch.randn(SEQ, 2, H, generator=torch.Generator().manual_seed(10))
    rotary = RotaryEmbedding(ROPE, 1.0, 10000, yarn=yarn_scaling(config))(SEQ)
    results = []
    for chunk in (sparse_attention.CHUNK_BYTES, 4 * 2 * IDX_HEADS * SEQ * 3):
        monkeypatch.setattr(sparse_attention, "CHUNK_BYTES", chunk)
        ours.zero_grad()
        out = ours(x, rotary)[0]
        out.square().sum().backward()
        grads = {n: p.grad.clone() for n, p in ours.named_parameters()}
        results.append((out.detach(), ours.indexer.take_loss(), grads))
    (out, loss, grads), (out_b, loss_b, grads_b) = results
    assert sparse_attention._query_rows(2, IDX_HEADS, SEQ) == 3
    torch.testing.assert_close(out_b, out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss_b, loss, rtol=1e-6, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert grads["indexer.linear_wq_b.weight"].abs().sum() > 0


def test_packed_documents_choose_within_themselves_as_alone():
    """Two documents packed into each sample (PackedSeqParams, positions restarting): each
    query's choice stays within its document, and the logits of each document equal those
    of the document run alone; the indexer's loss and gradients too."""
    config = mp_config(num_layers=2, init_method_std=0.2, dsa_indexer_n_heads=16,
                       dsa_indexer_loss_coeff=1.0)  # fmt: skip
    torch.manual_seed(11)
    gpt = GPTModel(config, "local", 64, SEQ, groups=ModelGroups.single(),
                   parallel_output=False).train()  # fmt: skip
    tokens = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(12))
    cut = 10
    documents = (torch.arange(SEQ) >= cut).long()[None]
    packed = PackedSeqParams.from_document_ids(documents)
    indexers = [m for m in gpt.modules() if isinstance(m, LightningIndexer)]
    whole = gpt(tokens, attention_mask=packed)
    whole.square().mean().backward()
    packed_loss = sum(i.take_loss() for i in indexers)
    packed_grads = {n: p.grad.clone() for n, p in gpt.named_parameters()}
    gpt.zero_grad()
    alone, losses = [], []
    for part in (tokens[:, :cut], tokens[:, cut:]):
        alone.append(gpt(part))
        losses.append(sum(i.take_loss() for i in indexers))
    (torch.cat(alone, dim=1).square().mean()).backward()
    torch.testing.assert_close(torch.cat(alone, dim=1), whole, rtol=1e-5, atol=1e-5)
    # the packed loss is the mean over all queries: each document's mean by its share
    shares = (losses[0] * cut + losses[1] * (SEQ - cut)) / SEQ
    torch.testing.assert_close(packed_loss, shares, rtol=1e-5, atol=0)
    assert float(packed_loss) > 0
    for name, grad in packed_grads.items():
        if ".indexer." not in name:
            torch.testing.assert_close(gpt.get_parameter(name).grad, grad, rtol=1e-4,
                                       atol=1e-6, msg=name)  # fmt: skip


def test_a_multi_token_prediction_layer_chooses_its_own_positions():
    """Sharing (freq 2, offset 1) makes the last decoder layer reuse the first's choice;
    the MTP module's layer, shaped as the last, holds an indexer of its own and chooses
    for itself (Megatron numbers the MTP layers apart: its first chooses), trained by its
    loss; two MTP depths, the second of which the rule would share, are refused (above)."""
    config = mp_config(dsa_indexer_topk_freq=2, dsa_indexer_skip_topk_offset=1,
                       mtp_num_layers=1, dsa_indexer_loss_coeff=1.0, init_method_std=0.2,
                       untie_embeddings_and_output_weights=True)  # fmt: skip
    torch.manual_seed(13)
    gpt = GPTModel(config, "local", 64, SEQ, groups=ModelGroups.single()).train()
    assert gpt.decoder.layers[1].self_attention.indexer is None
    mtp_attention = gpt.mtp.layers[0].transformer_layer.self_attention
    assert mtp_attention.indexer is not None
    names = {n for n in gpt.sharded_state_dict() if ".indexer.linear_wk." in n}
    assert names == {"decoder.layers.0.self_attention.core_attention.indexer.linear_wk.weight",
                     "mtp.layers.0.transformer_layer.self_attention.core_attention.indexer."
                     "linear_wk.weight"}  # fmt: skip
    tokens = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(14))
    gpt(tokens, labels=tokens.roll(-1, 1)).mean().backward()
    assert float(mtp_attention.indexer.take_loss()) > 0
    assert mtp_attention.indexer.linear_wq_b.weight.grad.abs().sum() > 0


def test_the_key_norm_in_fp32_runs_on_bf16_weights_and_matches_fp32():
    """dsa_indexer_k_norm_fp32 normalizes a bf16 layer's indexer key in fp32 (its bf16
    norm parameters too): closer to the fp32 layer's key than the bf16 norm gets."""
    torch.manual_seed(15)
    fp32 = MultiLatentAttention(mp_config(), ModelGroups.single(), spec=LOCAL_SPEC).indexer
    x = torch.randn(SEQ, 2, H)
    q_in = torch.randn(SEQ, 2, Q_LORA)
    rotary = RotaryEmbedding(ROPE, 1.0, 10000)(SEQ)
    with torch.no_grad():
        fp32.k_norm.weight.uniform_(0.5, 1.5)
        fp32.k_norm.bias.uniform_(-0.5, 0.5)
        want = fp32(x, q_in, rotary)[1]
        keys = {}
        for in_fp32 in (False, True):
            config = mp_config(params_dtype=torch.bfloat16, bf16=True,
                               dsa_indexer_k_norm_fp32=in_fp32)  # fmt: skip
            bf16 = MultiLatentAttention(config, ModelGroups.single(), spec=LOCAL_SPEC).indexer
            bf16.load_state_dict({k: v.bfloat16() for k, v in fp32.state_dict().items()})
            keys[in_fp32] = bf16(x.bfloat16(), q_in.bfloat16(), rotary)[1].float()
    errors = {f: float((k - want).abs().max()) for f, k in keys.items()}
    assert errors[True] <= errors[False], errors


def test_attention_dropout_does_nothing_in_a_dsa_layer():
    """Megatron's DSAttention drops no probabilities: attention_dropout 0.5 in training
    gives the output of dropout 0 with the same weights (documented as a no-op)."""
    outputs = []
    for dropout in (0.0, 0.5):
        torch.manual_seed(16)
        layer = MultiLatentAttention(mp_config(attention_dropout=dropout),
                                     ModelGroups.single(), spec=LOCAL_SPEC).train()  # fmt: skip
        x = torch.randn(SEQ, 2, H, generator=torch.Generator().manual_seed(17))
        outputs.append(layer(x, RotaryEmbedding(ROPE, 1.0, 10000)(SEQ))[0])
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)
