"""mp-train: training loop. Nothing is public yet; see README.md."""

__all__: list[str] = []
