"""What muP is for, checked as its authors check it (a "coordinate check"): a few Adam
steps at one learning rate move the logits by about as much at every width with --use-mup
(mp_layers' multipliers and initialization, mp_optim's muP groups), while in the standard
parameterization the same steps move them more the wider the model.

Measured (2 layers, widths 64 to 512 over a base of 64, 5 AdamW steps at lr 1e-2 on one
batch; the RMS change of the logits): standard 0.60, 1.03, 1.85, 2.60; muP 0.60, 0.51,
0.49, 0.44. Here widths 64 and 256: the standard one's change grows 3.1x, muP's stays
within 0.82x of the base's.
"""

import pytest
import torch

from mp_layers import GPTModel, ModelGroups, TransformerConfig
from mp_optim import OptimizerConfig, get_param_groups

pytestmark = pytest.mark.long  # conftest.py runs it first

VOCAB, SEQ, BATCH, LR, STEPS = 128, 32, 8, 1e-2, 5


def logits_change(width: int, mup: bool) -> float:
    """The RMS change of a fixed batch's logits after STEPS AdamW steps at LR."""
    fields = {"num_layers": 2, "hidden_size": width, "num_attention_heads": width // 16,
              "ffn_hidden_size": 4 * width, "normalization": "RMSNorm",
              "position_embedding_type": "rope", "untie_embeddings_and_output_weights": True,
              "add_bias_linear": False, "hidden_dropout": 0.0,
              "attention_dropout": 0.0}  # fmt: skip
    if mup:
        fields |= {"use_mup": True, "mup_base_hidden_size": 64}
    config = TransformerConfig(**fields)
    torch.manual_seed(1)
    model = GPTModel(config, "local", VOCAB, SEQ, groups=ModelGroups.single())
    settings = OptimizerConfig(lr=LR, min_lr=LR, weight_decay=0.0)
    groups = get_param_groups([model], settings, mup_width_mult=config.mup_width_mult)
    for group in groups:  # the scheduler's first value: each group's peak
        group["lr"] = group.get("max_lr", LR)
    optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    data = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=data)
    labels = torch.roll(tokens, -1, 1)
    with torch.no_grad():
        before = model.eval()(tokens)
    model.train()
    for _ in range(STEPS):
        optimizer.zero_grad()
        model(tokens, labels=labels).mean().backward()
        optimizer.step()
    with torch.no_grad():
        after = model.eval()(tokens)
    return (after - before).pow(2).mean().sqrt().item()


def test_mup_keeps_the_logits_update_the_same_across_widths():
    standard = logits_change(256, mup=False) / logits_change(64, mup=False)
    mup = logits_change(256, mup=True) / logits_change(64, mup=True)
    assert standard > 2.0, standard  # measured 3.1
    assert 0.6 < mup < 1.4, mup  # measured 0.82
