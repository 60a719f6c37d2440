"""TLS on the bookie port (server certificate, host name, mutual TLS) and the AUTH handshake, on
real bookie processes, through the library's connection pool and a raw wire client."""

from __future__ import annotations

import asyncio
import ssl
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from bookkeeper_aio.client.bookie_client import BookiePool
from bookkeeper_aio.client.config import ClientConfig
from bookkeeper_aio.errors import BKError, Unauthorized
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import StatusCode
from tests.harness.admin_http import get_json, http_get, post_json
from tests.harness.bookie_proc import BookieProcess
from tests.harness.tls import CertFiles, issue

from .wire import KEY, WireClient, entry_body

TOKEN = "s3cret-token-for-tests"


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def server_files(ca: trustme.CA, tmp_path: Path) -> CertFiles:
    return issue(ca, tmp_path / "certs", "bookie", "127.0.0.1", "localhost")


def _start(tmp_path: Path, *args: str) -> BookieProcess:
    proc = BookieProcess(tmp_path / "bookie", bookie_id="bookie-1", extra_args=list(args))
    proc.start()
    return proc


@pytest.fixture
def tls_bookie(tmp_path: Path, server_files: CertFiles) -> Iterator[BookieProcess]:
    proc = _start(tmp_path, "--tls-cert-file", server_files.cert, "--tls-key-file", server_files.key)
    yield proc
    proc.cleanup()


@pytest.fixture
def token_bookie(tmp_path: Path) -> Iterator[BookieProcess]:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# who:token\nalice:{TOKEN}\n")
    proc = _start(
        tmp_path, "--auth-providers", "token", "--auth-token-file", str(tokens), "--auth-timeout-s", "2"
    )
    yield proc
    proc.cleanup()


def _bookie_id(proc: BookieProcess) -> str:
    host, port = proc.address
    return f"{host}:{port}"


async def _add_and_read(config: ClientConfig, proc: BookieProcess, ledger_id: int) -> None:
    """Through the library's pool: an add and a read of it answered EOK (else the error raises)."""
    pool = BookiePool(config)
    bookie = _bookie_id(proc)
    try:
        body = entry_body(ledger_id, 0, b"secure")
        added = await pool.request(
            bookie, lambda rid: m.AddEntryRequest(rid, ledger_id, 0, 0, KEY, body), timeout_s=5
        )
        assert added.status == StatusCode.EOK, added
        read = await pool.request(
            bookie, lambda rid: m.ReadEntryRequest(rid, ledger_id, 0, 0, KEY), timeout_s=5
        )
        assert isinstance(read, m.ReadEntryResponse)
        assert (read.status, read.body) == (StatusCode.EOK, body)
    finally:
        await pool.close()


async def _refused(config: ClientConfig, proc: BookieProcess) -> BaseException:
    """The cause of the failure of a request through the library's pool (it must fail)."""
    pool = BookiePool(config)

    async def read_lac() -> None:
        response = await pool.request(_bookie_id(proc), lambda rid: m.ReadLacRequest(rid, 1), timeout_s=5)
        if response.status != StatusCode.EOK:
            raise Unauthorized(f"status {response.status}: {response.message}")

    try:
        with pytest.raises(BKError) as info:
            await read_lac()
        error: BaseException = info.value
        while error.__cause__ is not None:
            error = error.__cause__
        return error
    finally:
        await pool.close()


# ---------------------------------------------------------------------------------------------- TLS
async def test_tls__client_with_the_ca_works__without_it_cannot_connect(
    tls_bookie: BookieProcess, server_files: CertFiles
) -> None:
    await _add_and_read(ClientConfig(tls_enabled=True, tls_ca_file=server_files.ca), tls_bookie, 1)
    # The system's trust store does not know the throwaway CA: the certificate is not trusted.
    cause = await _refused(ClientConfig(tls_enabled=True, connect_timeout_s=3), tls_bookie)
    assert isinstance(cause, ssl.SSLCertVerificationError), repr(cause)
    # Another CA's certificate list does not help either.
    other = issue(trustme.CA(), Path(server_files.ca).parent, "other", "127.0.0.1")
    cause = await _refused(ClientConfig(tls_enabled=True, tls_ca_file=other.ca), tls_bookie)
    assert isinstance(cause, ssl.SSLCertVerificationError), repr(cause)
    # A plaintext client gets nothing but a closed connection (the TLS layer refuses its bytes).
    plain = await WireClient.connect(*tls_bookie.address)
    answer = plain.request(m.ReadLacRequest, 1)
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(answer, 10)


