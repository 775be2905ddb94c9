"""A TCP proxy on loopback that can refuse and cut connections on demand: a database or a Redis
that goes away and comes back, for drills (``manage.py drill_outages``). Threads, no dependencies."""

from __future__ import annotations

import socket
import threading


class Proxy:
    def __init__(self, target_host: str, target_port: int):
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._refusing = threading.Event()
        self._closed = threading.Event()
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="drill-proxy", daemon=True).start()

    def refuse(self) -> None:
        """From now on every connection is cut: open ones at once, new ones as soon as they arrive."""
        self._refusing.set()
        with self._lock:
            for sock in list(self._open):
                _close(sock)
            self._open.clear()

    def restore(self) -> None:
        self._refusing.clear()

    def close(self) -> None:
        self._closed.set()
        self.refuse()
        _close(self._listener)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._refusing.is_set():
                _close(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._open.update((client, upstream))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                _close(sock)
                with self._lock:
                    self._open.discard(sock)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
