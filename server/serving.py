"""uvicorn on a socket bound before anything slow starts, serving from its own thread.

Binding first makes a taken port an immediate, one-line error instead of one found after the weights are loaded
and compiled. Serving from a thread leaves the main thread to the caller, with the signals and start-up's XLA
compiles: the caller decides when to drain and stop (see the CLI's `serve`, which compiles the other step shapes on
a thread of their own once ready and ends the process without the interpreter's teardown).
"""

from __future__ import annotations

import socket
import threading

import uvicorn

GRACE_SECONDS = 5  # after the drain: for finished streams to flush and connections to close


class ListenError(OSError):
    """The address cannot be listened on (in use, not ours, not an address)."""


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (port 0: any free one). Listening starts when the server does, so a client
    that comes earlier is refused at once rather than left waiting behind a start-up of unknown length."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: only TIME_WAIT may be reused
    try:
        sock.bind((host, port))
    except (OSError, OverflowError) as error:
        sock.close()
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise ListenError(f"cannot listen on {host}:{port}: {reason}") from None
    return sock


class BackgroundServer:
    def __init__(self, app, sock: socket.socket):
        # log_config=None: uvicorn's loggers go through the process's logging set-up; at "warning" its start-up
        # chatter is left out (the caller announces listening and ready itself) but its errors are not.
        config = uvicorn.Config(
            app, log_config=None, log_level="warning", access_log=False, timeout_graceful_shutdown=GRACE_SECONDS
        )
        self._server = uvicorn.Server(config)
        self._socket = sock
        self.stopped = threading.Event()  # set when serving ends, for whatever reason
        self._thread = threading.Thread(target=self._serve, name="jaxserve-http", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        return self._socket.getsockname()[:2]

    def start(self) -> None:
        """Serve, returning once connections are accepted; raises if the server ended instead."""
        self._thread.start()
        while not self._server.started and not self.stopped.wait(0.01):
            pass
        if not self._server.started:
            raise ListenError(f"the HTTP server on {self.address[0]}:{self.address[1]} stopped while starting")

    def stop(self) -> None:
        """Stop accepting, let open connections finish for up to GRACE_SECONDS, and wait for the thread."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join()
        self._socket.close()

    def _serve(self) -> None:
        try:
            self._server.run(sockets=[self._socket])
        finally:
            self.stopped.set()
