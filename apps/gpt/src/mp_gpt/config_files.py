"""The YAML configs that ship with mp-gpt (apps/gpt/configs/ in the source tree).

A wheel carries them as mp_gpt/configs/; a source checkout (an editable
install) reads them from apps/gpt/configs/. `config_path("tiny.yaml")` finds
either, so the quickstart and the tests run from an installed wheel too.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["config_names", "config_path"]

_ROOTS = (
    Path(__file__).resolve().parent / "configs",  # in the wheel
    Path(__file__).resolve().parents[2] / "configs",  # apps/gpt/configs in the source tree
)


def config_names() -> list[str]:
    """The shipped configs' file names."""
    for root in _ROOTS:
        if root.is_dir():
            return sorted(p.name for p in root.glob("*.yaml"))
    return []


def config_path(name: str) -> Path:
    """The path of a shipped config, e.g. config_path("tiny.yaml")."""
    for root in _ROOTS:
        if (root / name).is_file():
            return root / name
    raise FileNotFoundError(
        f"no shipped config named {name!r} (looked in {', '.join(map(str, _ROOTS))}); "
        f"the configs are {config_names()}"
    )
