"""A Megatron-LM checkpoint imported by mp-ckpt gives, in mp's GPTModel, the logits
megatron-core computed with it (packages/mp-ckpt/tests/assets/megatron/*/reference.pt),
the DeepSeek-shaped ones (multi-latent attention, DeepSeek's MoE) and the Llama 4-shaped
one (interleaved rotary pairs with Llama 3's scaling, NoPE layers, L2-normalized queries
and keys, top-1 routing weights on the experts' input) and the Nemotron-H-shaped hybrid
(Mamba, attention, MLP and MoE layers) too, and the losses of the multi-token prediction
module one of them has, and a muP model's (--use-mup: the embedding's and the logits'
multipliers, the attention scale); exported to Hugging Face, transformers computes the
same logits (a muP model's export is refused). Megatron's TP4 checkpoint of a model with
fewer query groups than ranks gives them at TP4 in mp too."""

import dataclasses
from pathlib import Path

import pytest
import torch

from mp_ckpt import export_hf, import_megatron, load_checkpoint, safe_load
from mp_layers import GPTModel, ModelGroups, TransformerConfig
from mp_state.testing import run_on_ranks

ASSETS = Path(__file__).resolve().parents[1] / "packages/mp-ckpt/tests/assets/megatron"


@pytest.mark.parametrize("case", ["llama_torch_dist_tp1", "llama_torch_dist_tp2_distopt",
                                  "llama_torch_tp2", "llama_torch_tp4", "llama_torch_pp2",
                                  "gpt2_torch_dist_tp1", "moe_torch_dist_ep2",
                                  "moe_torch_ep2", "moe_quantile_torch_dist_ep2",
                                  "llama_torch_dist_pp2_dp2_distopt",
                                  "llama_torch_pp2_dp2_distopt",
                                  "llama_torch_dist_tp2_dp2_distopt",
                                  "mla_moe_torch_dist_tp2",
                                  "mla_learned_positions_torch_dist_tp1",
                                  "mla_dsa_torch_dist_tp1",
                                  "mla_moe_mtp_torch_tp2_ep2",
                                  "llama4_moe_torch_dist_tp2",
                                  "hybrid_torch_dist_tp2", "hybrid_torch_tp2",
                                  "hybrid_mtp_torch_dist_tp2", "hybrid_mtp_torch_tp2",
                                  "qwen3_next_torch_dist_tp2", "qwen3_next_torch_tp2",
                                  "qwen3_next_mtp_torch_dist_tp2",
                                  "hybrid_gdn_torch_dist_tp2", "hybrid_gdn_torch_tp2",
                                  "llama_mup_torch_tp2"])  # fmt: skip
def test_imported_megatron_checkpoint_gives_megatron_logits(case, tmp_path):
    out = import_megatron(ASSETS / case, tmp_path / "mp")
    settings = torch.load(out / "common.pt", weights_only=False)["model_config"]
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    config = TransformerConfig(**{k: v for k, v in settings.items() if k in fields})
    model = GPTModel(config, "local", settings["vocab_size"], settings["max_position_embeddings"],
                     groups=ModelGroups.single())  # fmt: skip
    load_checkpoint(tmp_path / "mp", model.sharded_state_dict())
    reference = safe_load(ASSETS / case / "reference.pt")
    model.eval()
    with torch.no_grad():
        logits = model(reference["tokens"], reference["position_ids"])
    torch.testing.assert_close(logits, reference["logits"], rtol=0, atol=1e-5)
    if "mtp_losses" in reference:
        # each multi-token prediction module's mean loss, as Megatron logged it in a
        # training-mode forward (no dropout in the fixtures; the logits do not use them)
        model.train()
        model(reference["tokens"], reference["position_ids"], labels=reference["labels"])
        torch.testing.assert_close(
            model.mtp.take_losses(), reference["mtp_losses"], rtol=0, atol=1e-5
        )


def logits_at_tp(case: str, load: str, tp: int) -> torch.Tensor:
    """The imported checkpoint's logits from mp's GPTModel at TP `tp` (on each rank)."""
    import mp_state
    from mp_state import ParallelConfig

    torch.set_num_threads(1)
    state = mp_state.initialize(ParallelConfig(tensor_model_parallel_size=tp))
    settings = torch.load(Path(load) / "iter_0000000" / "common.pt",
                          weights_only=False)["model_config"]  # fmt: skip
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    config = TransformerConfig(**{k: v for k, v in settings.items() if k in fields})
    model = GPTModel(config, "local", settings["vocab_size"], settings["max_position_embeddings"],
                     groups=ModelGroups.of(state), parallel_output=False)  # fmt: skip
    load_checkpoint(load, model.sharded_state_dict())
    reference = safe_load(ASSETS / case / "reference.pt")
    model.eval()
    with torch.no_grad():
        return model(reference["tokens"], reference["position_ids"])


@pytest.mark.multirank
def test_megatrons_shared_query_groups_give_its_logits_at_its_layout(tmp_path):
    """Megatron-LM's TP4 checkpoint of a model with 2 query groups (each rank's file half a
    group's rows), imported, gives its logits in mp at TP4, where each group is shared by
    two ranks as in Megatron-LM."""
    case = "llama_torch_tp4"
    import_megatron(ASSETS / case, tmp_path / "mp")
    reference = safe_load(ASSETS / case / "reference.pt")
    for logits in run_on_ranks(logits_at_tp, 4, case, str(tmp_path / "mp"), 4, timeout=180):
        torch.testing.assert_close(logits, reference["logits"], rtol=0, atol=1e-5)


@pytest.mark.parametrize(("case", "arch"), [("llama_torch_dist_tp2_distopt", "llama"),
                                            ("llama_torch_pp2", "llama"),
                                            ("gpt2_torch_dist_tp1", "gpt2"),
                                            ("moe_torch_dist_ep2", "qwen2_moe"),
                                            ("hybrid_torch_tp2", "nemotron_h")])  # fmt: skip
def test_an_imported_megatron_checkpoint_exports_to_transformers_with_megatron_logits(
    case, arch, tmp_path
):
    transformers = pytest.importorskip("transformers")
    import_megatron(ASSETS / case, tmp_path / "mp")
    export_hf(tmp_path / "mp", tmp_path / "hf", arch)
    # transformers clamps a Mamba mixer's time step at time_step_min, megatron-core does not
    # (nemotron_h.py): the fixture's dt + dt_bias falls below where the default 0.001 acts
    unclamped = {"time_step_min": 0.0} if arch == "nemotron_h" else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", **unclamped)
    model.eval()
    reference = safe_load(ASSETS / case / "reference.pt")
    with torch.no_grad():
        logits = model(reference["tokens"]).logits
    vocab = logits.shape[-1]
    torch.testing.assert_close(logits, reference["logits"][..., :vocab], rtol=0, atol=1e-5)


def test_a_mup_model_is_not_exported_to_transformers(tmp_path):
    """Hugging Face's Llama has no muP multipliers: its logits would not be the model's."""
    import_megatron(ASSETS / "llama_mup_torch_tp2", tmp_path / "mp")
    with pytest.raises(ValueError, match="use_mup=True: llama's Hugging Face model has no muP"):
        export_hf(tmp_path / "mp", tmp_path / "hf", "llama")
    assert not (tmp_path / "hf").exists()
