"""The simulated network: asyncio transports between protocols, with latency, partitions and kills.

Both ends are the real asyncio protocols (the client's ``BookieConnection``, the bookie's
``ServerConnection``); the loop's ``create_server`` / ``create_connection`` land here.

- A connection is two pipes. A pipe keeps its bytes in order (TCP) and delivers each write after a
  random latency drawn from the seeded RNG, never before the previous write: different
  connections reorder against each other, one stream never does.
- A partition between two nodes stalls both directions of their connections (bytes wait, as TCP
  retransmits them) and makes new connects between them hang (the client's connect timeout ends
  them). Healing delivers what waited. A kill resets a connection at once: both ends see
  ``connection_lost(ConnectionResetError)`` and unsent bytes are lost.
- A node crash resets every connection it had and drops its listeners: what the node had already
  written is on the wire and still arrives, then the peer sees the reset; bytes towards the node
  are lost, and its own protocols hear nothing more (their callbacks die with its incarnation).
- Every delivery runs in the receiving node's context, so the loop can drop it once that node died.
"""

from __future__ import annotations

import asyncio
import contextvars
import random
from collections import deque
from collections.abc import Callable
from typing import Any

from tests.simulation.loop import NODE, SimLoop

LATENCY_S_MIN = 0.0001
LATENCY_S_MAX = 0.002
SPIKE_PROBABILITY = 0.02
SPIKE_S_MAX = 0.05
PORT = 3181


class Endpoint:
    """One side of a connection: its protocol, its node and the context its callbacks run in."""

    __slots__ = ("context", "incarnation", "node", "protocol", "transport")

    def __init__(self, node: str, context: contextvars.Context) -> None:
        self.node = node
        self.context = context
        self.incarnation = context.get(NODE)
        self.protocol: asyncio.BaseProtocol | None = None
        self.transport: SimTransport | None = None


class _Reset:
    """Queued behind a crashed node's last bytes: the peer's reset comes after them."""


class Pipe:
    """One direction of a connection: ordered, delayed delivery to ``receiver``."""

    __slots__ = ("closed", "conn", "last_at", "net", "queue", "receiver", "scheduled", "sender")

    def __init__(self, conn: Connection, sender: Endpoint, receiver: Endpoint) -> None:
        self.conn = conn
        self.net = conn.net
        self.sender = sender
        self.receiver = receiver
        self.queue: deque[tuple[float, bytes | _Reset | None]] = deque()  # None: EOF
        self.scheduled = False
        self.last_at = 0.0
        self.closed = False
        """Nothing more is delivered (a reset): what was queued is lost."""

    def push(self, data: bytes | _Reset | None) -> None:
        net = self.net
        at = net.loop._now_s + net.latency_s(self.sender.node, self.receiver.node)
        if at < self.last_at:
            at = self.last_at
        self.last_at = at
        self.queue.append((at, data))
        if not self.scheduled and not self.closed:
            self.kick()

    def kick(self) -> None:
        if self.scheduled or not self.queue or self.closed:
            return
        net = self.net
        if net.partitions and frozenset((self.sender.node, self.receiver.node)) in net.partitions:
            return  # resumed by heal()
        transport = self.receiver.transport
        if transport is not None and transport.reading_paused:
            return  # resumed by resume_reading()
        self.scheduled = True
        net.loop.call_at(self.queue[0][0], self._deliver, context=self.receiver.context)

    def _deliver(self) -> None:
        self.scheduled = False
        queue = self.queue
        if self.closed or not queue:
            return
        net = self.net
        receiver = self.receiver
        if net.partitions and frozenset((self.sender.node, receiver.node)) in net.partitions:
            return
        transport = receiver.transport
        if transport is not None and transport.reading_paused:
            return
        _, data = queue.popleft()
        protocol = receiver.protocol
        assert isinstance(protocol, asyncio.Protocol)
        if data is None:  # the sender closed: the stream ends here
            self.conn.finish(receiver, None)
            return
        if data.__class__ is _Reset:  # the sender crashed after writing what came before
            self.closed = True
            self.conn.finish(receiver, ConnectionResetError("connection reset (simulated crash)"))
            return
        sender_transport = self.sender.transport
        if sender_transport is not None:  # SimTransport.unsent, inline (one call less a message)
            sender_transport._buffered -= len(data)  # type: ignore[arg-type]
            if sender_transport._writing_paused:
                sender_transport.unsent(0)
        protocol.data_received(data)
        if queue and not self.scheduled:
            self.kick()


