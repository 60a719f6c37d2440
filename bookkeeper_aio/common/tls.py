"""TLS contexts for the bookie port (server and client side), from file paths in configuration.

TLS 1.2 at least, the ``ssl`` module's default ciphers. The server side optionally asks for a
client certificate (mutual TLS): ``optional`` verifies one when offered, ``required`` refuses a
client without one signed by the CA. The client side always verifies the bookie's certificate
(against ``ca_file``, else the system's trust store) and, unless told otherwise, its host name.
Bad paths or files raise :class:`TlsConfigError` naming the setting and what to do.
"""

from __future__ import annotations

import ssl

CLIENT_AUTH_MODES = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


class TlsConfigError(ValueError):
    """TLS settings that cannot be used (a missing or unreadable certificate, key or CA file)."""


def server_context(
    cert_file: str, key_file: str, ca_file: str = "", client_auth: str = "none"
) -> ssl.SSLContext:
    """The context a bookie listens with. ``client_auth`` other than ``none`` needs ``ca_file`` (the
    CA that signs client certificates)."""
    if client_auth not in CLIENT_AUTH_MODES:
        raise TlsConfigError(f"tls_client_auth {client_auth!r}: use none, optional or required")
    if not cert_file or not key_file:
        raise TlsConfigError("TLS needs both tls_cert_file and tls_key_file")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(context, cert_file, key_file)
    if client_auth != "none":
        if not ca_file:
            raise TlsConfigError(f"tls_client_auth {client_auth} needs tls_ca_file (the clients' CA)")
        _load_ca(context, ca_file)
        context.verify_mode = CLIENT_AUTH_MODES[client_auth]
    return context


def client_context(
    ca_file: str = "", cert_file: str = "", key_file: str = "", *, check_hostname: bool = True
) -> ssl.SSLContext:
    """The context a client connects to bookies with: the bookie's certificate is verified against
    ``ca_file`` (else the system's CAs) and its host name (or IP) checked unless ``check_hostname``
    is False; ``cert_file``/``key_file`` present a client certificate (mutual TLS)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if ca_file:
        _load_ca(context, ca_file)
    else:
        context.load_default_certs(ssl.Purpose.SERVER_AUTH)
    context.check_hostname = check_hostname
    context.verify_mode = ssl.CERT_REQUIRED
    if cert_file or key_file:
        if not (cert_file and key_file):
            raise TlsConfigError("a client certificate needs both tls_cert_file and tls_key_file")
        _load_chain(context, cert_file, key_file)
    return context


def _load_chain(context: ssl.SSLContext, cert_file: str, key_file: str) -> None:
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise TlsConfigError(
            f"cannot load the certificate {cert_file} with key {key_file}: {exc} (check both paths, "
            "that they are PEM files, and that the key belongs to the certificate)"
        ) from exc


def _load_ca(context: ssl.SSLContext, ca_file: str) -> None:
    try:
        context.load_verify_locations(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise TlsConfigError(
            f"cannot load the CA file {ca_file}: {exc} (a PEM file of CA certificates)"
        ) from exc
