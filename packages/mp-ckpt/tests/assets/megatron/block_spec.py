"""megatron-core's local GPT layer specs (dense or MoE, per layer) of a config whose
experimental_attention_variant get_gpt_decoder_block_spec would refuse (it asserts the
variant's Transformer Engine builder): built with the variant set aside, for gdn.py and
dsa.py to put their attention in."""


def local_block_spec(config, normalization: str):
    """get_gpt_decoder_block_spec(config) with the local backend, the variant unset meanwhile."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    variant = config.experimental_attention_variant
    config.experimental_attention_variant = None  # (which that builder asserts)
    try:
        return get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                          normalization=normalization)  # fmt: skip
    finally:
        config.experimental_attention_variant = variant
