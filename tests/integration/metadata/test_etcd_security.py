"""etcd reached over TLS with a client certificate and with etcd's user authentication, through the
metadata URL options every component takes (docs/security.md)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import trustme
from aetcd import rpc
from structlog.testing import capture_logs

from metadata import connect
from metadata.errors import MetadataError, MetadataUnavailable
from metadata.etcd import EtcdStore
from tests.harness.etcd import EtcdCluster, EtcdMember, require_etcd_binary
from tests.harness.tls import CertFiles, issue

pytestmark = pytest.mark.etcd


@pytest.fixture
def certs(tmp_path: Path) -> tuple[CertFiles, CertFiles]:
    ca = trustme.CA()
    return issue(ca, tmp_path / "certs", "etcd", "127.0.0.1", "localhost"), issue(
        ca, tmp_path / "certs", "client", "bookkeeper-client"
    )


@pytest.fixture
def tls_etcd(tmp_path: Path, certs: tuple[CertFiles, CertFiles]) -> Iterator[EtcdMember]:
    server, client = certs
    health = ssl.create_default_context(cafile=server.ca)
    health.load_cert_chain(client.cert, client.key)
    member = EtcdMember(
        "secure",
        require_etcd_binary(),
        tmp_path / "etcd" / "secure",
        client_scheme="https",
        health_tls=health,
        extra_args=(
            f"--cert-file={server.cert}",
            f"--key-file={server.key}",
            f"--trusted-ca-file={server.ca}",
            "--client-cert-auth",
            "--auth-token-ttl=1",  # simple tokens expire after 1 s idle: the store must renew them
        ),
    )
    member.data_dir.mkdir(parents=True)
    member.start()
    try:
        member.wait_ready()
        yield member
    finally:
        member.stop()


def _url(member: EtcdMember, **options: str) -> str:
    query = "".join(f"&{k}={v}" for k, v in options.items())
    return f"etcd://127.0.0.1:{member.client_port}/test/secure?connect_timeout_s=0.5&op_timeout_s=1.5{query}"


async def _enable_auth(member: EtcdMember, files: CertFiles, password: str) -> None:
    """etcd's root user with ``password``, then authentication on (as an operator would)."""
    pems = [Path(path).read_bytes() for path in (files.ca, files.key, files.cert)]  # noqa: ASYNC240
    credentials = grpc.ssl_channel_credentials(*pems)
    async with rpc.secure_channel(f"127.0.0.1:{member.client_port}", credentials) as channel:
        auth = rpc.AuthStub(channel)
        await auth.UserAdd(rpc.AuthUserAddRequest(name="root", password=password), timeout=5)
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=5)
        await auth.AuthEnable(rpc.AuthEnableRequest(), timeout=5)