class Connection:
    """A simulated TCP connection between a client endpoint and a server endpoint."""

    def __init__(self, net: Network, client: Endpoint, server: Endpoint, ident: int) -> None:
        self.net = net
        self.ident = ident
        self.client = client
        self.server = server
        self.to_server = Pipe(self, client, server)
        self.to_client = Pipe(self, server, client)
        self.dead = False
        self._lost: set[int] = set()

    def pipe_from(self, endpoint: Endpoint) -> Pipe:
        return self.to_server if endpoint is self.client else self.to_client

    def nodes(self) -> tuple[str, str]:
        return self.client.node, self.server.node

    def finish(self, endpoint: Endpoint, exc: Exception | None) -> None:
        """Tell ``endpoint``'s protocol the connection is gone (once)."""
        if id(endpoint) in self._lost:
            return
        self._lost.add(id(endpoint))
        if endpoint.transport is not None:
            endpoint.transport.closed = True
        protocol = endpoint.protocol
        if protocol is not None:
            self.net.loop.call_soon(protocol.connection_lost, exc, context=endpoint.context)
        if len(self._lost) == 2:
            self.dead = True
            self.net.connections.discard(self)

    def crashed(self, endpoint: Endpoint) -> None:
        """``endpoint``'s node crashed: its written bytes still arrive, then the peer is reset."""
        self._lost.add(id(endpoint))  # its protocol hears nothing more
        self.pipe_to(endpoint).closed = True
        self.pipe_from(endpoint).push(_Reset())
        if len(self._lost) == 2:  # both ends' nodes crashed
            self.dead = True
            self.net.connections.discard(self)

    def pipe_to(self, endpoint: Endpoint) -> Pipe:
        return self.to_client if endpoint is self.client else self.to_server

    def reset(self) -> None:
        """Both ends see a reset; bytes not yet delivered are lost."""
        self.dead = True
        self.to_server.closed = self.to_client.closed = True
        self.net.connections.discard(self)
        for endpoint in (self.client, self.server):
            if id(endpoint) not in self._lost:
                self._lost.add(id(endpoint))
                if endpoint.transport is not None:
                    endpoint.transport.closed = True
                if endpoint.protocol is not None:
                    self.net.loop.call_soon(
                        endpoint.protocol.connection_lost,
                        ConnectionResetError("connection reset (simulated)"),
                        context=endpoint.context,
                    )


class SimTransport(asyncio.Transport):
    """The asyncio transport of one endpoint."""

    def __init__(self, conn: Connection, endpoint: Endpoint, peer: tuple[str, int]) -> None:
        super().__init__()
        self._conn = conn
        self._endpoint = endpoint
        self._out = conn.pipe_from(endpoint)
        self._peer = peer
        self.closed = False
        self._closing = False
        self.reading_paused = False
        self._buffered = 0
        self._high = 64 * 1024
        self._writing_paused = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "peername":
            return self._peer
        return default

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing or self.closed or self._conn.dead:
            return
        incarnation = self._endpoint.incarnation
        if incarnation is not None and incarnation.dead:
            return  # the node crashed in the middle of the step that writes this: nothing is sent
        data = bytes(data)
        if not data:
            return
        net = self._conn.net
        if net.lose and net.lost_here(self._conn, self._endpoint):
            return
        self._buffered += len(data)
        self._out.push(data)
        if not self._writing_paused and self._buffered > self._high:
            self._writing_paused = True
            protocol = self._endpoint.protocol
            assert isinstance(protocol, asyncio.Protocol)
            protocol.pause_writing()

    def unsent(self, length: int) -> None:
        """``length`` bytes were delivered: below the low mark, writing resumes."""
        self._buffered -= length
        if self._writing_paused and self._buffered <= self._high // 4 and not self.closed:
            self._writing_paused = False
            protocol = self._endpoint.protocol
            assert isinstance(protocol, asyncio.Protocol)
            self._conn.net.loop.call_soon(protocol.resume_writing, context=self._endpoint.context)

    def writelines(self, list_of_data: Any) -> None:
        self.write(b"".join(list_of_data))

    def can_write_eof(self) -> bool:
        return False

    def is_closing(self) -> bool:
        return self._closing or self.closed

    def _dead(self) -> bool:
        incarnation = self._endpoint.incarnation
        return incarnation is not None and incarnation.dead

    def close(self) -> None:
        """Graceful: the peer gets what was written, then the end of the stream."""
        if self._closing or self.closed or self._dead():
            return
        self._closing = True
        self._conn.pipe_from(self._endpoint).push(None)
        self._conn.finish(self._endpoint, None)

    def abort(self) -> None:
        if self.closed or self._dead():
            return
        self._closing = True
        conn = self._conn
        conn.dead = True
        conn.to_server.closed = conn.to_client.closed = True
        conn.finish(self._endpoint, None)
        other = conn.server if self._endpoint is conn.client else conn.client
        if id(other) not in conn._lost:
            conn._lost.add(id(other))
            if other.transport is not None:
                other.transport.closed = True
            if other.protocol is not None:
                conn.net.loop.call_at(
                    conn.net.loop.time() + conn.net.latency_s(),
                    other.protocol.connection_lost,
                    ConnectionResetError("connection reset by peer (simulated)"),
                    context=other.context,
                )
        conn.net.connections.discard(conn)

    def pause_reading(self) -> None:
        self.reading_paused = True

    def resume_reading(self) -> None:
        if self.reading_paused:
            self.reading_paused = False
            conn = self._conn
            (conn.to_client if self._endpoint is conn.client else conn.to_server).kick()

    def is_reading(self) -> bool:
        return not self.reading_paused

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if high is not None:
            self._high = high

    def get_write_buffer_size(self) -> int:
        return self._buffered


