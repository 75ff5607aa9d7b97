"""mp_ckpt's public names resolve on first use, and its command line starts without torch."""

import subprocess
import sys

import pytest

import mp_ckpt


def test_every_public_name_resolves():
    assert sorted(mp_ckpt.__all__) == sorted(mp_ckpt._EXPORTS)
    for name in mp_ckpt.__all__:
        assert getattr(mp_ckpt, name) is not None, name


def test_the_command_line_module_does_not_import_torch():
    # `mp-ckpt --help` imports mp_ckpt and mp_ckpt.cli, nothing more.
    code = "import sys, mp_ckpt, mp_ckpt.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_help_lists_every_export_architecture(capsys):
    from mp_ckpt.cli import main
    from mp_ckpt.families import ARCHITECTURES

    with pytest.raises(SystemExit) as exit_:
        main(["export-hf", "--help"])
    assert exit_.value.code == 0
    assert "{" + ",".join(ARCHITECTURES) + "}" in capsys.readouterr().out
