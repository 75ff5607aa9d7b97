"""mp-ckpt installs and runs alone: a fresh virtual environment with only packages/mp-ckpt
(and its dependencies: torch, safetensors) runs inspect, convert, export-hf and
import-megatron (a checkpoint megatron-core wrote, optimizer state included): `mp-ckpt
inspect` as a command, the others through its main() in one process."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mp_ckpt import Checkpointer, CheckpointReader
from mp_layers import GPTModel, ModelGroups, TransformerConfig

pytestmark = pytest.mark.long  # conftest.py runs it first

ROOT = Path(__file__).resolve().parents[1]
ONE_PROCESS = """
import json, sys
from mp_ckpt.cli import main
for argv in json.loads(sys.argv[1]):
    if main(argv):
        sys.exit(f"mp-ckpt {argv[0]} failed")
"""
"""Runs `mp-ckpt ARGV` for each ARGV of a JSON list given as its argument, in order."""


def uv() -> str:
    found = os.environ.get("UV") or shutil.which("uv")
    assert found, "uv is needed to build the standalone environment (run the suite with uv run)"
    return found


def run(*args, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == 0, f"{' '.join(map(str, args))}\n{result.stdout}\n{result.stderr}"
    return result


def test_mp_ckpt_alone_inspects_converts_and_exports(tmp_path):
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                               hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
    model = GPTModel(config, "local", 64, 16, groups=ModelGroups.single())
    Checkpointer(tmp_path / "ckpt").save(3, model.sharded_state_dict())

    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "UV_PROJECT"))}
    run(uv(), "venv", "--quiet", "--python", sys.executable, str(venv), env=env)
    python = venv / "bin" / "python"
    torch_version = torch.__version__.split("+")[0]
    run(uv(), "pip", "install", "--quiet", "--python", str(python), str(ROOT / "packages/mp-ckpt"),
        f"torch=={torch_version}", env=env)  # fmt: skip
    # Nothing else of mp is there.
    probe = subprocess.run([python, "-c", "import mp_state"], capture_output=True, env=env)
    assert probe.returncode != 0
    cli = venv / "bin" / "mp-ckpt"
    summary = json.loads(run(cli, "inspect", str(tmp_path / "ckpt"), "--json", env=env).stdout)
    assert summary["iteration"] == 3
    assert summary["model_parameters"] == sum(p.numel() for p in model.parameters())
    # The other commands through the command's main() in one process of the venv: each
    # start of the CLI costs a torch import (~5 s).
    megatron = ROOT / "packages/mp-ckpt/tests/assets/megatron/llama_torch_dist_tp2_distopt"
    commands = [
        ["convert", str(tmp_path / "ckpt"), str(tmp_path / "tp2"),
         "--tensor-model-parallel-size", "2", "--no-progress"],
        ["export-hf", str(tmp_path / "tp2"), str(tmp_path / "hf"), "--arch", "gpt2"],
        ["import-megatron", str(megatron), str(tmp_path / "imported"), "--with-optimizer"],
    ]  # fmt: skip
    run(python, "-c", ONE_PROCESS, json.dumps(commands), env=env)
    assert (tmp_path / "tp2" / "iter_0000003" / "mp_metadata.json").exists()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["n_layer"] == 2
    assert (tmp_path / "hf" / "model.safetensors").stat().st_size > 0
    # Read back in this process (inspect would be another torch import).
    imported = CheckpointReader(tmp_path / "imported")
    assert imported.iteration == 2
    assert any(key.startswith("optimizer.") for key in imported.keys)
