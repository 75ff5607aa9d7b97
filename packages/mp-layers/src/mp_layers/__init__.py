"""mp-layers: model layers. Nothing is public yet; see README.md."""

__all__: list[str] = []
