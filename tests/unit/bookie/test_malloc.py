"""The bookie's malloc settings (bookie/malloc.py) take where the C library is glibc."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's")
def test_keep_big_buffers_sets_the_thresholds() -> None:
    # in a child: the thresholds are process-wide and must not leak into the test process
    code = "from bookie.malloc import keep_big_buffers; print(keep_big_buffers())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "True"
