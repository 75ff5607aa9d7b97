"""Progress of a long preprocessing run, for a person at a terminal or for a log file.

On a terminal (the stream is a tty) a tqdm bar (mp_data.progress) counts the
documents, followed by the tokens, MB/s of input text and, when the input
size is known, how far through the file the run is. Elsewhere (a job log) a
plain line is written each time the document count passes another multiple
of `log_interval`, as Megatron's preprocess_data.py does. `close()` ends the
bar so that what follows starts on a fresh line.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO

from mp_data.progress import is_terminal, progress

__all__ = ["Progress", "human"]


class Progress:
    """Counts documents, tokens and input bytes; reports them to `stream`."""

    def __init__(
        self,
        stream: TextIO,
        log_interval: int,
        fraction_read: Callable[[], float | None] = lambda: None,
    ) -> None:
        self.stream = stream
        self.log_interval = log_interval
        self.fraction_read = fraction_read
        self.interactive = is_terminal(stream)
        self.start = time.perf_counter()
        self.documents = self.tokens = self.input_bytes = 0
        self._next_log = log_interval
        self._bar = progress(None, "preprocess", unit="doc", stream=stream,
                             enabled=self.interactive)  # fmt: skip

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start

    def update(self, documents: int, tokens: int, input_bytes: int) -> None:
        """Adds one block's counts, then reports if it is time to."""
        self.documents += documents
        self.tokens += tokens
        self.input_bytes += input_bytes
        if self.interactive:
            self._bar.set_postfix_str(self._details(), refresh=False)
            self._bar.update(documents)
        elif self.documents >= self._next_log:
            self._next_log = (self.documents // self.log_interval + 1) * self.log_interval
            self.stream.write(self._line() + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.interactive:
            self._bar.set_postfix_str(self._details(), refresh=False)
        self._bar.close()

    def _line(self) -> str:
        return f"{self.documents:,} documents, {self._details()}, {self.seconds:.0f} s"

    def _details(self) -> str:
        seconds = max(self.seconds, 1e-9)
        line = f"{human(self.tokens)} tokens, {self.input_bytes / seconds / 1e6:.1f} MB/s"
        fraction = self.fraction_read()
        if fraction is not None:
            line += f" ({100 * fraction:.0f}% of the input)"
        return line


def human(count: float) -> str:
    """1234567 -> '1.23M': counts at a glance."""
    for limit, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(count) >= limit:
            return f"{count / limit:.2f}{suffix}"
    return f"{count:.0f}" if isinstance(count, float) else str(count)