async def test_tls__a_connection_over_the_per_address_limit_is_reset_before_any_tls(
    tmp_path: Path, server_files: CertFiles
) -> None:
    """One connection per address: a second one from the same address is refused at accept, held
    unread in the tarpit, then reset (no TLS alert, no handshake: a TLS client sees the reset),
    counted in the refusals and tarpit metrics, while the first still completes its handshake and
    works."""
    tls = ("--tls-cert-file", server_files.cert, "--tls-key-file", server_files.key)
    proc = _start(tmp_path, *tls, "--connections-per-address-max", "1", "--admin-port", "0")
    try:
        host, port = proc.address
        holder_reader, holder = await asyncio.open_connection(host, port)  # holds the one slot
        await asyncio.sleep(0.2)  # accepted and counted
        context = ssl.create_default_context(cafile=server_files.ca)
        with pytest.raises(ConnectionResetError):  # held, then reset: never an SSL error
            await asyncio.wait_for(asyncio.open_connection(host, port, ssl=context), 10)
        _, _, metrics = await http_get(*proc.admin_address(), "/metrics")
        assert b"bookie_connections_refused_total 1.0" in metrics, metrics
        assert b"bookie_connections_tarpitted_total 1.0" in metrics, metrics
        assert b"bookie_connections_held 0.0" in metrics, metrics  # reset: none held any more
        holder.close()
        await asyncio.sleep(0.2)  # its slot is given back
        await _add_and_read(ClientConfig(tls_enabled=True, tls_ca_file=server_files.ca), proc, 2)
        del holder_reader
    finally:
        proc.cleanup()


async def test_tls__host_name_is_checked(ca: trustme.CA, tmp_path: Path) -> None:
    files = issue(ca, tmp_path / "certs", "elsewhere", "bookie.example.org")
    proc = _start(tmp_path, "--tls-cert-file", files.cert, "--tls-key-file", files.key)
    try:
        cause = await _refused(ClientConfig(tls_enabled=True, tls_ca_file=files.ca), proc)
        assert isinstance(cause, ssl.SSLCertVerificationError), repr(cause)
        assert "127.0.0.1" in str(cause)  # the mismatch is named
        unchecked = ClientConfig(tls_enabled=True, tls_ca_file=files.ca, tls_check_hostname=False)
        await _add_and_read(unchecked, proc, 2)
    finally:
        proc.cleanup()


async def test_mutual_tls__a_wrong_or_missing_client_certificate_is_refused(
    ca: trustme.CA, server_files: CertFiles, tmp_path: Path
) -> None:
    clients_ca = trustme.CA()
    good = issue(clients_ca, tmp_path / "certs", "client", "client-1")
    wrong = issue(trustme.CA(), tmp_path / "certs", "intruder", "client-1")  # same name, other CA
    proc = _start(
        tmp_path,
        *("--tls-cert-file", server_files.cert, "--tls-key-file", server_files.key),
        *("--tls-ca-file", good.ca, "--tls-client-auth", "required"),
    )
    try:
        base = {"tls_enabled": True, "tls_ca_file": server_files.ca}
        await _add_and_read(ClientConfig(**base, tls_cert_file=good.cert, tls_key_file=good.key), proc, 3)
        for config in (
            ClientConfig(**base),  # no certificate
            ClientConfig(**base, tls_cert_file=wrong.cert, tls_key_file=wrong.key),
        ):
            cause = await _refused(config, proc)
            assert isinstance(cause, ssl.SSLError | ConnectionError), repr(cause)
    finally:
        proc.cleanup()


