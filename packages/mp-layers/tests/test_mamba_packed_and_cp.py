"""The Mamba-2 mixer over packed documents and across context-parallel ranks (the scan over
documents: test_mamba_mixer.py): the mixer over packed samples against each document
mixed alone; at CP2 (and TP2 x CP2), without packing and with samples split
either way (by sample, by document), with whole groups per rank and with a group's heads
shared out over the CP ranks, against one rank, outputs and gradients."""

import pytest
import torch

from mp_layers import ModelGroups, PackedSeqParams, TransformerConfig
from mp_layers.transformer import mamba_mixer
from mp_layers.transformer.mamba_mixer import MambaMixer
from mp_state.testing import run_on_ranks

H, HEADS, P, GROUPS, N = 32, 8, 8, 4, 16
CHUNK = 8  # the mixers' scan chunk here: documents start inside chunks and at their edges


def config(**settings) -> TransformerConfig:
    base = dict(num_layers=1, hidden_size=H, num_attention_heads=4, hybrid_layer_pattern="M",
                mamba_num_heads=HEADS, mamba_head_dim=P, mamba_num_groups=GROUPS,
                mamba_state_dim=N, normalization="RMSNorm", add_bias_linear=False,
                hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.2)  # fmt: skip
    return TransformerConfig(**base | settings)


def mixer(groups: ModelGroups, **settings) -> MambaMixer:
    """The same weights at every layout (a seed draws the same model at every TP size),
    A_log and dt_bias drawn wider than the initialization so that states carry far."""
    torch.manual_seed(0)
    made = MambaMixer(config(**settings), groups)
    gen = torch.Generator().manual_seed(3)
    a_log, dt_bias = torch.rand(HEADS, generator=gen) * -3, torch.rand(HEADS, generator=gen) * 2 - 1
    tp, rank = groups.tp.size, groups.tp.rank
    with torch.no_grad():
        made.A_log.copy_(a_log.chunk(tp)[rank])
        made.dt_bias.copy_(dt_bias.chunk(tp)[rank])
    return made


def documents_of(lengths: list[list[int]]) -> torch.Tensor:
    """[b, s] document ids 0, 1, ... of the given lengths, a row per sample."""
    return torch.stack([torch.arange(len(row)).repeat_interleave(torch.tensor(row))
                        for row in lengths])  # fmt: skip


@pytest.mark.parametrize("training", [True, False])
def test_the_mixer_mixes_each_document_alone(monkeypatch, training):
    """Packed samples against each document through the mixer alone; in training (the
    recomputed path) the gradients too."""
    monkeypatch.setattr(mamba_mixer, "SCAN_CHUNK", CHUNK)
    lengths = [[5, 11, 8], [24]]
    packed = PackedSeqParams.from_document_ids(documents_of(lengths))
    ours = mixer(ModelGroups.single()).train(training)
    x = torch.randn(24, 2, H, generator=torch.Generator().manual_seed(2), requires_grad=True)
    got, _ = ours(x, packed=packed)
    got.square().sum().backward()
    got_grads = [p.grad.clone() for p in ours.parameters()]
    ours.zero_grad()
    alone = x.detach().clone().requires_grad_()
    total = 0
    for i, row in enumerate(lengths):
        start = 0
        for size in row:
            want, _ = ours(alone[start : start + size, i : i + 1])
            torch.testing.assert_close(got[start : start + size, i : i + 1], want,
                                       rtol=1e-5, atol=1e-5)  # fmt: skip
            total = total + want.square().sum()
            start += size
    total.backward()
    torch.testing.assert_close(x.grad, alone.grad, rtol=1e-4, atol=1e-5)
    for got_grad, param in zip(got_grads, ours.parameters(), strict=True):
        torch.testing.assert_close(got_grad, param.grad, rtol=1e-4, atol=1e-4)
    # Unpacked, the documents mix: the second document of sample 0 sees the first.
    mixed, _ = ours(x)
    assert (mixed[5:16, 0] - got[5:16, 0]).abs().max() > 1e-3


