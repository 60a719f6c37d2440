"""What ``bkaio bench`` raises for the command line to print (each message says what to do)."""

from __future__ import annotations


class BenchUsageError(ValueError):
    """An option is out of range or contradicts another; the message says what to use instead."""


class BenchFailed(RuntimeError):
    """A client process or a step of a scenario failed; the message says which and where its log is."""


class PeerUnavailable(RuntimeError):
    """A ``--compare`` peer cannot run here; the message says what to install or set."""
