"""The Mamba-2 mixer of hybrid models: the chunked scan against the recurrence position by
position, and over packed documents against each document scanned alone; the mixer
against transformers' NemotronHMamba2Mixer (its torch path) with the same weights, and at
TP2 (with and without sequence parallelism) against one rank."""

import functools
import os

import pytest
import torch

from mp_layers import ModelGroups, TransformerConfig
from mp_layers.transformer.mamba_layer import MambaLayer
from mp_layers.transformer.mamba_mixer import MambaMixer
from mp_layers.transformer.ssd import chunked_scan, recurrent_step
from mp_state.testing import run_on_ranks

os.environ.setdefault("HF_HUB_OFFLINE", "1")

H, HEADS, P, GROUPS, N = 32, 8, 8, 2, 16


def scan_inputs(s: int) -> tuple[torch.Tensor, ...]:
    """x, dt, A, B, C, D and an initial state of 2 samples of s positions, 3 heads of 4
    channels in one group, a state of 5."""
    torch.manual_seed(0)
    b, h, p, n = 2, 3, 4, 5
    x, B, C = torch.randn(b, s, h, p), torch.randn(b, s, 1, n), torch.randn(b, s, 1, n)
    dt, A, D = torch.rand(b, s, h), -torch.rand(h) * 2, torch.randn(h)
    return x, dt, A, B, C, D, torch.randn(b, h, p, n)


