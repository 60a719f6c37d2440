"""The live progress display of ``bkaio bench``: one refreshing line on stderr, only on a terminal
and without ``--quiet`` (a log file or a pipe gets the results, not a stream of carriage returns)."""

from __future__ import annotations

import sys
from typing import TextIO


class LiveLine:
    def __init__(self, enabled: bool, out: TextIO | None = None) -> None:
        self.out = out or sys.stderr
        self.enabled = enabled and self.out.isatty()
        self._width = 0

    def show(self, text: str) -> None:
        if not self.enabled:
            return
        padding = " " * max(0, self._width - len(text))
        self._width = len(text)
        print(f"\r{text}{padding}", end="", file=self.out, flush=True)

    def clear(self) -> None:
        if self.enabled and self._width:
            print("\r" + " " * self._width + "\r", end="", file=self.out, flush=True)
            self._width = 0
