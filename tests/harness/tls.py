"""Throwaway certificates for TLS tests (trustme): a CA, a bookie certificate for 127.0.0.1 and
localhost, client certificates, all written as PEM files the bookie and client settings name."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import trustme


@dataclass(frozen=True)
class CertFiles:
    ca: str
    cert: str
    key: str


def issue(ca: trustme.CA, directory: Path, name: str, *identities: str) -> CertFiles:
    """A certificate for ``identities`` signed by ``ca``, with ``ca``'s certificate, as files."""
    directory.mkdir(parents=True, exist_ok=True)
    leaf = ca.issue_cert(*identities)
    ca_path, cert_path, key_path = (directory / f"{name}-{part}.pem" for part in ("ca", "cert", "key"))
    ca.cert_pem.write_to_path(str(ca_path))
    leaf.cert_chain_pems[0].write_to_path(str(cert_path))
    for extra in leaf.cert_chain_pems[1:]:
        extra.write_to_path(str(cert_path), append=True)
    leaf.private_key_pem.write_to_path(str(key_path))
    return CertFiles(str(ca_path), str(cert_path), str(key_path))