# ---------------------------------------------------------------------------------------------- AUTH
async def test_auth__no_token_gets_eua_before_any_data_op_and_the_connection_closes(
    token_bookie: BookieProcess,
) -> None:
    wire = await WireClient.connect(*token_bookie.address)
    hello = await wire.request(m.HelloRequest, 1, "no-token")
    assert hello.status == StatusCode.EOK  # the version handshake needs no credentials
    add = await wire.add(5, 0, b"must not be stored")
    assert (add.status, add.request_id) == (StatusCode.EUA, add.request_id)
    await asyncio.wait_for(wire.closed, 5)
    # Nothing was stored: an authenticated reader finds no ledger 5.
    reader = await WireClient.connect(*token_bookie.address)
    assert (await reader.request(m.AuthRequest, "token", TOKEN.encode())).complete == 1
    assert (await reader.read(5, 0)).status == StatusCode.ENOLEDGER
    reader.close()


@pytest.mark.parametrize(
    ("provider", "payload"),
    [("token", b"wrong-token"), ("token", b""), ("kerberos", TOKEN.encode())],
    ids=["wrong_token", "empty_token", "unknown_provider"],
)
async def test_auth__a_wrong_credential_is_refused(
    token_bookie: BookieProcess, provider: str, payload: bytes
) -> None:
    wire = await WireClient.connect(*token_bookie.address)
    refused = await wire.request(m.AuthRequest, provider, payload)
    assert refused.status == StatusCode.EUA
    assert refused.complete == 0
    await asyncio.wait_for(wire.closed, 5)


async def test_auth__the_right_token_pipelined_with_requests_works(token_bookie: BookieProcess) -> None:
    wire = await WireClient.connect(*token_bookie.address)
    # One write: HELLO, AUTH and an add; the bookie holds the add until AUTH is decided.
    hello = wire.request(m.HelloRequest, 1, "pipelined")
    auth = wire.request(m.AuthRequest, "token", TOKEN.encode())
    add = wire.add(6, 0, b"after auth")
    assert (await hello).status == StatusCode.EOK
    assert ((await auth).status, (await auth).complete) == (StatusCode.EOK, 1)
    assert (await add).status == StatusCode.EOK
    # AUTH again after other requests is a bad request, not a second login.
    again = await wire.request(m.AuthRequest, "token", TOKEN.encode())
    assert again.status == StatusCode.EBADREQ
    wire.close()


async def test_auth__through_the_library(token_bookie: BookieProcess, tmp_path: Path) -> None:
    token_file = tmp_path / "client-token"
    token_file.write_text(TOKEN + "\n")
    await _add_and_read(ClientConfig(auth_provider="token", auth_token_file=str(token_file)), token_bookie, 7)
    cause = await _refused(ClientConfig(auth_provider="token", auth_token="not-it"), token_bookie)
    assert isinstance(cause, Unauthorized), repr(cause)
    assert "refused authentication" in str(cause)
    # A client with no auth configured: its first request is answered EUA.
    cause = await _refused(ClientConfig(), token_bookie)
    assert isinstance(cause, Unauthorized), repr(cause)
    assert "status 502: authenticate first" in str(cause)


async def test_auth__an_unauthenticated_connection_is_closed_after_the_timeout(
    token_bookie: BookieProcess,
) -> None:
    wire = await WireClient.connect(*token_bookie.address)
    await asyncio.wait_for(wire.closed, 6)  # --auth-timeout-s 2


