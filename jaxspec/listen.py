"""The server's socket, taken before the model loads: a port that is in use is reported at once, not after a
minute of loading and compiling, and while the model loads every request is answered 503 (a health check sees a
server that is starting, not a port that refuses or hangs). `jaxspec serve` then hands the socket to uvicorn."""
from __future__ import annotations

import errno
import json
import socket
import threading

LOADING_BODY = json.dumps({"error": {"message": "the model is loading; retry shortly", "type": "ServiceUnavailable",
                                     "code": 503}}).encode()
HEAD_LIMIT = 64 << 10     # bytes of a request's head read before answering
CLIENT_TIMEOUT_S = 1.0    # a client that sends nothing is not waited for longer (one is answered at a time)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port and listening. An OSError says which address could not be taken and why."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise OSError(f"--host {host!r} is not an address this machine has ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    # Restarts may bind while the previous server's connections sit in TIME_WAIT; a listening socket still
    # excludes every other (Linux allows two non-listening sockets with SO_REUSEADDR on one port, hence listen now).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        hint = ("; another process is listening there: stop it or give another --port" if e.errno == errno.EADDRINUSE
                else "")
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}{hint}") from None
    return sock


class LoadingResponder:
    """Answers every request on `sock` with 503 (JSON body, Retry-After) on a thread of its own, until `stop`:
    then the socket is free for the real server, and connections not yet accepted wait in its backlog."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="jaxspec-loading", daemon=True)

    def __enter__(self) -> "LoadingResponder":
        self.sock.settimeout(0.1)   # accept() wakes up to see `stop`
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stopping.set()
        self._thread.join()
        self.sock.settimeout(None)

    def _serve(self):
        while not self._stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:   # the socket was closed under us
                return
            with conn:
                self._answer(conn)

    @staticmethod
    def _answer(conn: socket.socket):
        """Reads the request's head, answers it, then reads what the client still sends until it closes: a socket
        closed with unread bytes resets the connection, and the client would see an error instead of the 503."""
        conn.settimeout(CLIENT_TIMEOUT_S)
        head = b""
        try:
            while b"\r\n\r\n" not in head and len(head) < HEAD_LIMIT:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                head += chunk
            body = b"" if head.startswith(b"HEAD ") else LOADING_BODY
            conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                         b"Retry-After: 5\r\nConnection: close\r\n" +
                         f"Content-Length: {len(LOADING_BODY)}\r\n\r\n".encode() + body)
            conn.shutdown(socket.SHUT_WR)
            unread = HEAD_LIMIT
            while unread > 0 and (chunk := conn.recv(4096)):
                unread -= len(chunk)
        except OSError:
            pass
