"""Connections, bounded below the app: how long one may sit without a request, and how many may be open.

`listen(host, port)` binds the listening sockets before anything loads (a port in use is one line naming --port).
`guarded_protocol(guard)` is uvicorn's HTTP protocol (httptools, else h11: the class uvicorn's "auto" picks) with a
`ConnectionGuard` watching every connection; serve() hands it to uvicorn. The guard owns three rules:

- The header timeout. A connection with no request in progress (just opened, idle between keep-alive requests, or
  still sending its request head) is closed `header_timeout` seconds after it became so. Bytes arriving do not
  restart that clock, so a head trickled a byte at a time is closed as surely as a silent socket. (uvicorn's own
  keep-alive timer starts only after a first response, and restarts on every byte.)
- The send stall. A connection whose writes stay paused for `send_timeout` seconds (60, nginx's send_timeout; its
  client reads none of its response: the kernel's buffers and the transport's are full) is reset, its buffered
  bytes dropped. Neither the request timeout (the wait for the engine) nor the header timeout covers a response
  being written, and a stream's connection is busy, so a client that stopped reading held its connection and the
  bytes behind it for ever.
- The connection bound. At most `max_connections` are open. A newcomer past the bound closes the connection that
  has been idle longest, so idle sockets cannot hold a slot a request needs (nginx reuses idle keep-alive
  connections the same way); only when every connection is busy with a request is the newcomer answered 503
  (`Connection: close`) once its head arrives, and past REFUSING such refusals waiting it is closed at once.
- The default bound, from the descriptor limit (RLIMIT_NOFILE) less a reserve (an eighth of it, at least
  FD_RESERVE) for model and adapter files, replica pipes and logs: connections cannot take the descriptors the
  process itself needs. A burst of new connections larger than the free descriptors is accepted up to the limit
  and then meets the event loop's own handling (asyncio stops accepting for a second, uvloop closes what is
  pending); the evictions that follow free descriptors at once, so clients that retry get in.

Request bodies are bounded in the app (bodies.py, --body-timeout), where a refusal can be a JSON answer.
"""

from __future__ import annotations

import asyncio
import errno
import json
import socket
from typing import Any

DEFAULT_MAX_CONNECTIONS = 1000
FD_RESERVE = 64   # descriptors kept from connections at least: model and adapter files, replica pipes, logs
SEND_TIMEOUT_S = 60.0  # a connection whose writes stay paused this long (its client reads nothing) is reset
REFUSING = 32     # of those: newcomers past a bound of busy connections, waiting for their head to be answered 503


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


class ConnectionGuard:
    """The open connections, idle (longest first) or busy with a request, and their header timers."""

    def __init__(self, max_connections: int, header_timeout: float, send_timeout: float = SEND_TIMEOUT_S):
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.send_timeout = send_timeout
        self.idle: dict[Any, None] = {}  # insertion-ordered: the connection idle longest first
        self.busy: set[Any] = set()
        self.refused: set[Any] = set()   # past the bound while every connection was busy: answered 503
        self.timers: dict[Any, asyncio.TimerHandle] = {}
        self.stalls: dict[Any, asyncio.TimerHandle] = {}  # writes paused: reset when they stay so

    @property
    def open(self) -> int:
        return len(self.idle) + len(self.busy)

    def opened(self, conn: Any) -> str:
        """A new connection: "ok", "refuse" (answer its request 503) or "closed" (closed here, too many waiting)."""
        verdict = "ok"
        if self.open >= self.max_connections:
            if self.idle:
                oldest = next(iter(self.idle))
                self._close(oldest)
            elif len(self.refused) >= REFUSING:
                conn.transport.close()
                return "closed"
            else:
                verdict = "refuse"
        if verdict == "ok":
            self.idle[conn] = None
        else:
            self.refused.add(conn)
        self._arm(conn)
        return verdict

    def update(self, conn: Any) -> None:
        """After bytes arrived or a response ended: a connection whose request head is complete and whose response
        is not is busy (no timer); otherwise idle, its timer running since it became so."""
        cycle = getattr(conn, "cycle", None)  # uvicorn's request-response cycle (httptools and h11 alike)
        busy = cycle is not None and not cycle.response_complete
        if busy:
            self._disarm(conn)
            if conn in self.idle:
                del self.idle[conn]
                self.busy.add(conn)
        elif conn in self.busy and not conn.transport.is_closing():
            self.busy.discard(conn)
            self.idle[conn] = None  # now the newest idle connection
            self._arm(conn)

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
        self.idle.pop(conn, None)
        self.busy.discard(conn)
        self.refused.discard(conn)

    async def refuse(self, scope: Any, receive: Any, send: Any) -> None:
        """The ASGI app a refused connection's request gets: 503 in OpenAI's error shape, then close."""
        body = json.dumps({"error": {
            "message": f"the server has {self.max_connections} connections busy, its --max-connections; retry shortly",
            "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"retry-after", b"1"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

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


def guarded_protocol(guard: ConnectionGuard) -> type:
    """uvicorn's HTTP protocol class, its connections watched by `guard`."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class GuardedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if guard.opened(self) == "refuse":
                self.app = guard.refuse  # the app its request gets (uvicorn reads self.app per request)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            guard.update(self)

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
