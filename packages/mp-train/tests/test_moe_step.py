"""MoEStep's backward factors for the routers' and the MTP modules' losses: with a mean
loss the loss scale times cp over the micro-batches (the MTP's without cp), with a
per-token loss the loss scale times a micro-batch's positions (the MTP's alone), which
finalize's division by the batch's tokens brings back to the mean loss's weight; the
per-token step refuses to start without those positions."""

from types import SimpleNamespace

import pytest

from mp_layers import TransformerConfig
from mp_train.loop.moe_step import MoEStep


class FixedScale:
    def get_loss_scale(self):
        return 8.0


def step(per_token: bool, **kwargs) -> MoEStep:
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2,
                               num_moe_experts=4, moe_aux_loss_coeff=0.01)  # fmt: skip
    state = SimpleNamespace(cp=SimpleNamespace(size=2))
    return MoEStep(config, [], state, fp16=True, per_token=per_token, **kwargs)


def test_mean_loss_factors():
    moe = step(False)
    moe.before(FixedScale(), num_microbatches=4)
    assert float(moe.scale.value) == 8.0 * 2 / 4
    assert float(moe.mtp_scale.value) == 8.0 / 4


def test_per_token_loss_factors():
    moe = step(True, microbatch_tokens=2 * 64)
    moe.before(FixedScale(), num_microbatches=4)
    assert float(moe.scale.value) == 8.0 * 128
    assert float(moe.mtp_scale.value) == 8.0


def test_per_token_loss_needs_the_micro_batch_positions():
    with pytest.raises(ValueError, match="needs microbatch_tokens"):
        step(True)
