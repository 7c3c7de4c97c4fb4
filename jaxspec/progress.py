"""Progress on stderr for work that takes minutes: reading a checkpoint's shards, a compile, a
benchmark's grid.

It is tqdm's (a small, well-kept library; `disable=None`), drawn only when stderr is a terminal: a
log file, a pipe or a test's captured stderr receives none of it. While a bar is drawn, lines
printed to stdout (a benchmark's table rows) and lines given to `write` pass through tqdm, which
clears the bar, writes the line and draws the bar again, so neither garbles the other.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Iterable, Iterator, TypeVar

from tqdm import tqdm

T = TypeVar("T")
CLOCK_THREAD = "jaxspec.progress clock"


def write(line: str) -> None:
    """`line` on stderr, clear of any bar being drawn (the same as a print when none is)."""
    tqdm.write(line, file=sys.stderr)


class _ThroughTqdm:
    """A stdout that writes whole lines through `tqdm.write`, so rows printed while a bar is drawn
    land above it (`print` writes a line in pieces: the pieces wait for their newline)."""

    def __init__(self, stream):
        self._stream = stream
        self._pending = ""

    def write(self, text: str) -> int:
        *lines, self._pending = (self._pending + text).split("\n")
        if lines:
            # Clears the bars drawn on stderr (`tqdm.write(file=stdout)` would miss them while
            # sys.stdout is this object), writes, and draws them again.
            with tqdm.external_write_mode(file=sys.stderr):
                self._stream.write("".join(line + "\n" for line in lines))
                self._stream.flush()
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def close(self) -> None:
        """Write what is left of an unfinished line."""
        if self._pending:
            self._stream.write(self._pending)
            self._pending = ""


def bar(items: Iterable[T], desc: str, *, total: int | None = None, unit: str = "it") -> Iterator[T]:
    """Yield `items`, drawing `desc: 40%|####      | 2/5 [00:03<00:04]` on stderr when it is a
    terminal (total: `len(items)` when it has one)."""
    with tqdm(items, desc=desc, total=total, unit=unit, file=sys.stderr, disable=None, leave=False) as shown:
        if shown.disable:
            yield from items
            return
        through = _ThroughTqdm(sys.stdout)
        try:
            with contextlib.redirect_stdout(through):
                yield from shown
        finally:
            through.close()


@contextlib.contextmanager
def elapsed(desc: str, *, every: float = 1.0) -> Iterator[None]:
    """While the body runs, `desc: 01:23` on stderr when it is a terminal, redrawn every `every`
    seconds: progress for one long call with no steps to count (a compile)."""
    with tqdm(desc=desc, bar_format="{desc}: {elapsed}", file=sys.stderr, disable=None, leave=False) as shown:
        if shown.disable:
            yield
            return
        # tqdm redraws on updates only; a blocking call makes none, so a thread redraws the clock.
        stop = threading.Event()

        def tick() -> None:
            while not stop.wait(every):
                shown.refresh()

        ticker = threading.Thread(target=tick, name=CLOCK_THREAD, daemon=True)
        ticker.start()
        try:
            yield
        finally:
            stop.set()
            ticker.join()
