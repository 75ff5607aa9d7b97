"""mp-pipeline: pipeline engine. Nothing is public yet; see README.md."""

__all__: list[str] = []
