"""The pool tells a handshake refusal (token, TLS, a TLS-only bookie hanging up on plaintext) from a
connection lost after the handshake: only the first may turn "no writable bookie" into Unauthorized."""

from __future__ import annotations

import asyncio

from bookkeeper_aio.client.bookie_client import BookiePool
from bookkeeper_aio.client.config import ClientConfig
from bookkeeper_aio.errors import Unauthorized


def test_a_hang_up_before_hello_is_a_refusal_after_it_is_not() -> None:
    async def main() -> None:
        pool = BookiePool(ClientConfig())
        before = pool._new_connection("b-tls", on_close=None)
        before.fail(ConnectionResetError("b-tls closed the connection"))
        refusal = pool._handshake_refusal(before)
        assert isinstance(refusal, Unauthorized)
        assert "before answering HELLO: it may require TLS" in str(refusal)

        after = pool._new_connection("b-lost", on_close=None)
        after.hello_answered = True  # a working connection the bookie later dropped (a crash)
        after.fail(ConnectionResetError("b-lost closed the connection"))
        assert pool._handshake_refusal(after) is None

        refused = pool._new_connection("b-token", on_close=None)
        refused.hello_answered = True
        token = Unauthorized("b-token refused authentication: token refused")
        refused.fail(token)
        assert pool._handshake_refusal(refused) is token
        assert pool.refusal("b-token") is None  # recorded only as connections close in the pool

    asyncio.run(main())
