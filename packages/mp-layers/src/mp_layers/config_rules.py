"""The small checks TransformerConfig's validation is made of; each message names the
field and the value."""

from __future__ import annotations

__all__ = ["choice", "left_default", "positive"]


def positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


def choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} must be one of {', '.join(choices)}")


def left_default(config: object, defaults: dict[str, object], needs: str) -> None:
    """Fields that mean something only with `needs` set: each must keep its default."""
    for name, default in defaults.items():
        if getattr(config, name) != default:
            raise ValueError(f"{name}={getattr(config, name)!r} needs {needs}")
