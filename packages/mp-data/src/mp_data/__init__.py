"""mp-data: data pipeline. Nothing is public yet; see README.md."""

__all__: list[str] = []