S = 24
SPLITS = {
    "unpacked": None,
    # documents of any length: the samples split as without packing
    "by-sample": [[5, 11, 8], [3, 21]],
    # every length divisible by 2 x cp: each document split into the ranks' chunks
    "by-document": [[8, 4, 12], [24]],
}


def cp_body(tp: int, split: str, mamba_groups: int):
    import mp_state

    torch.set_num_threads(1)
    mamba_mixer.SCAN_CHUNK = CHUNK
    state = mp_state.initialize(
        mp_state.ParallelConfig(tensor_model_parallel_size=tp, context_parallel_size=2)
    )
    groups = ModelGroups.of(state)
    ours = mixer(groups, mamba_num_groups=mamba_groups).train()
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
    out, _ = ours(local, packed=packed)
    out.square().sum().backward()
    grads = [p.grad for p in ours.parameters()]
    return (groups.tp.rank, groups.cp.rank), index, out.detach(), local.grad, grads


# (tp, split, mamba_num_groups): 4 groups give each (TP x CP) rank whole groups; 1 group
# at CP2, or 2 at TP2 x CP2, share a group's heads out over the CP ranks (its B and C
# copied to each, its norm after the all-to-all back)
CP_CASES = [*((1, split, GROUPS) for split in SPLITS), (2, "by-document", GROUPS),
            (1, "by-sample", 1), (2, "unpacked", 2)]  # fmt: skip


@pytest.mark.multirank
@pytest.mark.parametrize(("tp", "split", "mamba_groups"), CP_CASES)
def test_cp2_equals_one_rank(monkeypatch, tp, split, mamba_groups):
    monkeypatch.setattr(mamba_mixer, "SCAN_CHUNK", CHUNK)
    one = mixer(ModelGroups.single(), mamba_num_groups=mamba_groups).train()
    x = torch.randn(S, 2, H, generator=torch.Generator().manual_seed(2), requires_grad=True)
    lengths = SPLITS[split]
    packed = None if lengths is None else PackedSeqParams.from_document_ids(documents_of(lengths))
    want, _ = one(x, packed=packed)
    want.square().sum().backward()
    ranks = run_on_ranks(cp_body, 2 * tp, tp, split, mamba_groups, timeout=120)
    samples = torch.arange(2)
    for _, index, out, grad, _ in ranks:
        torch.testing.assert_close(out, want.detach()[index, samples], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, x.grad[index, samples], rtol=1e-4, atol=1e-5)
    # The CP ranks' gradients sum to one rank's (the data-parallel reduction over CP), each
    # TP rank's the pieces of its groups.
    summed = []
    for tp_rank in range(tp):
        pieces = [grads for (t, _), *_, grads in ranks if t == tp_rank]
        assert len(pieces) == 2
        summed.append([a + b for a, b in zip(*pieces, strict=True)])
    for (name, param), *pieces in zip(one.named_parameters(), *summed, strict=True):
        dim = 1 if name == "out_proj.weight" else 0
        scale = param.grad.abs().max().item()
        torch.testing.assert_close(torch.cat(pieces, dim=dim), param.grad, rtol=0,
                                   atol=1e-5 * scale, msg=name)  # fmt: skip


def test_the_groups_and_the_cp_ranks_must_divide_one_another():
    with pytest.raises(ValueError, match=r"mamba_num_groups=2, 12 Mamba heads at "
                       r"tensor_model_parallel_size=1: 2 Mamba groups per tensor-parallel "
                       r"rank and context_parallel_size=3: one must divide the other"):  # fmt: skip
        config(mamba_num_groups=2, mamba_num_heads=12).check_parallel(1, context_parallel_size=3)
    with pytest.raises(ValueError, match=r"4 Mamba heads per tensor-parallel rank are not "
                       r"divisible by context_parallel_size=8"):  # fmt: skip
        config().check_parallel(tensor_model_parallel_size=2, context_parallel_size=8)
    config().check_parallel(tensor_model_parallel_size=2, context_parallel_size=4)
