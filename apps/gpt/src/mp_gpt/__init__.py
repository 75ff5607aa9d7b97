"""mp-gpt: gpt pretraining application. Nothing is public yet; see README.md."""

__all__: list[str] = []
