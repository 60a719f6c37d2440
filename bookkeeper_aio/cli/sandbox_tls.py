"""``bkaio sandbox --tls``: a throwaway CA and certificates, tokens, and the client config using them.

Everything lives in ``<sandbox data dir>/tls/`` and is made anew on every start (a sandbox's CA is
worth nothing outside it): the CA; one certificate for 127.0.0.1 and localhost (and the bookies'
addresses of a ``--hosts`` sandbox) that the bookies' port and etcd present; the bookies' token
file; the client's token file; and ``client.toml`` (TLS on against that CA, the token provider)
that the sandbox's own clients, the autorecovery daemon and ``bkaio`` commands in other terminals
use (docs/security.md). Files holding a secret are 0600.
"""

from __future__ import annotations

import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SandboxTls:
    directory: Path
    ca_file: str
    cert_file: str
    key_file: str
    bookie_tokens_file: str
    client_token_file: str
    client_config: str

    def bookie_args(self) -> list[str]:
        return [
            "--tls-cert-file", self.cert_file,
            "--tls-key-file", self.key_file,
            "--auth-providers", "token",
            "--auth-token-file", self.bookie_tokens_file,
        ]  # fmt: skip

    def metadata_query(self) -> str:
        """The metadata URL's query: etcd over TLS, verified against the sandbox's CA."""
        return f"?ca_file={self.ca_file}"


def _secret_file(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)


def make(data_dir: Path, extra_names: list[str] | None = None) -> SandboxTls:
    """Fresh CA, certificate, tokens and client config under ``data_dir/tls``; the certificate names
    127.0.0.1, localhost and ``extra_names`` (the ``--hosts`` sandbox's addresses)."""
    try:
        import trustme
    except ImportError:
        raise SystemExit(
            "bkaio sandbox --tls needs the trustme package (it makes the throwaway CA): "
            "`pip install 'bookkeeper-aio[sandbox]'` (make setup installs it)"
        ) from None
    directory = data_dir / "tls"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True, mode=0o700)
    ca = trustme.CA(organization_name="bkaio sandbox")
    leaf = ca.issue_cert("127.0.0.1", "localhost", *(extra_names or []))
    ca_file, cert_file, key_file = (directory / name for name in ("ca.pem", "server.pem", "server-key.pem"))
    ca.cert_pem.write_to_path(str(ca_file))
    cert_file.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
    _secret_file(key_file, leaf.private_key_pem.bytes().decode())
    token = secrets.token_urlsafe(32)
    bookie_tokens = directory / "bookie-tokens"
    _secret_file(bookie_tokens, f"# principal:token, one per line\nsandbox-client:{token}\n")
    client_token = directory / "client.token"
    _secret_file(client_token, token + "\n")
    client_config = directory / "client.toml"
    client_config.write_text(
        "# written by `bkaio sandbox --tls`: TLS to the bookies against the sandbox's CA, and its token\n"
        "tls_enabled = true\n"
        f'tls_ca_file = "{ca_file}"\n'
        'auth_provider = "token"\n'
        f'auth_token_file = "{client_token}"\n'
    )
    return SandboxTls(
        directory,
        str(ca_file),
        str(cert_file),
        str(key_file),
        str(bookie_tokens),
        str(client_token),
        str(client_config),
    )
