"""Nemotron 3 Super's multi-token prediction layers through import-hf and export-hf.

Its Hugging Face checkpoints hold one MTP module beside the model (mtp.layers.{j}.*, one
per layer of the module's pattern: each a decoder block's norm and mixer, the first also
enorm, hnorm and eh_proj, the last final_layernorm), which transformers' NemotronH
neither builds nor saves. Here the module's layers are the extra blocks of a random
transformers model that is longer by them. import-hf makes the module mp's
(hybrid_layer_pattern "<main>/<mtp>"); the logits stay transformers'; mp's MTP loss
equals the module computed from transformers' blocks (h' = final_layernorm(blocks(
eh_proj(cat(enorm(embed(next tokens)), hnorm(h))))), lm_head(h') against the labels one
further); export-hf gives back every tensor and config.json, and transformers loads it."""

import json

import torch
import transformers
from safetensors.torch import load_file, save_file

from mp_ckpt.cli import main
from mp_gpt.testing import imported_model

SEQ = 16
MAIN = ["mamba", "moe", "full_attention", "moe"]
MODULE = ["mamba", "full_attention", "moe"]  # a Mamba layer beside Super's attention and MoE
CONFIG = dict(
    vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=16, chunk_size=8,
    intermediate_size=80, max_position_embeddings=64, initializer_range=0.1,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
    moe_shared_expert_intermediate_size=24, n_group=1, topk_group=1,
    routed_scaling_factor=2.5, moe_latent_size=12,
)  # fmt: skip


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def longer_model():
    """A random transformers model of the main layers and the module's after them."""
    torch.manual_seed(0)
    config = transformers.NemotronHConfig(**CONFIG, layers_block_type=MAIN + MODULE)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            if name.endswith("mixer.dt_bias"):  # clear of transformers' time_step_min clamp
                param.uniform_(-1.0, 1.0)
    return model


def test_an_mtp_module_imports_computes_from_transformers_blocks_and_exports_back(tmp_path):
    longer = longer_model()
    longer.save_pretrained(tmp_path / "longer")
    state = {}
    for name, tensor in load_file(str(tmp_path / "longer" / "model.safetensors")).items():
        parts = name.split(".")
        if parts[:2] == ["backbone", "layers"] and int(parts[2]) >= len(MAIN):
            name = ".".join(["mtp", "layers", str(int(parts[2]) - len(MAIN)), *parts[3:]])
        state[name] = tensor
    h, gen = CONFIG["hidden_size"], torch.Generator().manual_seed(5)
    module = {
        "mtp.layers.0.enorm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
        "mtp.layers.0.hnorm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
        "mtp.layers.0.eh_proj.weight": 0.1 * torch.randn(h, 2 * h, generator=gen),
        "mtp.layers.2.final_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
    }
    state |= module  # fmt: skip
    config = json.loads((tmp_path / "longer" / "config.json").read_text())
    config |= {"layers_block_type": MAIN, "num_hidden_layers": len(MAIN),
               "num_nextn_predict_layers": 1, "mtp_layers_block_type": MODULE}  # fmt: skip
    (tmp_path / "hf_in").mkdir()
    (tmp_path / "hf_in" / "config.json").write_text(json.dumps(config))
    save_file(state, str(tmp_path / "hf_in" / "model.safetensors"), metadata={"format": "pt"})
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_in").eval()

    assert main(["import-hf", str(tmp_path / "hf_in"), str(tmp_path / "ckpt")]) == 0
    model = imported_model(tmp_path / "ckpt")
    assert model.config.hybrid_layer_pattern == "ME*E/M*E"
    x, labels = torch.randint(0, CONFIG["vocab_size"], (2, 2, SEQ),
                              generator=torch.Generator().manual_seed(3))  # fmt: skip
    with torch.no_grad():
        assert (model(x) - hf(x).logits).abs().max() < 1e-5
    model.train()
    model(x, labels=labels)
    (got,) = model.mtp.take_losses().tolist()
    eps = hf.config.layer_norm_epsilon
    with torch.no_grad():
        ahead = torch.roll(x, -1, 1)  # the next tokens (the last position counts nothing)
        joined = torch.cat([
            rms_norm(hf.model.embeddings(ahead), module["mtp.layers.0.enorm.weight"], eps),
            rms_norm(hf.model(x).last_hidden_state, module["mtp.layers.0.hnorm.weight"], eps),
        ], -1)  # fmt: skip
        out = joined @ module["mtp.layers.0.eh_proj.weight"].t()
        mask = torch.full((SEQ, SEQ), -torch.inf).triu(1)[None, None]
        for block in longer.model.layers[len(MAIN) :]:  # the Mamba block takes a 2D mask
            causal = mask if block.block_type == "full_attention" else None
            out = block(out, attention_mask=causal, position_ids=torch.arange(SEQ)[None])
        out = rms_norm(out, module["mtp.layers.2.final_layernorm.weight"], eps)
        logits = hf.lm_head(out)[:, :-1]
        want = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), torch.roll(labels, -1, 1)[:, :-1].reshape(-1)
        )
    assert abs(got - want.item()) < 1e-5, (got, want)

    assert main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf_out")]) == 0
    written, given = (transformers.AutoConfig.from_pretrained(tmp_path / d).to_dict()
                      for d in ("hf_out", "hf_in"))  # fmt: skip
    for name in ("_name_or_path", "transformers_version"):
        written.pop(name, None), given.pop(name, None)
    assert written == given and written["num_nextn_predict_layers"] == 1
    exported = load_file(str(tmp_path / "hf_out" / "model.safetensors"))
    assert exported.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(exported[name], tensor), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(x).logits, hf(x).logits)
