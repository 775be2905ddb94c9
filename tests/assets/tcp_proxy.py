"""A TCP proxy on loopback that a test can cut and restore: a database (or any server) that goes away
and comes back, for the process under test, while the test itself still reaches the server directly.

``TcpProxy(upstream_port)`` listens on a free loopback port and pipes every connection to
``127.0.0.1:upstream_port``. ``refuse()`` closes the listening socket (a new connection is refused,
as by a server that is down) and cuts every open connection; ``restore()`` listens on the same port
again. Threads, stdlib only; ``close()`` ends everything.
"""

from __future__ import annotations

import socket
import threading

from tests.assets.llama_server import free_port

CHUNK = 65536


class TcpProxy:
    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1"):
        self.upstream = (upstream_host, upstream_port)
        self.host = "127.0.0.1"
        self.port = free_port()
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.accepted = 0  # connections piped so far (a test can see the process under test reconnect)
        self.restore()

    # -- what a test calls ---------------------------------------------------------------------

    def refuse(self) -> None:
        """From now on connections are refused, and the open ones are cut."""
        with self._lock:
            listener, self._listener = self._listener, None
            connections, self._connections = self._connections, set()
        if listener is not None:
            _close(listener)
        for sock in connections:
            _close(sock)

    def restore(self) -> None:
        """Accept and pipe connections again, on the same port."""
        with self._lock:
            if self._listener is not None:
                return
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.host, self.port))
            listener.listen(128)
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True, name="tcp-proxy-accept").start()

    def close(self) -> None:
        self.refuse()

    @property
    def refusing(self) -> bool:
        return self._listener is None

    # -- the pipes -----------------------------------------------------------------------------

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # refuse() closed the listener
            try:
                server = socket.create_connection(self.upstream, timeout=10)
                server.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                if self._listener is not listener:  # refused meanwhile: this one is cut too
                    _close(client)
                    _close(server)
                    return
                self._connections |= {client, server}
                self.accepted += 1
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True, name="tcp-proxy-pipe").start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while True:
                data = source.recv(CHUNK)
                if not data:
                    break
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._connections.discard(source)
                self._connections.discard(sink)
            _close(source)
            _close(sink)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass
