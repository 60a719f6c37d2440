"""Bad TLS and auth settings stop ``bookie`` at start with exit code 2 and one line naming the
setting (checked in process: ``bookie.__main__.main`` exits before serving)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bookie.__main__ import EXIT_CONFIG, main


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            ["--tls-cert-file", "/nonexistent/cert.pem", "--tls-key-file", "/nonexistent/key.pem"],
            "cannot load",
        ),
        (["--tls-cert-file", "/nonexistent/cert.pem"], "both tls_cert_file and tls_key_file"),
        (["--tls-client-auth", "required"], "needs TLS on"),
        (["--tls-client-auth", "sometimes"], "use none, optional or required"),
        (["--auth-providers", "token"], "auth_token_file"),
        (["--auth-providers", "token", "--auth-token-file", "/nonexistent/tokens"], "auth_token_file"),
        (["--auth-providers", "no.such.module:factory"], "no.such.module"),
    ],
    ids=[
        "missing_cert",
        "cert_without_key",
        "mtls_without_tls",
        "bad_client_auth",
        "token_without_file",
        "unreadable_token_file",
        "bad_plugin",
    ],
)
def test_bad_security_settings_refuse_to_start_saying_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--data-dir", str(tmp_path / "data"), "--bookie-id", "b1", "--port", "0", *args])
    assert info.value.code == EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.startswith("bookie: configuration error:")
    assert says in err


def test_an_empty_token_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# nothing but a comment\n\n")
    with pytest.raises(SystemExit):
        main(
            [
                "--data-dir",
                str(tmp_path),
                "--bookie-id",
                "b1",
                "--auth-providers",
                "token",
                "--auth-token-file",
                str(tokens),
            ]
        )
    assert "holds no token" in capsys.readouterr().err
