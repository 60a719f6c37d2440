"""The README's "Using the client" example, exactly as written, against a real sandbox.

The ```python block is taken from README.md and run in a fresh interpreter whose ``$BKAIO_HOME``
is the one a ``bkaio sandbox`` (etcd + 3 bookies) runs with and without ``$BKAIO_METADATA``: copied
verbatim by a newcomer after ``make run``, it must find the sandbox by itself (``BookKeeper.connect()``
without a URL) and print what it says.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.sandbox import running_sandbox, sandbox_env

pytestmark = pytest.mark.etcd

README = Path(__file__).resolve().parents[3] / "README.md"


def readme_example(section_title: str = "Using the client") -> str:
    """The one ```python block of a README section."""
    section = README.read_text().split(f"## {section_title}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```python\n(.*?)^```$", section, flags=re.MULTILINE | re.DOTALL)
    assert len(blocks) == 1, blocks
    return str(blocks[0])


@pytest.fixture(scope="module")
def sandbox_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with running_sandbox(tmp_path_factory.mktemp("bkaio-home"), "--bookies", "3", "--no-demo") as box:
        yield box.home


def test_readme_example_runs_as_written_against_the_sandbox(sandbox_home: Path, tmp_path: Path) -> None:
    code = readme_example()
    assert "BookKeeper.connect()" in code  # no hard-coded address to copy
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=sandbox_env(sandbox_home),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    lines = result.stdout.splitlines()
    assert lines[0] == "0 b'hello'"
    assert lines[1:1001] == [f"{i} {b'x' * 20!r}" for i in range(1, 1001)]
    assert lines[1001:] == ["last entry: 1000"]


def test_readme_log_example_runs_as_written_against_the_sandbox(sandbox_home: Path, tmp_path: Path) -> None:
    code = readme_example("Using logs")
    assert "BookKeeper.connect()" in code
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=sandbox_env(sandbox_home),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    assert result.stdout.splitlines() == ["appended True", "read 1200 b'order 1199'"]


def test_readme_example_without_a_cluster_says_how_to_give_one(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", readme_example()],
        cwd=tmp_path,
        env=sandbox_env(tmp_path / "no-sandbox-here"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    assert "NoClusterFound: no cluster given: pass a metadata URL, set BKAIO_METADATA, " in result.stderr
    assert "or start the sandbox with `make run`" in result.stderr
