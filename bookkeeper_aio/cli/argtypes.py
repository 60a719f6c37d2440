"""argparse types for the command line's numbers: a value out of range is a usage error naming the
option and the range (exit 2), not a failure deep in the command."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An ``int`` in ``[low, high]`` (``high`` None: no upper bound)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low or (high is not None and value > high):
            wanted = f">= {low}" if high is None else f"in {low}..{high}"
            raise argparse.ArgumentTypeError(f"{value} is out of range: must be {wanted}")
        return value

    parse.__name__ = "int"  # argparse names the type in its messages
    return parse