async def test_auth__a_large_frame_before_auth_closes_the_connection_at_its_length_prefix(
    tmp_path: Path,
) -> None:
    """Before AUTH only HELLO and AUTH (<= 16 KiB of payload) are legal: an unauthenticated
    connection announcing a 1 MiB frame is closed at once, unread, instead of making the bookie
    buffer up to frame_bytes_max (5 MiB) for it until the auth timeout. After AUTH the same frame
    size is served."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice:{TOKEN}\n")
    proc = _start(
        tmp_path, "--auth-providers", "token", "--auth-token-file", str(tokens), "--auth-timeout-s", "60"
    )
    try:
        large = await WireClient.connect(*proc.address)
        large.send_raw(struct.pack(">I", 1024 * 1024) + bytes(4096))
        await asyncio.wait_for(asyncio.shield(large.closed), 10)  # not the 60 s auth timeout
        # A frame within the handshake bound is kept (a HELLO whose bytes are slow to come).
        small = await WireClient.connect(*proc.address)
        small.send_raw(struct.pack(">I", 60 * 1024) + bytes(4096))
        await asyncio.sleep(1)
        assert not small.closed.done()
        small.close()
        # Authenticated, a 1 MiB add is served.
        wire = await WireClient.connect(*proc.address)
        assert (await wire.request(m.AuthRequest, "token", TOKEN.encode())).complete == 1
        big = b"x" * (1024 * 1024)
        assert (await wire.add(9, 0, big)).status == StatusCode.EOK
        assert (await wire.read(9, 0)).body == entry_body(9, 0, big)
        wire.close()
    finally:
        proc.cleanup()
    lines = [
        line for line in proc.log_path.read_text(errors="replace").splitlines() if "frame_too_large" in line
    ]
    assert len(lines) == 1, lines
    assert "65536" in lines[0], lines
    assert '"before": "auth"' in lines[0], lines


async def test_no_auth_bookie__serves_clients_with_and_without_a_token(tmp_path: Path) -> None:
    proc = _start(tmp_path)
    try:
        await _add_and_read(ClientConfig(auth_provider="token", auth_token="anything"), proc, 8)
        await _add_and_read(ClientConfig(), proc, 9)
        wire = await WireClient.connect(*proc.address)
        answer = await wire.request(m.AuthRequest, "token", b"x")
        assert (answer.status, answer.complete) == (StatusCode.EOK, 1)
        wire.close()
    finally:
        proc.cleanup()


# ---------------------------------------------------------------------------------------------- admin
async def test_admin__state_changes_only_by_post_with_the_token(tmp_path: Path) -> None:
    proc = _start(tmp_path, "--admin-port", "0")
    try:
        host, port = proc.admin_address()
        assert host == "127.0.0.1"  # loopback by default
        token = proc.admin_token()
        assert len(token) >= 32
        assert (proc.data_dir / "admin.token").stat().st_mode & 0o077 == 0  # owner only
        status, _, _ = await http_get(host, port, "/readonly?set=1")  # cross-site triggerable
        assert status == 405
        status, _, _ = await http_get(host, port, "/gc?start=1")
        assert status == 405
        status, _, _ = await http_get(host, port, "/readonly?set=1", method="POST")
        assert status == 401
        status, _, _ = await http_get(host, port, "/readonly?set=1", method="POST", token="guess")
        assert status == 403
        status, mode = await get_json(host, port, "/readonly")
        assert (status, mode["mode"]) == (200, "writable")  # none of the above changed anything
        status, mode = await post_json(host, port, "/readonly?set=1", token)
        assert (status, mode["mode"], mode["manual"]) == (200, "readonly", True)
    finally:
        proc.cleanup()


async def test_auth__a_pluggable_two_step_provider(tmp_path: Path) -> None:
    """A provider of our own on both sides (tests/harness/auth_plugin.py): a challenge, its answer."""
    proc = _start(tmp_path, "--auth-providers", "tests.harness.auth_plugin:bookie_provider")
    try:
        await _add_and_read(ClientConfig(auth_provider="tests.harness.auth_plugin:client_provider"), proc, 10)
        wrong = ClientConfig(auth_provider="tests.harness.auth_plugin:wrong_client_provider")
        cause = await _refused(wrong, proc)
        assert isinstance(cause, Unauthorized), repr(cause)
        assert "wrong answer to the challenge" in str(cause)
    finally:
        proc.cleanup()
