"""Connections, bounded below the app: how long one may sit without a request, and how many may be open.

`listen(host, port)` binds the listening sockets before anything loads (a port in use is one line naming --port).
`guarded_protocol(guard)` is uvicorn's HTTP protocol (httptools, else h11: the class uvicorn's "auto" picks) with a
`ConnectionGuard` watching every connection; serve() hands it to uvicorn. The guard owns these rules:

- The header timeout. A connection with no request in progress (just opened, idle between keep-alive requests, or
  still sending its request head) is closed `header_timeout` seconds after it became so. Bytes arriving do not
  restart that clock, so a head trickled a byte at a time is closed as surely as a silent socket. (uvicorn's own
  keep-alive timer starts only after a first response, and restarts on every byte.)
- The send stall. A connection whose writes stay paused for `send_timeout` seconds (60, nginx's send_timeout; its
  client reads none of its response: the kernel's buffers and the transport's are full) is reset, its buffered
  bytes dropped. Neither the request timeout (the wait for the engine) nor the header timeout covers a response
  being written, and a stream's connection is busy, so a client that stopped reading held its connection and the
  bytes behind it for ever.
- The body pace. A request whose body is still arriving is closed `body_deadline` seconds after its head arrived,
  that deadline moved a second later for every `min_body_rate` bytes of body that came (Apache's mod_reqtimeout
  body=...,MinRate=...): a body trickled a byte at a time, or at a few hundred bytes a second, gives its slot back
  in seconds, not after --body-timeout, while an upload at any real link's rate only moves its deadline on.
- The connection bound. At most `max_connections` are open. A newcomer past the bound closes the connection that
  has been idle longest, so idle sockets cannot hold a slot a request needs (nginx reuses idle keep-alive
  connections the same way); only when every connection is busy with a request is the newcomer answered 503
  (`Connection: close`) once its head arrives, and past REFUSING such refusals waiting it is closed at once.
- The client bound. At most `max_client_connections` are open from one client address, so one client cannot take
  every slot: its newcomer past that bound closes its own connection idle longest, else is answered 503 like a
  newcomer past the connection bound. A connection from a `trusted_proxies` address counts against the client its
  request's X-Forwarded-For names (the nearest address that is not a trusted proxy), request by request, and not
  at all while idle; the header is never read from anyone else.
- Health answered. A refused connection's GET /health or /ready is served (then closed): a liveness probe does not
  restart a server for being busy.
- The default bound, from the descriptor limit (RLIMIT_NOFILE) less a reserve (an eighth of it, at least
  FD_RESERVE) for model and adapter files, replica pipes and logs: connections cannot take the descriptors the
  process itself needs. A burst of new connections larger than the free descriptors is accepted up to the limit
  and then meets the event loop's own handling (asyncio stops accepting for a second, uvloop closes what is
  pending); the evictions that follow free descriptors at once, so clients that retry get in.

Request bodies are bounded in the app (bodies.py, --body-timeout), where a refusal can be a JSON answer; the body
pace here only takes back the slot of a body too slow to be worth an answer.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import json
import socket
from typing import Any

from ..api.config import Network, parse_networks

DEFAULT_MAX_CONNECTIONS = 1000
FD_RESERVE = 64   # descriptors kept from connections at least: model and adapter files, replica pipes, logs
SEND_TIMEOUT_S = 60.0  # a connection whose writes stay paused this long (its client reads nothing) is reset
REFUSING = 32     # of those: newcomers past a bound of busy connections, waiting for their head to be answered 503
HEALTH_PATHS = ("/health", "/ready")  # served on a refused connection too


def listen(host: str, port: int) -> list[socket.socket]:
    """The listening sockets of --host and --port (one per address the host names), bound before anything loads,
    so that a port in use is one line at once, not a traceback after the model loaded. Raises ValueError naming
    the fix."""
    where = f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"cannot listen on host {host!r} ({e.strerror}); give --host 127.0.0.1, 0.0.0.0 or "
                         "an address of this machine") from None
    sockets: list[socket.socket] = []
    try:
        for af, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(af, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if af == socket.AF_INET6:  # as asyncio does: an IPv6 socket takes IPv6 only
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(2048)
            sock.setblocking(False)
    except OSError as e:
        for sock in sockets:
            sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port} on {host} is already in use (another diffgraph serve?); "
                             "stop that server, or give another port with --port N") from None
        if e.errno == errno.EACCES:
            raise ValueError(f"no permission to listen on port {port} (ports below 1024 need privileges); "
                             "give --port 8000 or another above 1023") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise ValueError(f"{host} is not an address of this machine; give --host 127.0.0.1 (this "
                             "machine only) or 0.0.0.0 (every interface)") from None
        raise ValueError(f"cannot listen on {where} ({e.strerror}); change --host or --port") from None
    return sockets


def descriptor_limit() -> int | None:
    """The process's soft RLIMIT_NOFILE, or None where there is none (or no `resource` module)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def resolve_max_connections(setting: int | None, nofile: int | None) -> int:
    """The connection bound: `setting` (default DEFAULT_MAX_CONNECTIONS) within `nofile` descriptors less the
    reserve. Raises ValueError naming the fix when a setting does not fit."""
    room = None if nofile is None else nofile - max(FD_RESERVE, nofile // 8)
    if setting is None:
        if room is not None and room < 16:
            raise ValueError(f"this process may open only {nofile} file descriptors (ulimit -n); raise the limit to "
                             f"at least {FD_RESERVE + 16}")
        return DEFAULT_MAX_CONNECTIONS if room is None else min(DEFAULT_MAX_CONNECTIONS, room)
    if room is not None and setting > room:
        raise ValueError(f"max-connections {setting} needs {nofile - room + setting} file descriptors but this "
                         f"process may open {nofile} (ulimit -n); raise the limit or give --max-connections "
                         f"{max(room, 1)} or fewer")
    return setting


def _is_in(host: str, networks: tuple[Network, ...]) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return any(address in n for n in networks)


def forwarded_client(headers: list[tuple[bytes, bytes]], peer: str, proxies: tuple[Network, ...]) -> str:
    """The client a trusted proxy forwards for: the X-Forwarded-For address nearest this server that is not itself
    a trusted proxy (each proxy appends the address it got the request from; those left of it are the client's
    word), else the leftmost, else `peer` when the header is missing."""
    hops = [hop.strip() for name, value in headers if name.lower() == b"x-forwarded-for"
            for hop in value.decode("latin-1").split(",") if hop.strip()]
    for hop in reversed(hops):
        if not _is_in(hop, proxies):
            return hop
    return hops[0] if hops else peer


class BodyPace:
    """A request body's clock on its connection: closed `deadline` seconds after its head, plus a second for every
    `min_rate` bytes that arrived."""

    def __init__(self, deadline: float, min_rate: float, started: float):
        self.deadline, self.min_rate = deadline, min_rate
        self.started = started  # the event loop's clock
        self.received = 0
        self.timer: asyncio.TimerHandle | None = None

    def due(self) -> float:
        """When the body must have arrived (the event loop's clock), by what has come so far."""
        return self.started + self.deadline + self.received / self.min_rate


def resolve_max_client_connections(setting: int | None, max_connections: int) -> int:
    """The per-client bound: `setting` (default half the connection bound), never above the connection bound."""
    return min(setting, max_connections) if setting is not None else max(1, max_connections // 2)


class ConnectionGuard:
    """The open connections, idle (longest first) or busy with a request, their clients, header and body timers."""

    def __init__(self, max_connections: int, header_timeout: float, send_timeout: float = SEND_TIMEOUT_S, *,
                 max_client_connections: int | None = None, body_deadline: float = 10.0, min_body_rate: float = 0,
                 trusted_proxies: tuple[str, ...] = ()):
        self.max_connections = max_connections
        self.max_client_connections = max_client_connections or max_connections
        self.header_timeout = header_timeout
        self.send_timeout = send_timeout
        self.body_deadline, self.min_body_rate = body_deadline, min_body_rate  # min_body_rate 0: no body pace
        self.proxies = parse_networks(trusted_proxies)
        self.idle: dict[Any, None] = {}  # insertion-ordered: the connection idle longest first
        self.busy: set[Any] = set()
        self.refused: dict[Any, str] = {}  # past a bound (which one: its 503's words), their requests answered 503
        self.client_of: dict[Any, str] = {}  # the client a connection counts against (none: a proxy's idle ones)
        self.clients: dict[str, int] = {}    # connections counted per client
        self.timers: dict[Any, asyncio.TimerHandle] = {}
        self.stalls: dict[Any, asyncio.TimerHandle] = {}  # writes paused: reset when they stay so
        self.bodies: dict[Any, BodyPace] = {}  # requests whose bodies are arriving

    @property
    def open(self) -> int:
        return len(self.idle) + len(self.busy)

    def opened(self, conn: Any) -> str:
        """A new connection: "ok", "refuse" (answer its request 503) or "closed" (closed here, too many waiting)."""
        peer = _peer(conn)
        proxied = _is_in(peer, self.proxies)
        reason = None
        if not proxied and self.clients.get(peer, 0) >= self.max_client_connections:
            own = next((c for c in self.idle if self.client_of.get(c) == peer), None)
            if own is None:
                reason = "client"
            else:
                self._close(own)
        if self.open >= self.max_connections:  # every slot busy: the server's bound is the answer, even at both
            if not self.idle:
                reason = "server"
            elif reason is None:
                self._close(next(iter(self.idle)))
        if reason is not None and len(self.refused) >= REFUSING:
            conn.transport.close()
            return "closed"
        if reason is None:
            self.idle[conn] = None
            if not proxied:
                self._count(conn, peer)
        else:
            self.refused[conn] = reason
        self._arm(conn)
        return "ok" if reason is None else "refuse"

    def update(self, conn: Any, received: int = 0) -> None:
        """After `received` bytes arrived or a response ended: a connection whose request head is complete and whose
        response is not is busy (no header timer; a body timer while its body arrives); otherwise idle, its timer
        running since it became so. A refused connection is closed once its answer is written."""
        cycle = getattr(conn, "cycle", None)  # uvicorn's request-response cycle (httptools and h11 alike)
        busy = cycle is not None and not cycle.response_complete
        if conn in self.refused:
            if busy:
                self._disarm(conn)
            elif cycle is not None:
                self._close(conn)
            return
        if busy:
            self._disarm(conn)
            if conn in self.idle:
                del self.idle[conn]
                if _is_in(_peer(conn), self.proxies) and not self._admit_forwarded(conn, cycle):
                    return
                self.busy.add(conn)
            self._pace(conn, cycle.more_body, received)
        elif conn in self.busy and not conn.transport.is_closing():
            self._pace(conn, False, 0)
            self.busy.discard(conn)
            if _is_in(_peer(conn), self.proxies):
                self._uncount(conn)
            self.idle[conn] = None  # now the newest idle connection
            self._arm(conn)

    def _admit_forwarded(self, conn: Any, cycle: Any) -> bool:
        """A trusted proxy's request: counted against the client it forwards for, or refused past that bound."""
        client = forwarded_client(cycle.scope.get("headers", []), _peer(conn), self.proxies)
        if self.clients.get(client, 0) >= self.max_client_connections:
            self.refused[conn] = "client"
            return False
        self._count(conn, client)
        return True

    def _pace(self, conn: Any, arriving: bool, received: int) -> None:
        """The body clock of a busy connection: started with its head, fed what arrives, stopped with its body."""
        pace = self.bodies.get(conn)
        if not arriving or not self.min_body_rate:
            if pace is not None and pace.timer is not None:
                pace.timer.cancel()
            self.bodies.pop(conn, None)
        elif pace is None:  # what came with the head is not counted: an honest body is usually complete in it
            loop = asyncio.get_running_loop()
            pace = self.bodies[conn] = BodyPace(self.body_deadline, self.min_body_rate, loop.time())
            pace.timer = loop.call_at(pace.due(), self._body_due, conn)
        else:
            pace.received += received

    def _body_due(self, conn: Any) -> None:
        pace = self.bodies.get(conn)
        if pace is None:
            return
        loop = asyncio.get_running_loop()
        if loop.time() + 0.01 >= pace.due():  # a timer may fire a clock tick early
            self._reset(conn)
        else:  # bytes came since it was set: its deadline moved on
            pace.timer = loop.call_at(pace.due(), self._body_due, conn)

    def write_paused(self, conn: Any) -> None:
        """The connection's send buffers are full: reset it unless its client reads within `send_timeout`."""
        self.write_resumed(conn)
        self.stalls[conn] = asyncio.get_running_loop().call_later(self.send_timeout, self._reset, conn)

    def write_resumed(self, conn: Any) -> None:
        timer = self.stalls.pop(conn, None)
        if timer is not None:
            timer.cancel()

    def closed(self, conn: Any) -> None:
        self._disarm(conn)
        self.write_resumed(conn)
        self._pace(conn, False, 0)
        self._uncount(conn)
        self.idle.pop(conn, None)
        self.busy.discard(conn)
        self.refused.pop(conn, None)

    def gate(self, conn: Any, app: Any) -> Any:
        """The ASGI app of `conn`'s requests: `app`, or a 503 when the guard refused the connection (its health
        probes still get `app`)."""
        async def gated(scope: Any, receive: Any, send: Any) -> None:
            reason = self.refused.get(conn)
            if reason is None or (scope.get("method") == "GET" and scope.get("path") in HEALTH_PATHS):
                await app(scope, receive, send)
            else:
                await self.refuse(reason, send)
        return gated

    async def refuse(self, reason: str, send: Any) -> None:
        """A refused request's answer: 503 in OpenAI's error shape, then close."""
        if reason == "client":
            message = (f"this client has {self.max_client_connections} connections open, the server's "
                       "--max-client-connections; reuse them (keep-alive) or retry shortly")
            code = "too_many_client_connections"
        else:
            message = f"the server has {self.max_connections} connections busy, its --max-connections; retry shortly"
            code = "too_many_connections"
        body = json.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                     "code": code}}).encode()
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"retry-after", b"1"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    def _count(self, conn: Any, client: str) -> None:
        self.client_of[conn] = client
        self.clients[client] = self.clients.get(client, 0) + 1

    def _uncount(self, conn: Any) -> None:
        client = self.client_of.pop(conn, None)
        if client is not None:
            left = self.clients[client] - 1
            if left:
                self.clients[client] = left
            else:
                del self.clients[client]

    def _close(self, conn: Any) -> None:
        self.closed(conn)  # its slot is free now; uvicorn's connection_lost follows
        if not conn.transport.is_closing():
            conn.transport.close()

    def _reset(self, conn: Any) -> None:
        self.closed(conn)
        conn.transport.abort()  # not close(): that waits to write the buffered bytes its client never reads

    def _arm(self, conn: Any) -> None:
        self._disarm(conn)
        self.timers[conn] = asyncio.get_running_loop().call_later(self.header_timeout, self._close, conn)

    def _disarm(self, conn: Any) -> None:
        timer = self.timers.pop(conn, None)
        if timer is not None:
            timer.cancel()


def _peer(conn: Any) -> str:
    """The address a connection comes from (uvicorn's `client`: (host, port), None on a Unix socket)."""
    client = getattr(conn, "client", None)
    return client[0] if client else ""


def guarded_protocol(guard: ConnectionGuard) -> type:
    """uvicorn's HTTP protocol class, its connections watched by `guard`."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class GuardedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.app = guard.gate(self, self.app)  # the app its requests get (uvicorn reads self.app per request)
            guard.opened(self)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            guard.update(self, len(data))

        def pause_writing(self) -> None:
            super().pause_writing()
            guard.write_paused(self)

        def resume_writing(self) -> None:
            super().resume_writing()
            guard.write_resumed(self)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            guard.update(self)

        def connection_lost(self, exc: Exception | None) -> None:
            guard.closed(self)
            super().connection_lost(exc)

    return GuardedHTTPProtocol
