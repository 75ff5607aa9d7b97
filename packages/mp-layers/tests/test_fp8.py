"""FP8 GEMMs through torchao (mp_layers.fp8), checked in torchao's emulation on the CPU:
the settings' refusals, the device check, what each recipe casts, and a GPTModel whose
loss at TP2 with sequence parallelism equals TP1's within FP8 rounding."""

import pytest
import torch

import mp_state
from mp_layers import (
    ColumnParallelLinear,
    GPTModel,
    ModelGroups,
    TransformerConfig,
    all_reduce_sequence_parallel_grads,
    check_fp8_device,
)
from mp_layers.fp8 import Fp8Matmul, apply_fp8, fp8_layer_numbers
from mp_state import ParallelConfig
from mp_state.testing import run_on_ranks

pytest.importorskip("torchao.float8")

VOCAB, SEQ, BATCH = 128, 16, 2
LLAMA = dict(num_layers=3, hidden_size=64, num_attention_heads=4, num_query_groups=2,
             position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
             ffn_hidden_size=128, add_bias_linear=False, hidden_dropout=0.0,
             attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16)  # fmt: skip
FP8 = dict(fp8="e4m3", fp8_emulate=True)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(fp8="e4m3", fp8_recipe="delayed"), "fp8_recipe='delayed': delayed scaling"),
        (dict(fp8="e4m3", fp8_recipe="mxfp8"), "MXFP8 needs Transformer Engine"),
        (dict(fp8="hybrid", fp8_recipe="rowwise"), "rowwise recipe scales e4m3"),
        (dict(fp8="e4m3", bf16=False), "needs bf16=True"),
        (dict(fp8_recipe="rowwise"), "fp8_recipe='rowwise' needs fp8"),
        (dict(fp8_emulate=True), "fp8_emulate=True needs fp8"),
        (
            dict(
                fp8="e4m3",
                first_last_layers_bf16=True,
                num_layers_at_start_in_bf16=4,
                num_layers_at_end_in_bf16=0,
            ),
            "num_layers_at_start_in_bf16=4 exceeds num_layers=3",
        ),
        (dict(fp8="e5m2"), "fp8='e5m2' must be one of e4m3, hybrid"),
    ],
)
def test_fp8_settings_are_refused_with_the_field_at_fault(fields, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**{**LLAMA, **fields})


def test_the_bf16_ends_may_overlap_as_in_megatron():
    """Megatron-LM bounds each count, not their sum: overlapping ends keep every layer in
    bf16."""
    config = TransformerConfig(**{**LLAMA, "fp8": "e4m3", "first_last_layers_bf16": True,
                                  "num_layers_at_start_in_bf16": 2,
                                  "num_layers_at_end_in_bf16": 2})  # fmt: skip
    assert list(fp8_layer_numbers(config)) == []


def test_fp8_on_a_cpu_is_refused_in_one_line_unless_emulated():
    config = TransformerConfig(**LLAMA, fp8="hybrid")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU with FP8 tensor cores") as error:
        check_fp8_device(config, torch.device("cpu"))
    assert "\n" not in str(error.value)
    check_fp8_device(TransformerConfig(**LLAMA, **FP8), torch.device("cpu"))
    check_fp8_device(TransformerConfig(**LLAMA), torch.device("cpu"))


def _gemm(fields, x, weight):
    config = TransformerConfig(**{**LLAMA, **FP8, **fields})
    x = x.detach().requires_grad_()
    weight = torch.nn.Parameter(weight.detach().clone())
    out = Fp8Matmul(config, weight.shape[1], weight.shape[0])(x, weight)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out).to(out.dtype))
    return out, x.grad, weight.grad


def test_each_recipe_rounds_what_it_says():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 2, 64, generator=generator).bfloat16()
    weight = (torch.randn(32, 64, generator=generator) * 0.02).bfloat16()
    x_ref = x.float().requires_grad_()
    w_ref = weight.float().requires_grad_()
    out_ref = x_ref @ w_ref.t()
    out_ref.backward(torch.linspace(-1, 1, out_ref.numel()).view_as(out_ref))
    exact = (out_ref, x_ref.grad, w_ref.grad)

    def errors(result):
        pairs = zip(result, exact, strict=True)
        return [((a.float() - b).norm() / b.norm()).item() for a, b in pairs]

    e4m3 = errors(_gemm({}, x, weight))
    # FP8 e4m3 keeps 3 mantissa bits: each product is off by a few percent at most, and
    # every GEMM of the three is rounded (bf16 alone is ~0.3%).
    assert all(0.01 < e < 0.08 for e in e4m3), e4m3
    hybrid = errors(_gemm({"fp8": "hybrid"}, x, weight))
    # e5m2 (2 mantissa bits) for the output gradient: both backward GEMMs lose more.
    assert hybrid[0] == e4m3[0] and hybrid[1] > e4m3[1] and hybrid[2] > e4m3[2], (hybrid, e4m3)
    high_wgrad = errors(_gemm({"fp8_wgrad": False}, x, weight))
    # The weight gradient's GEMM unscaled: only bf16 rounding is left there.
    assert high_wgrad[:2] == e4m3[:2] and high_wgrad[2] < 0.005, high_wgrad
    rowwise = errors(_gemm({"fp8_recipe": "rowwise"}, x, weight))
    assert all(0.005 < e < 0.08 for e in rowwise) and rowwise != e4m3, rowwise


