"""Graceful shutdown: on SIGTERM (or Ctrl-C) stop admitting, answer 503 on /health, let running requests finish
within the shutdown timeout, then stop uvicorn and exit 0.

Uvicorn alone would close the listening socket at once (so /health could not say 503) and re-raise the signal
after its shutdown (so the exit status would be the signal's, not 0). A second signal forces the exit.
"""

from __future__ import annotations

import logging
import signal
import threading

import uvicorn

from jaxserve.engine import Engine

log = logging.getLogger("jaxserve.server")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: Engine, shutdown_timeout: float):
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self._drainer: threading.Thread | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if sig in (signal.SIGTERM, signal.SIGINT) and self._drainer is None:
            self._drainer = threading.Thread(target=self._drain_then_exit, name="jaxserve-drain", daemon=True)
            self._drainer.start()
            return
        super().handle_exit(sig, frame)

    def _drain_then_exit(self) -> None:
        log.info("shutdown requested: draining, running requests get up to %.0f s to finish", self.shutdown_timeout)
        aborted = self.engine.drain(self.shutdown_timeout)
        if aborted:
            log.warning("shutdown timeout reached: aborted %d unfinished requests", aborted)
        self.should_exit = True
