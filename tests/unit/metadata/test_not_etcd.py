"""A metadata URL that names an HTTP/2 (gRPC) server which is not etcd: the error says so, and what
to check, instead of a bare ``etcd UNIMPLEMENTED: Method not found!``."""

from __future__ import annotations

import grpc
import pytest

import metadata


async def test_a_grpc_server_that_is_not_etcd_is_named_so() -> None:
    server = grpc.aio.server()  # no services: every etcd method is UNIMPLEMENTED
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with metadata.connect(f"etcd://127.0.0.1:{port}/bookkeeper/x?op_timeout_s=5") as meta:
            with pytest.raises(metadata.MetadataError) as raised:
                await metadata.read_cluster_info(meta.store, meta.root)
    finally:
        await server.stop(None)
    assert not isinstance(raised.value, metadata.MetadataUnavailable)  # it answered: no retrying
    assert f"the server at 127.0.0.1:{port} is not etcd" in str(raised.value)
    assert "check the metadata URL's HOST:PORT" in str(raised.value)
