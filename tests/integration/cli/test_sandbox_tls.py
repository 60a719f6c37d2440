"""`bkaio sandbox --tls`: the secure path run end to end. Bookies and etcd over TLS with a throwaway
CA, bookies requiring a token; the demo, `bkaio` commands in another process (which find the CA and
token by themselves), and a client without the CA refused."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.sandbox import RunningSandbox, bkaio, running_sandbox

pytestmark = pytest.mark.etcd


@pytest.fixture(scope="module")
def tls_sandbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningSandbox]:
    home = tmp_path_factory.mktemp("bkaio-tls-home")
    with running_sandbox(home, "--bookies", "3", "--tls", "--demo-entries", "300") as box:
        yield box


def test_the_demo_runs_over_tls_with_a_token(tls_sandbox: RunningSandbox) -> None:
    text = "\n".join(tls_sandbox.lines)
    assert "TLS and token auth on" in text
    assert "?ca_file=" in tls_sandbox.url  # etcd is reached over TLS too
    assert "in order and byte-identical" in text, text
    tls_dir = Path(json.loads((tls_sandbox.home / "sandbox.json").read_text())["client_config"]).parent
    for secret in ("server-key.pem", "bookie-tokens", "client.token"):
        assert (tls_dir / secret).stat().st_mode & 0o077 == 0, secret  # owner only


def test_bkaio_commands_find_the_ca_and_token(tls_sandbox: RunningSandbox) -> None:
    result = json.loads(bkaio(tls_sandbox.home, "simpletest", "--entries", "50", "--json").stdout)
    assert (result["ok"], result["entries"]) == (True, 50)
    gc = json.loads(bkaio(tls_sandbox.home, "bookie", "gc", "bookie-0", "--json").stdout)  # admin token
    assert gc["error"] is None


def test_a_client_without_the_ca_or_token_cannot_write(tls_sandbox: RunningSandbox, tmp_path: Path) -> None:
    state = json.loads((tls_sandbox.home / "sandbox.json").read_text())
    client_config = Path(state["client_config"])
    timeouts = "connect_timeout_s = 2.0\nadd_timeout_s = 2.0\n"
    own = client_config.read_text().splitlines(True)
    configs = {  # each refusal named, with what to check (not "no writable bookie")
        "plaintext": ("", "closed the connection before answering HELLO: it may require TLS"),
        "tls-no-token": ("".join(line for line in own if "auth" not in line), "needs an AUTH handshake"),
        "wrong-token": (
            "".join(line for line in own if "auth_token" not in line) + 'auth_token = "wrong"\n',
            "refused authentication: token refused",
        ),
        "no-ca": ("tls_enabled = true\n", "TLS handshake failed: [SSL: CERTIFICATE_VERIFY_FAILED]"),
    }
    for name, (text, expected) in configs.items():
        config = tmp_path / f"{name}.toml"
        config.write_text(timeouts + text)
        result = bkaio(
            tls_sandbox.home, "--client-config", str(config), "simpletest", "--entries", "5", check=False
        )
        assert result.returncode != 0, (name, result.stdout)
        assert "bkaio simpletest: Unauthorized: " in result.stderr, (name, result.stderr)
        assert expected in result.stderr, (name, result.stderr)
        assert "NotEnoughBookies" not in result.stderr, (name, result.stderr)
    # The same flag with the sandbox's own file works (and so does the environment variable).
    ok = bkaio(tls_sandbox.home, "--client-config", str(client_config), "simpletest", "--entries", "5")
    assert ok.returncode == 0


def test_no_secret_leaks_into_the_state_file(tls_sandbox: RunningSandbox) -> None:
    state_text = (tls_sandbox.home / "sandbox.json").read_text()
    token = Path(json.loads(state_text)["client_config"]).with_name("client.token").read_text().strip()
    assert token not in state_text
    assert os.path.exists(json.loads(state_text)["admin_token_file"])
