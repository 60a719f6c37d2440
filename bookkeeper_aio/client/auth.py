"""Client side of the AUTH handshake: pluggable providers, a token provider built in.

Like BookKeeper's ``ClientAuthProvider``: on each new bookie connection the client sends HELLO,
then AUTH with its provider's initial payload; a bookie may answer with a challenge (EOK,
``complete`` 0), which the provider answers in the next AUTH, until the bookie says ``complete``
(authenticated) or refuses (EUA: the connection fails with :class:`~bookkeeper_aio.errors.Unauthorized`).
No request of the caller goes out before the handshake completed.

``ClientConfig.auth_provider`` names the provider: ``token`` (built in; the token from
``auth_token`` or ``auth_token_file``) or ``package.module:factory``, where ``factory(config)``
returns an object with a ``name``, ``initial_payload()`` and ``answer(challenge)``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from bookkeeper_aio.errors import BKInterfaceError
from bookkeeper_aio.protocol.codes import AUTH_PAYLOAD_BYTES_MAX

if TYPE_CHECKING:
    from bookkeeper_aio.client.config import ClientConfig


class ClientAuthProvider(Protocol):
    name: str

    def initial_payload(self) -> bytes:
        """The payload of the first AUTH on a connection."""
        ...

    def answer(self, challenge: bytes) -> bytes:
        """The payload answering a bookie's challenge (multi-step mechanisms)."""
        ...


class TokenAuth:
    """A bearer token (docs/security.md): sent once per connection, so use it over TLS."""

    name = "token"

    def __init__(self, token: bytes) -> None:
        if not token:
            raise BKInterfaceError("the token auth provider needs a token (auth_token or auth_token_file)")
        if len(token) > AUTH_PAYLOAD_BYTES_MAX:
            raise BKInterfaceError(f"auth token longer than {AUTH_PAYLOAD_BYTES_MAX} bytes")
        self._token = token

    def __repr__(self) -> str:
        return "TokenAuth(<token hidden>)"

    def initial_payload(self) -> bytes:
        return self._token

    def answer(self, challenge: bytes) -> bytes:
        raise BKInterfaceError("the token provider takes no challenge: is the bookie's provider 'token'?")


def read_token_file(path: str) -> bytes:
    """The first non-empty line of ``path`` (a token file shared with nothing else)."""
    try:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                if line.strip():
                    return line.strip().encode()
    except (OSError, UnicodeDecodeError) as error:
        raise BKInterfaceError(f"auth_token_file {path}: {error}") from error
    raise BKInterfaceError(f"auth_token_file {path} holds no token")


def provider_for(config: ClientConfig) -> ClientAuthProvider | None:
    """The provider ``config.auth_provider`` names, None for no authentication."""
    spec = config.auth_provider
    if not spec:
        return None
    if spec == "token":
        token = config.auth_token.encode() if config.auth_token else b""
        if not token and config.auth_token_file:
            token = read_token_file(config.auth_token_file)
        return TokenAuth(token)
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise BKInterfaceError(f"auth_provider {spec!r}: use token or package.module:factory")
    try:
        factory: Callable[[ClientConfig], ClientAuthProvider] = getattr(
            importlib.import_module(module_name), attribute
        )
    except (ImportError, AttributeError) as error:
        raise BKInterfaceError(f"auth_provider {spec!r}: {error}") from error
    return factory(config)