class _ListenSocket:
    """What ``asyncio.Server.sockets`` gives the bookie: a name, and a duplicate it can listen on."""

    def __init__(self, address: tuple[str, int]) -> None:
        self._address = address

    def getsockname(self) -> tuple[str, int]:
        return self._address

    def dup(self) -> _ListenSocket:
        return self

    def listen(self, backlog: int) -> None:
        pass

    def __enter__(self) -> _ListenSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class SimServer:
    """A listener (what ``loop.create_server`` returns)."""

    def __init__(
        self, net: Network, factory: Callable[[], asyncio.BaseProtocol], address: tuple[str, int]
    ) -> None:
        self._net = net
        self.factory = factory
        self.address = address
        self.node = address[0]
        self.context = contextvars.copy_context()
        self.serving = False
        self.sockets = [_ListenSocket(address)]

    async def start_serving(self) -> None:
        self.serving = True

    def is_serving(self) -> bool:
        return self.serving

    def close(self) -> None:
        self.serving = False
        if self._net.listeners.get(self.address) is self:
            del self._net.listeners[self.address]

    async def wait_closed(self) -> None:
        pass


def stable_hash(protocol: object) -> int:
    """A server-side protocol's hash during a run (``run_seed`` installs it as
    ``ServerConnection.__hash__``): its connection's number in the world, not its address. The
    bookie keeps its connections in a set and walks it (closing them when a start fails or the
    server closes, pausing them, choosing one to make room): with hashes from memory addresses
    that order, and the peers' ``connection_lost`` times drawn in it, depended on what the process
    had allocated before (autorecovery seed 46 gave two traces in one process, run twice in a
    row). An object the simulation did not make keeps its usual hash."""
    ident = getattr(protocol, "_sim_hash", None)
    return object.__hash__(protocol) if ident is None else int(ident)


