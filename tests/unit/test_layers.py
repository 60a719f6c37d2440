"""The floors of docs/internals.md, checked by what a fresh interpreter actually loads.

`make lint` holds the import contracts statically (`lint-imports`, pyproject.toml); these tests
check the consequence a user feels (importing the wire codec loads no client, no etcd, no gRPC;
no bookie module loads client code) and that a deliberately wrong import breaks the contracts.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

import bookkeeper_aio

REPO = pathlib.Path(__file__).resolve().parents[2]
LINT_IMPORTS = pathlib.Path(sys.executable).with_name("lint-imports")


def _modules_loaded_by(*imports: str) -> list[str]:
    """The modules in ``sys.modules`` after a fresh interpreter imports ``imports``."""
    code = "import importlib, json, sys\n"
    code += "".join(f"importlib.import_module({name!r})\n" for name in imports)
    code += "print(json.dumps(sorted(sys.modules)))\n"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True, timeout=60
    )
    loaded: list[str] = json.loads(out.stdout)
    return loaded


def _package_modules(package: str) -> list[str]:
    root = REPO / package.replace(".", "/")
    return sorted(
        f"{package}.{path.stem}" if path.stem != "__init__" else package
        for path in root.glob("*.py")
        if path.stem != "__main__"
    )


def _under(loaded: list[str], *prefixes: str) -> list[str]:
    return [name for name in loaded if any(name == p or name.startswith(p + ".") for p in prefixes)]


def test_wire_codec_loads_nothing_but_itself() -> None:
    loaded = _modules_loaded_by(*_package_modules("bookkeeper_aio.protocol"))
    assert _under(loaded, "bookkeeper_aio.client", "metadata", "bookie", "aetcd", "grpc", "structlog") == []
    assert _under(loaded, "bookkeeper_aio") == sorted(
        ["bookkeeper_aio", "bookkeeper_aio.errors", *_package_modules("bookkeeper_aio.protocol")]
    )


def test_ground_floor_loads_no_client_metadata_or_etcd() -> None:
    loaded = _modules_loaded_by(*_package_modules("bookkeeper_aio.common"), "bookkeeper_aio.errors")
    assert _under(loaded, "bookkeeper_aio.client", "metadata", "bookie", "aetcd", "grpc") == []


def test_no_bookie_module_loads_client_code() -> None:
    loaded = _modules_loaded_by(*_package_modules("bookie"))
    assert "bookie.storage" in loaded  # the imports really ran
    assert _under(loaded, "bookkeeper_aio.client", "bookkeeper_aio.cli") == []


def test_metadata_loads_neither_client_nor_bookie() -> None:
    loaded = _modules_loaded_by(*_package_modules("metadata"))
    assert "metadata.etcd" in loaded
    assert _under(loaded, "bookkeeper_aio.client", "bookkeeper_aio.cli", "bookie") == []


def test_package_import_is_lazy_and_every_public_name_resolves() -> None:
    assert _under(_modules_loaded_by("bookkeeper_aio"), "bookkeeper_aio.client", "metadata", "aetcd") == []
    for name in bookkeeper_aio.__all__:
        assert getattr(bookkeeper_aio, name) is not None, name
    assert set(bookkeeper_aio.__all__) <= set(dir(bookkeeper_aio))
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = bookkeeper_aio.no_such_name  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("module", "bad_import", "contract"),
    [
        ("bookie/journal.py", "import bookkeeper_aio.client.ledger", "bookie never imports the client"),
        ("bookie/storage.py", "from bookkeeper_aio import BookKeeper", "bookie never imports the client"),
        ("metadata/store.py", "import bookie.journal", "metadata imports neither"),
        ("bookkeeper_aio/protocol/codes.py", "import metadata.errors", "the codec and the ground floor"),
        ("bookkeeper_aio/spark/__init__.py", "import bookkeeper_aio.client.ledger", "spark uses only"),
        ("bookkeeper_aio/client/quorum.py", "import bookkeeper_aio.cli.main", "floors"),
    ],
)
def test_a_wrong_import_breaks_the_contracts(
    tmp_path: pathlib.Path, module: str, bad_import: str, contract: str
) -> None:
    for package in ("bookkeeper_aio", "bookie", "metadata"):
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")

    def lint() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(LINT_IMPORTS), "--no-logo", "--no-cache"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        )

    clean = lint()
    assert clean.returncode == 0, clean.stdout + clean.stderr
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{bad_import}  # deliberately wrong\n")
    broken = lint()
    assert broken.returncode != 0, broken.stdout
    assert contract in broken.stdout
    assert "BROKEN" in broken.stdout


# Named in docs/api.md but not types of the package: enum members, quorum names, another package's
# registry, a builtin, and the recovery engine's result (documented as the `recovery` module's).
_API_DOC_NOT_EXPORTED = {
    *("CLOSED", "IN_RECOVERY", "OPEN", "Qa", "Qw", "REGISTRY", "RecoveryResult", "ValueError")
}


def test_every_type_the_api_doc_names_is_importable_from_the_package() -> None:
    """docs/api.md: "Everything below is importable from `bookkeeper_aio`" (``LedgerMetadata``,
    the type of ``lh.metadata``, was not)."""
    named = set(re.findall(r"`([A-Z][A-Za-z0-9]+)`", (REPO / "docs" / "api.md").read_text()))
    assert "LedgerMetadata" in named
    assert sorted(named - _API_DOC_NOT_EXPORTED - set(bookkeeper_aio.__all__)) == []
