"""Servers for the tests: a uvicorn server (v4jax's or the router's) on a free port of 127.0.0.1 in a daemon thread."""
import socket
import threading
import time

from v4jax.serve.app import Server


def free_socket() -> socket.socket:
    """A socket bound to a free port of 127.0.0.1."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


def serve(server, sock: socket.socket | None = None) -> tuple[threading.Thread, int]:
    """Run a uvicorn server on `sock` (default: a free port) in a daemon thread; returns once it has started:
    (thread, port)."""
    sock = sock or free_socket()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    return thread, sock.getsockname()[1]


def start(state, **server_options) -> tuple[Server, threading.Thread, int]:
    """`state`'s v4jax server (Server(state, **server_options)) started: (server, thread, port)."""
    server = Server(state, **server_options)
    thread, port = serve(server)
    return server, thread, port