class Network:
    """Every listener and connection of the simulated world. Node names are host names."""

    def __init__(self, loop: SimLoop, rng: random.Random) -> None:
        self.loop = loop
        self.rng = rng
        loop.network = self
        self.listeners: dict[tuple[str, int], SimServer] = {}
        self.connections: set[Connection] = set()
        self.partitions: set[frozenset[str]] = set()
        self._ids = 0
        self._healed: asyncio.Event | None = None
        self.slow: dict[tuple[str, str], float] = {}
        """Directed links with a high latency: (sender, receiver) -> the maximum, in seconds."""
        self.lose: set[tuple[str, str]] = set()
        """Directed links whose next message is lost: the connection carrying it resets instead."""
        self.trace: Callable[[str], None] = lambda line: None

    def latency_s(self, sender: str = "", receiver: str = "") -> float:
        """One message's latency. ``Random.uniform(a, b)`` is ``a + (b - a) * random()``: written
        out here (the same draws, the same floats), as it is on every message's path."""
        random = self.rng.random
        if self.slow and (sender, receiver) in self.slow:
            return LATENCY_S_MAX + (self.slow[sender, receiver] - LATENCY_S_MAX) * random()
        if random() < SPIKE_PROBABILITY:
            return LATENCY_S_MAX + (SPIKE_S_MAX - LATENCY_S_MAX) * random()
        return LATENCY_S_MIN + (LATENCY_S_MAX - LATENCY_S_MIN) * random()

    # ------------------------------------------------------------------ loop entry points
    def listen(self, factory: Callable[[], asyncio.BaseProtocol], host: str, port: int) -> SimServer:
        address = (host, port or PORT)
        if address in self.listeners:
            raise OSError(98, f"address {host}:{address[1]} in use (simulated)")
        server = SimServer(self, factory, address)
        self.listeners[address] = server
        return server

    async def connect(
        self, factory: Callable[[], asyncio.BaseProtocol], host: str, port: int
    ) -> tuple[asyncio.Transport, asyncio.BaseProtocol]:
        node = self.node_of_caller()
        await asyncio.sleep(self.latency_s())
        while self.blocked(node, host):  # SYNs are retransmitted until the partition heals
            if self._healed is None:
                self._healed = asyncio.Event()
            await self._healed.wait()
        listener = self.listeners.get((host, port))
        if listener is None or not listener.serving:
            raise ConnectionRefusedError(111, f"connection refused by {host}:{port} (simulated)")
        self._ids += 1
        client = Endpoint(node, contextvars.copy_context())
        server = Endpoint(listener.node, listener.context)
        conn = Connection(self, client, server, self._ids)
        client.transport = SimTransport(conn, client, (host, port))
        server.transport = SimTransport(conn, server, (node, 40000 + self._ids))
        server.protocol = listener.context.run(listener.factory)
        server.protocol._sim_hash = self._ids  # type: ignore[attr-defined]  # see stable_hash
        client.protocol = factory()
        self.connections.add(conn)
        listener.context.run(server.protocol.connection_made, server.transport)
        client.protocol.connection_made(client.transport)
        return client.transport, client.protocol

    @staticmethod
    def node_of_caller() -> str:
        node = NODE.get()
        return node.name if node is not None else "client"

    # ------------------------------------------------------------------ faults
    def blocked(self, a: str, b: str) -> bool:
        return bool(self.partitions) and frozenset((a, b)) in self.partitions

    def partition(self, a: str, b: str) -> None:
        self.partitions.add(frozenset((a, b)))

    def _wake_connects(self) -> None:
        if self._healed is not None:
            self._healed.set()
            self._healed = None

    def lose_next(self, sender: str, receiver: str) -> None:
        """The next message ``sender`` writes to ``receiver`` is lost with its connection: a reset
        races it (both ends see the reset; what was in flight on the connection is lost too)."""
        self.lose.add((sender, receiver))

    def lost_here(self, conn: Connection, sender: Endpoint) -> bool:
        """Whether ``sender``'s write on ``conn`` is the one to lose (and if so, lose it)."""
        receiver = conn.server if sender is conn.client else conn.client
        link = (sender.node, receiver.node)
        if link not in self.lose:
            return False
        self.lose.discard(link)
        self.trace(f"lost a message {link[0]} -> {link[1]} (its connection reset)")
        conn.reset()
        return True

    def unpartition(self, a: str, b: str) -> None:
        self.partitions.discard(frozenset((a, b)))
        self._wake_connects()
        for conn in self.connections_of(a):
            if b in conn.nodes():
                conn.to_server.kick()
                conn.to_client.kick()

    def connections_of_all(self) -> list[Connection]:
        return sorted(self.connections, key=lambda c: c.ident)

    def heal(self) -> None:
        self.partitions.clear()
        self.slow.clear()
        self.lose.clear()
        self._wake_connects()
        for conn in sorted(self.connections, key=lambda c: c.ident):
            conn.to_server.kick()
            conn.to_client.kick()

    def kill_connection(self, conn: Connection) -> None:
        conn.reset()

    def crash_node(self, node: str) -> None:
        """The node's connections reset for their peers; its listeners vanish."""
        for address in [a for a in self.listeners if a[0] == node]:
            self.listeners[address].serving = False
            del self.listeners[address]
        for conn in sorted(self.connections, key=lambda c: c.ident):
            if node in conn.nodes():
                conn.crashed(conn.server if conn.server.node == node else conn.client)

    def connections_of(self, node: str) -> list[Connection]:
        return sorted((c for c in self.connections if node in c.nodes()), key=lambda c: c.ident)
