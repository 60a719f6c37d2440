"""Human tables by default, ``--json`` for scripts; a progress line for long operations."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO


def emit(data: Any, *, as_json: bool, table: Sequence[Mapping[str, Any]] | None = None) -> None:
    """Print ``data`` as JSON, or ``table`` (rows of equal keys) / ``data`` for humans."""
    if as_json:
        print(json.dumps(data, default=_jsonable, sort_keys=True))
        return
    if table is not None:
        print_table(table)
    elif isinstance(data, Mapping):
        width = max((len(str(k)) for k in data), default=0)
        for key, value in data.items():
            print(f"{key:<{width}}  {value}")
    else:
        print(data)


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def print_table(rows: Sequence[Mapping[str, Any]], out: TextIO | None = None) -> None:
    stream = out or sys.stdout
    if not rows:
        print("(none)", file=stream)
        return
    headers = list(rows[0].keys())
    cells = [[str(row.get(h, "")) for h in headers] for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.upper().ljust(w) for h, w in zip(headers, widths, strict=True)), file=stream)
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)), file=stream)


class Progress:
    """A single refreshing line on a TTY (a line every ``every_s`` otherwise, and the final state
    exactly once)."""

    def __init__(self, label: str, total: int, out: TextIO | None = None, every_s: float = 0.2) -> None:
        self.label, self.total = label, total
        self.out = out or sys.stderr
        self.tty = self.out.isatty()
        self.every_s = every_s if self.tty else max(every_s, 2.0)
        self.start = self.last = time.monotonic()
        self.done = 0
        self.drawn: tuple[int, str] | None = None  # (done, extra) of the line last printed

    def update(self, done: int, extra: str = "") -> None:
        self.done = done
        now = time.monotonic()
        if (now - self.last >= self.every_s or done >= self.total) and self.drawn != (done, extra):
            self.last = now
            self._draw(extra)

    def _draw(self, extra: str) -> None:
        self.drawn = (self.done, extra)
        elapsed = max(time.monotonic() - self.start, 1e-9)
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * int(frac * 30)
        line = f"{self.label} [{bar:<30}] {self.done}/{self.total} {self.done / elapsed:,.0f}/s {extra}"
        if self.tty:
            print("\r" + line, end="", file=self.out, flush=True)
        else:
            print(line, file=self.out, flush=True)

    def finish(self, extra: str = "") -> None:
        # Without a TTY every line stays on screen: the final one only if it is not there already.
        if self.tty or self.drawn != (self.done, extra):
            self._draw(extra)
        if self.tty:
            print(file=self.out)
