"""Client security settings: TLS and auth keys load from files and the environment, bad combinations
fail where they are written, the token never shows in a repr, and the config-file variable is not a
setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from bookkeeper_aio.client import discovery
from bookkeeper_aio.client.auth import TokenAuth, provider_for
from bookkeeper_aio.client.config import CONFIG_FILE_ENV, ClientConfig
from bookkeeper_aio.errors import BKInterfaceError


def test_security_keys_from_file_and_environment(tmp_path: Path) -> None:
    path = tmp_path / "client.toml"
    path.write_text(
        'tls_enabled = true\ntls_ca_file = "/ca.pem"\nauth_provider = "token"\nauth_token = "s3cret-x"\n'
    )
    env = {"BKAIO_CLIENT_TLS_CHECK_HOSTNAME": "false", CONFIG_FILE_ENV: str(path)}
    config = ClientConfig.load(str(path), env=env)
    assert (config.tls_enabled, config.tls_ca_file, config.tls_check_hostname) == (True, "/ca.pem", False)
    assert config.auth_token == "s3cret-x"
    assert "s3cret-x" not in repr(config)
    with pytest.raises(BKInterfaceError, match="tls_enabled"):
        ClientConfig.load(env={"BKAIO_CLIENT_TLS_ENABLED": "maybe"})
    assert discovery.CLIENT_CONFIG_ENV == CONFIG_FILE_ENV


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"tls_ca_file": "/ca.pem"}, "tls_enabled is false"),
        ({"tls_enabled": True, "tls_cert_file": "c.pem"}, "both tls_cert_file and tls_key_file"),
        ({"auth_provider": "token"}, "auth_token or auth_token_file"),
        ({"auth_token": "x"}, "auth_provider is empty"),
    ],
)
def test_bad_combinations_fail_at_construction(settings: dict[str, object], match: str) -> None:
    with pytest.raises(BKInterfaceError, match=match):
        ClientConfig(**settings)  # type: ignore[arg-type]


def test_token_provider_reads_the_first_line_of_its_file(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("\n  s3cret  \nignored\n")
    provider = provider_for(ClientConfig(auth_provider="token", auth_token_file=str(token_file)))
    assert isinstance(provider, TokenAuth)
    assert provider.initial_payload() == b"s3cret"
    assert "s3cret" not in repr(provider)
    assert provider_for(ClientConfig()) is None
    with pytest.raises(BKInterfaceError, match=r"package\.module:factory"):
        provider_for(ClientConfig(auth_provider="kerberos"))
