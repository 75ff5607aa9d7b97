"""Measure: what a gated DeltaNet keeps for backward in training, and its forward + backward
time, with its recompute (the convolution, the delta rule and the gated norm run again in
backward, mp's default) against keeping every tensor (GatedDeltaNet.recompute = False).

One GatedDeltaNet (hidden 512, 8 key heads and 16 value heads of 64 channels, convolution
width 4; RMSNorm, no biases) on one thread of this CPU, one sample of 1,024 tokens, in fp32
and in bf16. Kept bytes: the storages autograd saves for backward in one forward
(saved-tensor hooks; the layer's parameters and input left out), per token. Time: after a
warm-up call each, the two sides alternate (the order flipped every round) for `--repeats`
rounds; best and median of each.

    uv run python ci/bench/bench_gdn_recompute.py [--repeats 5]
"""

from __future__ import annotations

import argparse

from bench_mamba_recompute import measure_recompute, report
from harness import context


def build(dtype):
    import torch

    from mp_layers import ModelGroups, TransformerConfig
    from mp_layers.transformer.gated_delta_net import GatedDeltaNet
    from mp_layers.transformer.spec import LOCAL_SPEC

    config = TransformerConfig(
        num_layers=1, hidden_size=512, num_attention_heads=4, normalization="RMSNorm",
        activation="swiglu", add_bias_linear=False, params_dtype=dtype,
        experimental_attention_variant="gdn",
        linear_attention_freq=[1], linear_key_head_dim=64, linear_value_head_dim=64,
        linear_num_key_heads=8, linear_num_value_heads=16,
    )  # fmt: skip
    torch.manual_seed(0)
    layer = GatedDeltaNet(config, ModelGroups.single(), spec=LOCAL_SPEC).train()
    x = torch.randn(1024, 1, 512, dtype=dtype, requires_grad=True)
    return layer, x


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)

    class Output(torch.nn.Module):
        """The layer's output alone (it returns (output, bias))."""

        def __init__(self, layer) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, x):
            return self.layer(x)[0]

    ctx = context()
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        layer, x = build(dtype)
        kept, times = measure_recompute(Output(layer), layer, x, args.repeats)
        report("gdn_recompute", name, 1024, kept, times, ctx)


if __name__ == "__main__":
    main()
