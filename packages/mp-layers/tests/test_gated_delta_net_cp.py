"""The gated DeltaNet across context-parallel ranks (the layer itself: test_gated_delta_net.py):
at CP2 and TP2 x CP2, without packing and with samples split either way (by sample, by
document), against one rank: outputs, input gradients, and every parameter's gradient
summed over the CP ranks (the data-parallel reduction over dp x cp), each TP rank's the
pieces of its key heads."""

import pytest
import torch

from mp_layers import ModelGroups, PackedSeqParams, TransformerConfig
from mp_layers.transformer import gated_delta_net
from mp_layers.transformer.gated_delta_net import GatedDeltaNet
from mp_layers.transformer.spec import LOCAL_SPEC
from mp_state.testing import run_on_ranks

H, KEY_HEADS, S = 32, 4, 24
CHUNK = 8  # the rule's chunk here: documents start inside chunks and at their edges
SPLITS = {
    "unpacked": None,
    # documents of any length: the samples split as without packing
    "by-sample": [[5, 11, 8], [3, 21]],
    # every length divisible by 2 x cp: each document split into the ranks' chunks
    "by-document": [[8, 4, 12], [24]],
}


def layer(groups: ModelGroups) -> GatedDeltaNet:
    """The same weights at every layout (a seed draws the same model at every TP size),
    A_log drawn to slow decays so that states carry far."""
    settings = dict(num_layers=1, hidden_size=H, num_attention_heads=4, normalization="RMSNorm",
                    activation="swiglu",
                    add_bias_linear=False, init_method_std=0.2, attention_dropout=0.0,
                    experimental_attention_variant="gdn", linear_attention_freq=[1],
                    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=KEY_HEADS,
                    linear_num_value_heads=2 * KEY_HEADS)  # fmt: skip
    torch.manual_seed(0)
    made = GatedDeltaNet(TransformerConfig(**settings), groups, spec=LOCAL_SPEC)
    a_log = torch.rand(2 * KEY_HEADS, generator=torch.Generator().manual_seed(3)) * -3
    with torch.no_grad():
        made.A_log.copy_(a_log.chunk(groups.tp.size)[groups.tp.rank])
    return made.train()


def documents_of(lengths: list[list[int]]) -> torch.Tensor:
    """[b, s] document ids 0, 1, ... of the given lengths, a row per sample."""
    return torch.stack([torch.arange(len(row)).repeat_interleave(torch.tensor(row))
                        for row in lengths])  # fmt: skip


def cp_body(tp: int, split: str):
    import mp_state

    torch.set_num_threads(1)
    gated_delta_net.DELTA_CHUNK = CHUNK
    state = mp_state.initialize(
        mp_state.ParallelConfig(tensor_model_parallel_size=tp, context_parallel_size=2)
    )
    groups = ModelGroups.of(state)
    ours = layer(groups)
    x = torch.randn(S, 2, H, generator=torch.Generator().manual_seed(2))
    lengths = SPLITS[split]
    cp, rank = groups.cp.size, groups.cp.rank
    if lengths is None:
        packed = None
        places = PackedSeqParams.from_document_ids(torch.zeros(2, S, dtype=torch.long), cp, rank)
    else:
        packed = places = PackedSeqParams.from_document_ids(documents_of(lengths), cp, rank)
    assert packed is None or packed.split == split.removeprefix("by-")
    index = places.shard(torch.arange(S).expand(2, S)).t()  # [s, b] the local tokens' places
    local = x[index, torch.arange(2)].requires_grad_()
    out, _ = ours(local, attention_mask=packed)
    out.square().sum().backward()
    grads = [p.grad for p in ours.parameters()]
    return groups.tp.rank, index, out.detach(), local.grad, grads


CASES = [*((1, split) for split in SPLITS), (2, "by-document")]


@pytest.mark.multirank
@pytest.mark.parametrize(("tp", "split"), CASES)
def test_cp2_equals_one_rank(monkeypatch, tp, split):
    monkeypatch.setattr(gated_delta_net, "DELTA_CHUNK", CHUNK)
    one = layer(ModelGroups.single())
    x = torch.randn(S, 2, H, generator=torch.Generator().manual_seed(2), requires_grad=True)
    lengths = SPLITS[split]
    packed = None if lengths is None else PackedSeqParams.from_document_ids(documents_of(lengths))
    want, _ = one(x, attention_mask=packed)
    want.square().sum().backward()
    ranks = run_on_ranks(cp_body, 2 * tp, tp, split, timeout=120)
    samples = torch.arange(2)
    for _, index, out, grad, _ in ranks:
        torch.testing.assert_close(out, want.detach()[index, samples], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, x.grad[index, samples], rtol=1e-4, atol=1e-5)
    summed = []
    for tp_rank in range(tp):
        pieces = [grads for t, *_, grads in ranks if t == tp_rank]
        assert len(pieces) == 2
        summed.append([a + b for a, b in zip(*pieces, strict=True)])
    for (name, param), *pieces in zip(one.named_parameters(), *summed, strict=True):
        if name == "out_norm.weight":  # shared by the heads: each TP rank's partial sum
            whole = sum(pieces)
        else:
            whole = torch.cat(pieces, dim=1 if name == "out_proj.weight" else 0)
        scale = param.grad.abs().max().item()
        torch.testing.assert_close(whole, param.grad, rtol=0, atol=1e-5 * scale, msg=name)


def test_the_key_heads_must_divide_over_tp_and_cp():
    with pytest.raises(ValueError, match=r"linear_num_key_heads=4 is not divisible by "
                       r"tensor_model_parallel_size x context_parallel_size=8"):  # fmt: skip
        layer_config().check_parallel(2, 4)
    layer_config().check_parallel(2, 2)


def layer_config() -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4,
                             attention_dropout=0.0, activation="swiglu",
                             experimental_attention_variant="gdn",
                             linear_attention_freq=[1],
                             linear_num_key_heads=KEY_HEADS,
                             linear_num_value_heads=2 * KEY_HEADS)  # fmt: skip
