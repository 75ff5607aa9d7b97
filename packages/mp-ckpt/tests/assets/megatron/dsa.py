"""Megatron-LM's DeepSeek sparse attention (experimental_attention_variant "dsa") on the CPU,
for generate.py's DSA case.

megatron-core's DSA indexer rotates its queries and key with fast_hadamard_transform (a
CUDA package) and asserts bf16 inputs there; `install_dsa_standins()` replaces its
`rotate_activation` with the same product written from its documented semantics, x times
the Sylvester Hadamard matrix of size d scaled by d^-1/2, in any dtype. Everything else
(the indexer, the top-k, the sparse attention, the indexer loss, the absorbed MLA and the
checkpoint names) stays megatron-core's own.

`dsa_decoder_spec(config)` builds the layer specs megatron-core's
get_transformer_block_with_experimental_attention_variant_spec would (it asserts
Transformer Engine): megatron-core's local GPT layer specs (MoE or dense), each layer's
attention replaced by get_dsa_module_spec_for_backend (AbsorbedMLASelfAttention with
DSAttention as its core attention) with the local backend, whose `linear()` (the down
projections and the indexer's, "duplicated" on the tensor-parallel ranks; megatron-core
0.19.2's local provider has none, its Transformer Engine one gives te.Linear) is
megatron-core's own local `Linear` (post_training.modelopt.layers), which AbsorbedMLA
accepts there.
"""

import copy

import torch
from block_spec import local_block_spec


def _hadamard(d: int) -> torch.Tensor:
    m = torch.ones(1, 1, dtype=torch.float64)
    while m.shape[0] < d:
        m = torch.cat([torch.cat([m, m], 1), torch.cat([m, -m], 1)], 0)
    return m


def install_dsa_standins():
    """The Hadamard stand-in, and megatron-core's local Linear bound in absorbed_mla.py,
    which binds it only when Transformer Engine imports (None otherwise, so that its
    check of the down projections' class refuses the local one)."""
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.transformer.experimental_attention_variant import absorbed_mla, dsa

    absorbed_mla.Linear = Linear

    def rotate_activation(x):
        d = x.shape[-1]
        return (x @ _hadamard(d).to(x.dtype)) * d**-0.5

    dsa.rotate_activation = rotate_activation


def dsa_decoder_spec(config, normalization: str):
    """The decoder's layer specs (module docstring)."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_dsa_module_spec_for_backend,
    )
    from megatron.core.post_training.modelopt.layers import Linear

    block = local_block_spec(config, normalization)

    class Backend(LocalSpecProvider):
        def linear(self):
            return Linear

    attention = get_dsa_module_spec_for_backend(config, backend=Backend())
    for i in range(len(block.layer_specs)):
        layer = block.layer_specs[i] = copy.deepcopy(block.layer_specs[i])
        layer.submodules.self_attention = attention
    return block
