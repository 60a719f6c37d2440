"""The bookie's token file (bookie.auth.TokenAuthProvider.from_file) and bounded error texts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgpack
import pytest

from bookie.auth import AuthConfigError, Authenticated, TokenAuthProvider
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.errors import ProtocolError


def test_a_token_with_a_colon_is_refused_not_cut(tmp_path: Path) -> None:
    """Before, ``svc:abc:def`` was split at its last ':' into principal ``svc:abc`` and token
    ``def``: a client with the whole token was refused, one with ``def`` accepted, silently."""
    path = tmp_path / "tokens"
    path.write_text("# comment\nsvc:abc:def\n")
    with pytest.raises(AuthConfigError, match=r"tokens:2: more than one ':'"):
        TokenAuthProvider.from_file(str(path))


def test_principal_and_bare_tokens(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("svc:s3cret\nbare-token\n")
    provider = TokenAuthProvider.from_file(str(path))
    step = asyncio.run(provider.authenticate(b"s3cret", {}))
    assert isinstance(step, Authenticated)
    assert step.principal == "svc"
    step = asyncio.run(provider.authenticate(b"bare-token", {}))
    assert isinstance(step, Authenticated)
    assert step.principal == "token#2"


@pytest.mark.parametrize(
    "body",
    [
        msgpack.packb([4, 1, 1]) + bytes(4 << 20),  # trailing bytes
        msgpack.packb([0, 1, 1, b"\xff" * (4 << 20)]),  # a huge bad value
    ],
)
def test_error_texts_of_huge_frames_are_short(body: bytes) -> None:
    with pytest.raises(ProtocolError) as caught:
        m.decode_request(body)
    assert len(str(caught.value)) < 300
    assert caught.value.request_id == 1