def _losses(fields: dict) -> list:
    results = []
    for tp, sequence_parallel in ((1, False), (2, True)):
        state = mp_state.initialize(ParallelConfig(tensor_model_parallel_size=tp))
        tracker = mp_state.set_random_seeds(1234, state)
        config = TransformerConfig(**LLAMA, **fields, sequence_parallel=sequence_parallel)
        model = GPTModel(config, "local", VOCAB, SEQ, groups=ModelGroups.of(state),
                         rng_tracker=tracker, init_seed=7)  # fmt: skip
        generator = torch.Generator().manual_seed(5)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        loss = model(ids, labels=labels).float().mean()
        loss.backward()
        if sequence_parallel:
            all_reduce_sequence_parallel_grads(model, state.tp)
        # A gradient every rank holds whole: the final norm's (through every layer's).
        grad = model.decoder.final_layernorm.weight.grad.float()
        results.append((loss.item(), model.decoder.fp8_linear_layers, sorted(model.state_dict())))
        results.append(grad)
        mp_state.destroy()
    return results


@pytest.mark.multirank
def test_fp8_gpt_model_at_tp2_with_sequence_parallelism_equals_tp1():
    torch.testing.assert_close(torch.zeros(1), torch.zeros(1))  # warm imports before forking
    kept = dict(first_last_layers_bf16=True, num_layers_at_start_in_bf16=1,
                num_layers_at_end_in_bf16=0)  # fmt: skip
    per_rank = run_on_ranks(_losses_of_three, 2, kept, timeout=240)
    bf16, fp8, fp8_kept = per_rank[0]
    (bf16_tp1, _, keys), bf16_grad1, (bf16_tp2, _, _), bf16_grad2 = bf16
    (fp8_tp1, linears, fp8_keys), fp8_grad1, (fp8_tp2, linears_tp2, _), fp8_grad2 = fp8
    # Four linear layers per layer (qkv, proj, fc1, fc2), every layer in FP8, or all but
    # the first: each rank's own pieces.
    assert linears == linears_tp2 == 4 * 3 and fp8_kept[0][1] == 4 * 2
    assert fp8_keys == keys  # the parameters and the checkpoint do not change
    torch.testing.assert_close(bf16_tp2, bf16_tp1, rtol=1e-3, atol=0)
    torch.testing.assert_close(bf16_grad2, bf16_grad1, rtol=0.02, atol=1e-4)
    # Each rank scales its own weight pieces at TP2, so the FP8 rounding differs from TP1's:
    # the same loss and gradients within FP8's few percent, not bit for bit.
    torch.testing.assert_close(fp8_tp2, fp8_tp1, rtol=5e-3, atol=0)
    torch.testing.assert_close(fp8_grad2.norm(), fp8_grad1.norm(), rtol=0.05, atol=0)
    assert (fp8_grad2 - fp8_grad1).norm() < 0.1 * fp8_grad1.norm()
    assert fp8_tp1 != bf16_tp1 and abs(fp8_tp1 - bf16_tp1) < 0.01 * bf16_tp1
    assert fp8_kept[0][0] not in (fp8_tp1, bf16_tp1)


def _losses_of_three(kept: dict) -> list:
    return [_losses({}), _losses(FP8), _losses({**FP8, **kept})]


def test_a_gemm_dimension_fp8_cannot_take_is_refused_naming_the_layer():
    one_rank = mp_state.RankGroup("tp", (0,), 0, None)
    linear = ColumnParallelLinear(64, 24, tp_group=one_rank, bias=False,
                                  init_method=torch.nn.init.zeros_)  # fmt: skip
    layers = torch.nn.ModuleList([torch.nn.ModuleDict({"fc": linear})])
    config = TransformerConfig(**LLAMA, **FP8)
    with pytest.raises(ValueError, match="layer 2 fc has 24 output features on this rank"):
        apply_fp8(layers, config, layer_offset=2)
    assert linear.fp8_matmul is None
    linear.weight = torch.nn.Parameter(torch.zeros(32, 64))
    assert apply_fp8(layers, config, layer_offset=0) == 1 and linear.fp8_matmul is not None
