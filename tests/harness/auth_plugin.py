"""A two-step challenge-response auth provider pair for tests of the pluggable AUTH handshake:
the bookie answers the first AUTH with a random nonce, the client answers with HMAC(secret, nonce)."""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any

from bookie.auth import Authenticated, AuthRefused, AuthStep, Challenge

SECRET = b"shared-test-secret"
NAME = "hmac-challenge"


class BookieHmacAuth:
    name = NAME

    async def authenticate(self, payload: bytes, session: dict[str, Any]) -> AuthStep:
        if "nonce" not in session:
            if payload != b"hello":
                raise AuthRefused("start with hello")
            session["nonce"] = os.urandom(16)
            return Challenge(session["nonce"])
        expected = hmac.new(SECRET, session["nonce"], hashlib.sha256).digest()
        if not hmac.compare_digest(payload, expected):
            raise AuthRefused("wrong answer to the challenge")
        return Authenticated("hmac-client")


class ClientHmacAuth:
    name = NAME

    def __init__(self, secret: bytes = SECRET) -> None:
        self.secret = secret

    def initial_payload(self) -> bytes:
        return b"hello"

    def answer(self, challenge: bytes) -> bytes:
        return hmac.new(self.secret, challenge, hashlib.sha256).digest()


def bookie_provider(config: object) -> BookieHmacAuth:
    return BookieHmacAuth()


def client_provider(config: object) -> ClientHmacAuth:
    return ClientHmacAuth()


def wrong_client_provider(config: object) -> ClientHmacAuth:
    return ClientHmacAuth(b"not the secret")