async def test_tls_with_a_client_certificate_and_user_credentials(
    tls_etcd: EtcdMember,
    certs: tuple[CertFiles, CertFiles],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tokens_issued: list[str] = []
    authenticate = EtcdStore._authenticate

    async def counting(self: EtcdStore, endpoint: Any, deadline: float) -> None:
        issued = not endpoint.authenticated and bool(self.config.user)
        await authenticate(self, endpoint, deadline)
        if issued:
            tokens_issued.append(endpoint.target)

    monkeypatch.setattr(EtcdStore, "_authenticate", counting)
    server, client = certs
    tls = {"ca_file": server.ca, "cert_file": client.cert, "key_file": client.key}
    async with connect(_url(tls_etcd, **tls)) as conn:
        await conn.store.create("/test/secure/k", b"over tls")
        assert (await conn.store.get("/test/secure/k")).value == b"over tls"  # type: ignore[union-attr]
    # Plaintext against a TLS-only etcd, and TLS without the client certificate: nothing connects.
    for url in (_url(tls_etcd), _url(tls_etcd, ca_file=server.ca)):
        async with connect(url) as conn:
            with pytest.raises(MetadataUnavailable):
                await conn.store.get("/test/secure/k")

    password_file = tmp_path / "etcd-password"
    password_file.write_text("r00t-pass\n")
    await _enable_auth(tls_etcd, client, "r00t-pass")
    with capture_logs() as logs:
        async with connect(_url(tls_etcd, **tls, user="root", password_file=str(password_file))) as conn:
            assert (await conn.store.get("/test/secure/k")).value == b"over tls"  # type: ignore[union-attr]
    assert not [entry for entry in logs if entry["event"] == "metadata.etcd.password_in_plaintext"]
    assert len(tokens_issued) == 1
    async with connect(_url(tls_etcd, **tls, user="root", password_file=str(password_file))) as conn:
        assert (await conn.store.get("/test/secure/k")).value == b"over tls"  # type: ignore[union-attr]
        assert len(tokens_issued) == 2
        await asyncio.sleep(2.5)  # the token expired: the next call authenticates again
        await conn.store.create("/test/secure/k2", b"authenticated")
        assert len(tokens_issued) == 3
        assert (await conn.store.get("/test/secure/k2")).value == b"authenticated"  # type: ignore[union-attr]
    async with connect(_url(tls_etcd, **tls)) as conn:  # no credentials: refused by etcd
        with pytest.raises(MetadataError):
            await conn.store.get("/test/secure/k")
    wrong = tmp_path / "wrong-password"
    wrong.write_text("guess\n")
    async with connect(_url(tls_etcd, **tls, user="root", password_file=str(wrong))) as conn:
        with pytest.raises(MetadataError, match="refused the credentials"):
            await conn.store.get("/test/secure/k")


async def test_credentials_without_tls_are_warned_about_at_connect(
    etcd_server: EtcdCluster, tmp_path: Path
) -> None:
    """A user and password_file on a plaintext URL send the password (and then every call's token)
    readable on the network: the store says so, loudly, once, with what to add to the URL."""
    password_file = tmp_path / "etcd-password"
    password_file.write_text("plain-pass\n")
    host, port = etcd_server.endpoints[0]
    url = f"etcd://{host}:{port}/test/plain?op_timeout_s=2&user=root&password_file={password_file}"
    with capture_logs() as logs:
        async with connect(url) as conn:
            for _ in range(2):
                with pytest.raises(MetadataError):  # this etcd has no users: it refuses Authenticate
                    await conn.store.get("/test/plain/k")
    warnings = [entry for entry in logs if entry["event"] == "metadata.etcd.password_in_plaintext"]
    assert len(warnings) == 1, logs
    assert warnings[0]["log_level"] == "warning"
    assert warnings[0]["user"] == "root"
    assert "tls=1" in warnings[0]["fix"]
    assert "plain-pass" not in repr(logs)


async def _until(condition: Callable[[], bool], *, timeout_s: float) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {timeout_s} s")


async def test_a_watch_resumes_after_etcd_forgot_its_token(
    tls_etcd: EtcdMember, certs: tuple[CertFiles, CertFiles], tmp_path: Path
) -> None:
    """etcd restarted (every simple token gone): it opens the watch's new stream but cancels the
    watch ("permission denied"). The watch logs in again and goes on, on a store that makes no
    other call (a tailing reader, bookie discovery), and warns once, not once per attempt."""
    server, client = certs
    password_file = tmp_path / "etcd-password"
    password_file.write_text("r00t-pass\n")
    await _enable_auth(tls_etcd, client, "r00t-pass")
    url = _url(
        tls_etcd,
        ca_file=server.ca,
        cert_file=client.cert,
        key_file=client.key,
        user="root",
        password_file=str(password_file),
    )
    seen: list[bytes | None] = []
    async with connect(url) as watching, connect(url) as writing:
        revision = await writing.store.put("/test/secure/w", b"0")
        events = watching.store.watch("/test/secure/w", start_revision=revision + 1)

        async def follow() -> None:
            async with contextlib.aclosing(events):
                async for event in events:
                    seen.append(event.value)

        with capture_logs() as logs:
            task = asyncio.create_task(follow())
            try:
                await writing.store.put("/test/secure/w", b"1")
                await _until(lambda: seen == [b"1"], timeout_s=5)
                tls_etcd.stop()
                tls_etcd.start()
                await asyncio.to_thread(tls_etcd.wait_ready)
                await writing.store.put("/test/secure/w", b"2")
                await _until(lambda: seen == [b"1", b"2"], timeout_s=8)
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    warned = [
        e for e in logs if e["event"] == "metadata.etcd.watch_reconnect" and e["log_level"] == "warning"
    ]
    assert len(warned) <= 1, warned
