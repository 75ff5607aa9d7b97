"""compile_layers compiles each layer in place; a MoE MLP and selective recompute's core
attention stay eager inside it. Dynamo's "eager" backend runs the captured graphs as
they are (no inductor code generation: the test takes seconds), so the loss and
gradients equal the uncompiled model's, over two steps that compile once."""

import pytest
import torch
import torch._dynamo

from mp_layers import GPTModel, ModelGroups, PackedSeqParams, TransformerConfig, compile_layers

VOCAB, SEQ = 64, 16


def two_steps(compiled: bool):
    """(losses, gradients, state_dict keys before and after compile_layers, Dynamo's
    graph count after each step)."""
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
        ffn_hidden_size=64, add_bias_linear=False, num_moe_experts=4, moe_router_topk=2,
        moe_layer_freq=[1, 0], moe_aux_loss_coeff=1e-2, recompute_granularity="selective",
        hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPTModel(config, "local", VOCAB, SEQ, groups=ModelGroups.single()).train()
    keys = [list(model.state_dict())]
    if compiled:
        assert compile_layers(model, backend="eager") == 2
    keys.append(list(model.state_dict()))
    generator = torch.Generator().manual_seed(1)
    losses, graphs = [], []
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
        loss = model(ids, labels=ids.roll(-1, 1)).mean()
        loss.backward()
        losses.append(loss.detach())
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return losses, {n: p.grad for n, p in model.named_parameters()}, keys, graphs


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and counters empty before, and no compiled code left to the worker's
    later tests (or to ranks they fork) after."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_layers_equal_eager_with_moe_and_selective_recompute(fresh_dynamo):
    counters = torch._dynamo.utils.counters
    counters.clear()
    want_losses, want_grads, _, _ = two_steps(compiled=False)
    losses, grads, keys, graphs = two_steps(compiled=True)
    assert keys[0] == keys[1]  # names and checkpoints unchanged
    torch.testing.assert_close(losses, want_losses)
    torch.testing.assert_close(grads, want_grads)
    # Breaks only at the eager functions: the MoE layer's forward, the checkpoint.
    assert counters["graph_break"], "nothing stayed eager"
    for reason in counters["graph_break"]:
        assert "MoELayer.forward" in reason or "checkpointed" in reason, reason
    # The pieces of a dense and of a MoE layer, all compiled in the first step.
    assert graphs[0] == graphs[1] > 0, graphs


def test_a_hybrid_models_mamba_layers_compile_and_equal_eager(fresh_dynamo):
    """A Mamba layer and an attention layer, both compiled: the same loss and gradients."""
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, hybrid_layer_pattern="M*",
        mamba_num_heads=8, mamba_head_dim=8, mamba_num_groups=2, mamba_state_dim=16,
        normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0,
    )  # fmt: skip
    torch._dynamo.utils.counters.clear()
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = GPTModel(config, "local", VOCAB, SEQ, groups=ModelGroups.single()).train()
        if compiled:
            assert compile_layers(model, backend="eager") == 2
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
        loss = model(ids, labels=ids.roll(-1, 1)).mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[1], results[0])
    # The scan traces whole: the only breaks are at the attention layer's blocked core
    # attention, eager by design.
    for reason in torch._dynamo.utils.counters["graph_break"]:
        assert "blocked_attention" in reason, reason


def packed_steps(compiled: bool, steps: int = 4):
    """(losses, gradients) of `steps` batches whose documents end at new places each time."""
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
        ffn_hidden_size=64, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPTModel(config, "local", VOCAB, SEQ, groups=ModelGroups.single()).train()
    if compiled:
        compile_layers(model, backend="eager")
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
        ends = torch.randperm(SEQ - 1, generator=generator)[:3] + 1
        documents = (torch.arange(SEQ)[None, :, None] >= ends.view(1, 1, -1)).sum(-1)
        packed = PackedSeqParams.from_document_ids(documents.expand(2, SEQ))
        loss = model(ids, attention_mask=packed, labels=ids.roll(-1, 1)).mean()
        loss.backward()
        losses.append(loss.detach())
    return losses, {n: p.grad for n, p in model.named_parameters()}


def test_packed_documents_compile_once_whatever_their_bounds(fresh_dynamo):
    """Each batch's documents end elsewhere: the packed attention stays eager inside the
    compiled layer, which compiled attends document by document with new lengths each
    batch (a recompile at each, until torch's limit of 8 left it eager)."""
    torch._dynamo.utils.counters.clear()
    want = packed_steps(compiled=False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = packed_steps(compiled=True)
    torch.testing.assert_close(got, want)
    for reason in torch._dynamo.utils.counters["graph_break"]:
        assert "_attend_packed" in reason, reason