@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_the_chunked_scan_is_the_recurrence(chunk):
    x, dt, A, B, C, D, initial = scan_inputs(11)
    s = x.shape[1]
    state, want = initial, []
    for t in range(s):
        y, state = recurrent_step(state, x[:, t], dt[:, t], A, B[:, t], C[:, t], D)
        want.append(y)
    got, final = chunked_scan(x, dt, A, B, C, D, chunk, initial)
    torch.testing.assert_close(got, torch.stack(want, dim=1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_the_scan_restarts_at_each_document(chunk):
    x, dt, A, B, C, D, initial = scan_inputs(23)
    # Documents as runs of ids; sample 1 uses an id twice (two documents, not one).
    lengths = [[4, 1, 8, 10], [9, 7, 7]]
    ids = [[7, 3, 9, 4], [5, 6, 5]]
    documents = torch.stack([torch.tensor(row).repeat_interleave(torch.tensor(sizes))
                             for row, sizes in zip(ids, lengths, strict=True)])  # fmt: skip
    got, final = chunked_scan(x, dt, A, B, C, D, chunk, initial, documents)
    for i, sizes in enumerate(lengths):
        start = 0
        for j, size in enumerate(sizes):
            piece = slice(start, start + size)
            first = initial[i : i + 1] if j == 0 else None  # the initial state: the first's
            want, state = chunked_scan(x[i : i + 1, piece], dt[i : i + 1, piece], A,
                                       B[i : i + 1, piece], C[i : i + 1, piece], D, chunk,
                                       first)  # fmt: skip
            torch.testing.assert_close(got[i : i + 1, piece], want, rtol=1e-5, atol=1e-5)
            start += size
        torch.testing.assert_close(final[i : i + 1], state, rtol=1e-5, atol=1e-5)
    # Without the documents the state runs on across them.
    whole, _ = chunked_scan(x, dt, A, B, C, D, chunk, initial)
    assert (whole[0, 4:] - got[0, 4:]).abs().max() > 1e-2


def config(**settings) -> TransformerConfig:
    base = dict(num_layers=1, hidden_size=H, num_attention_heads=4, hybrid_layer_pattern="M",
                mamba_num_heads=HEADS, mamba_head_dim=P, mamba_num_groups=GROUPS,
                mamba_state_dim=N, normalization="RMSNorm", add_bias_linear=False,
                hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.2)  # fmt: skip
    return TransformerConfig(**base | settings)


def randomized(mixer: MambaMixer) -> MambaMixer:
    """Every parameter drawn anew (the ones and fixed ranges of the initialization would
    hide a swapped D or norm weight), A_log and dt_bias kept in their ranges."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in mixer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
        mixer.A_log.copy_(torch.rand(mixer.A_log.shape, generator=gen) * 2)
    return mixer


def test_the_mixer_equals_transformers_nemotron_h_mixer():
    transformers = pytest.importorskip("transformers")
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    hf_config = transformers.NemotronHConfig(
        hidden_size=H, mamba_num_heads=HEADS, mamba_head_dim=P, n_groups=GROUPS,
        ssm_state_size=N, conv_kernel=4, use_conv_bias=True, use_bias=False,
        layer_norm_epsilon=1e-5, chunk_size=16, time_step_min=0.0,
        layers_block_type=["mamba"] * 1, num_attention_heads=4,
    )  # fmt: skip
    theirs = NemotronHMamba2Mixer(hf_config, layer_idx=0).eval()
    ours = randomized(MambaMixer(config(), ModelGroups.single())).eval()
    inner, gn = HEADS * P, GROUPS * N
    state = ours.sharded_state_dict()
    flat = {k: v.data.reshape(v.global_shape[0] * v.data.shape[1], *v.data.shape[2:])
            if v.data.dim() > 1 and k.split(".")[0] in ("in_proj", "conv1d") else v.data
            for k, v in state.items()}  # fmt: skip
    in_proj = torch.cat([flat[f"in_proj.{p}.weight"] for p in ("z", "x", "B", "C", "dt")])
    assert in_proj.shape == (2 * inner + 2 * gn + HEADS, H)
    conv = torch.cat([flat[f"conv1d.{p}.weight"] for p in ("x", "B", "C")])
    conv_bias = torch.cat([flat[f"conv1d.{p}.bias"] for p in ("x", "B", "C")])
    with torch.no_grad():
        theirs.in_proj.weight.copy_(in_proj)
        theirs.conv1d.weight.copy_(conv[:, None, :])
        theirs.conv1d.bias.copy_(conv_bias)
        for name in ("dt_bias", "A_log", "D"):
            getattr(theirs, name).copy_(flat[name])
        theirs.norm.weight.copy_(flat["norm.weight"])
        theirs.out_proj.weight.copy_(flat["out_proj.weight"])
        x = torch.randn(2, 37, H)  # three chunks of 16, the last one short
        want = theirs(x)
        got, bias = ours(x.transpose(0, 1))
    assert bias is None
    torch.testing.assert_close(got.transpose(0, 1), want, rtol=1e-5, atol=1e-5)


def tp_body(sequence_parallel: bool) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    import mp_state

    torch.set_num_threads(1)
    state = mp_state.initialize(mp_state.ParallelConfig(tensor_model_parallel_size=2))
    groups = ModelGroups.of(state)
    torch.manual_seed(0)
    mixer = MambaMixer(config(sequence_parallel=sequence_parallel), groups)
    x = torch.randn(12, 2, H, generator=torch.Generator().manual_seed(2), requires_grad=True)
    local = x.chunk(2)[groups.tp.rank] if sequence_parallel else x
    out, _ = mixer(local)
    out.square().sum().backward()
    return out.detach(), x.grad, [p.grad for p in mixer.parameters()]


@pytest.mark.multirank
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp2_equals_one_rank(sequence_parallel):
    torch.manual_seed(0)
    one = MambaMixer(config(), ModelGroups.single())
    x = torch.randn(12, 2, H, generator=torch.Generator().manual_seed(2), requires_grad=True)
    want, _ = one(x)
    (want.square().sum()).backward()
    ranks = run_on_ranks(tp_body, 2, sequence_parallel, timeout=120)
    outs = [out for out, _, _ in ranks]
    got = torch.cat(outs) if sequence_parallel else outs[0]
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    grads = [grad for _, grad, _ in ranks]
    x_grad = grads[0] + grads[1] if sequence_parallel else grads[0]
    torch.testing.assert_close(x_grad, x.grad, rtol=1e-4, atol=1e-5)
    # Each rank's parameters are its groups' piece of one rank's: in_proj and conv1d by
    # whole groups (their first dimension), out_proj by columns.
    for (name, param), *pieces in zip(one.named_parameters(), *(g for _, _, g in ranks),
                                      strict=True):  # fmt: skip
        dim = 1 if name == "out_proj.weight" else 0
        scale = param.grad.abs().max().item()  # gradients up to ~100: fp32 sums of many terms
        torch.testing.assert_close(torch.cat(pieces, dim=dim), param.grad, rtol=0,
                                   atol=1e-5 * scale, msg=name)  # fmt: skip


def test_the_recomputed_training_path_equals_the_kept_one():
    """In training the mixer keeps its convolution's inputs, dt and the gate and computes the
    rest again in backward: the same output and gradients as keeping everything
    (recompute False), and fewer tensors kept."""
    results = []
    for recompute in (True, False):
        torch.manual_seed(0)
        mixer = randomized(MambaMixer(config(), ModelGroups.single())).train()
        mixer.recompute = recompute
        x = torch.randn(40, 2, H, generator=torch.Generator().manual_seed(2), requires_grad=True)
        kept: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(functools.partial(_keep, kept), _same):
            out, _ = mixer(x)
        out.square().sum().backward()
        results.append((out.detach(), x.grad, [p.grad for p in mixer.parameters()], len(kept)))
    (out, x_grad, grads, few), (want, want_x, want_grads, many) = results
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(x_grad, want_x)
    torch.testing.assert_close(grads, want_grads)
    assert few < many / 2, (few, many)


def _keep(kept: list, t: torch.Tensor) -> torch.Tensor:
    kept.append(t)
    return t


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def test_a_mamba_layers_mixer_output_joins_the_residual_times_the_multiplier():
    """residual_multiplier (Granite 4's) scales the mixer's part of a Mamba layer, not the
    residual it joins: x + m mixer(norm(x))."""
    torch.manual_seed(0)
    layer = MambaLayer(config(residual_multiplier=0.25), ModelGroups.single()).eval()
    randomized(layer.mixer)
    x = torch.randn(12, 2, H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        mixed, _ = layer.mixer(layer.norm(x))
        torch.testing.assert_close(layer(x), x + 0.25 * mixed, rtol=0, atol=1e-6)
        assert not torch.allclose(layer(x), x + mixed, atol=1e-3)
