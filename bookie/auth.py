"""Authentication of client connections: pluggable providers, a token provider built in.

Like BookKeeper's ``BookieAuthProvider``: a connection authenticates with an AUTH handshake
(docs/protocol.md §3.10) before any other request. A provider gets the client's payload and
either accepts it (:class:`Authenticated`, naming the principal for the logs), answers with a
challenge the client must answer in another AUTH (:class:`Challenge`: multi-step mechanisms), or
refuses it (raises :class:`AuthRefused`).

Providers are named in the bookie's ``auth_providers`` setting: ``token`` (built in), or
``package.module:factory`` for a provider of your own, where ``factory(config)`` returns an object
with a ``name`` (the provider name clients send) and ``async authenticate(payload, session)``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from bookie.config import BookieConfig


class AuthRefused(Exception):
    """The client's credentials are not accepted; the message goes back to the client (EUA)."""


class AuthConfigError(ValueError):
    """The auth settings cannot be used (unknown provider, unreadable token file)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Authenticated:
    principal: str
    """Who the client is, for the logs (never the secret itself)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Challenge:
    payload: bytes
    """Sent back in an EOK AUTH answer with ``complete`` 0: the client answers it in its next AUTH."""


AuthStep = Authenticated | Challenge


class BookieAuthProvider(Protocol):
    name: str

    async def authenticate(self, payload: bytes, session: dict[str, Any]) -> AuthStep:
        """One AUTH step of a connection. ``session`` is this connection's scratch space, kept
        between the steps of a multi-step exchange. Raises :class:`AuthRefused`."""
        ...


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(b"bookkeeper-aio/auth-token\x00" + token).digest()


class TokenAuthProvider:
    """Shared bearer tokens: the client's payload must be one of the tokens in the token file (one
    per line, blank lines and ``#`` comments ignored; optionally ``principal:token`` to name who
    holds it in the logs; a token may not hold ``:``, a line with two is refused). Compared in
    constant time over fixed-size digests, so neither the content nor the length of a wrong token
    leaks through timing. Meant for use over TLS: a token on a plaintext connection can be read by
    anyone on the path."""

    name = "token"

    def __init__(self, tokens: dict[bytes, str]) -> None:
        if not tokens:
            raise AuthConfigError("the token provider needs at least one token")
        self._digests = [(_digest(token), principal) for token, principal in tokens.items()]

    @classmethod
    def from_file(cls, path: str) -> TokenAuthProvider:
        try:
            with open(path, encoding="utf-8") as handle:
                lines = handle.read().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise AuthConfigError(f"auth_token_file {path}: {exc}") from exc
        tokens: dict[bytes, str] = {}
        for number, raw in enumerate(lines, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if line.count(":") > 1:  # cut at either ':' would silently make another token
                raise AuthConfigError(
                    f"auth_token_file {path}:{number}: more than one ':' (write principal:token, or the "
                    "token alone; a token may not hold ':')"
                )
            principal, sep, token = line.partition(":")
            if not sep:
                principal, token = f"token#{number}", line
            if not token:
                raise AuthConfigError(f"auth_token_file {path}:{number}: empty token")
            tokens[token.encode()] = principal or f"token#{number}"
        if not tokens:
            raise AuthConfigError(f"auth_token_file {path} holds no token")
        return cls(tokens)

    async def authenticate(self, payload: bytes, session: dict[str, Any]) -> AuthStep:
        offered = _digest(payload)
        found = None
        for digest, principal in self._digests:  # every one compared: no early exit to time
            if hmac.compare_digest(offered, digest):
                found = principal
        if found is None:
            raise AuthRefused("token refused: check the client's auth_token")
        return Authenticated(found)


def load_providers(config: BookieConfig) -> dict[str, BookieAuthProvider]:
    """The providers ``config.auth_providers`` names, by the name clients send; {} = no auth."""
    providers: dict[str, BookieAuthProvider] = {}
    for spec in (part.strip() for part in config.auth_providers.split(",")):
        if not spec:
            continue
        provider: BookieAuthProvider
        if spec == "token":
            if not config.auth_token_file:
                raise AuthConfigError("auth_providers has token: set auth_token_file (one token per line)")
            provider = TokenAuthProvider.from_file(config.auth_token_file)
        else:
            provider = _plugin(spec)(config)
        if not isinstance(getattr(provider, "name", None), str):
            raise AuthConfigError(f"auth provider {spec!r} has no name")
        providers[provider.name] = provider
    return providers


def _plugin(spec: str) -> Callable[[BookieConfig], BookieAuthProvider]:
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise AuthConfigError(f"auth provider {spec!r}: use token or package.module:factory")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise AuthConfigError(f"auth provider {spec!r}: {exc}") from exc
    if not callable(factory):
        raise AuthConfigError(f"auth provider {spec!r} is not callable")
    return factory  # type: ignore[no-any-return]
