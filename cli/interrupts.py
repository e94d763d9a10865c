"""Ctrl-C and SIGTERM for `jaxserve serve`, answered at once whatever the main thread is doing.

Python runs signal handlers on the main thread between two bytecodes, so while the main thread is inside one XLA
compile (seconds to minutes per step shape) a handler waits for it, and a second Ctrl-C would too. The C-level
handler, though, writes each signal's number to the wakeup fd at once; a watcher thread reads it and answers:

- The first signal during start-up: one line; start-up then stops once the step shape being compiled is done: the
  main thread checks `requested` after loading and between compiles and raises Interrupted itself (a handler that
  raised would do so wherever the main thread happens to be, a garbage-collector callback of XLA's included, which
  swallows it). Start-up's compiles run on the main thread, so nothing is left inside XLA when it unwinds (and the CLI
  skips the interpreter's teardown, which can crash in jaxlib after an abandoned compile).
- The first signal once serving: `requested` is set; the caller drains and stops.
- A second signal: one line, and the process ends at once (os._exit, so no interpreter teardown waits for a
  compile or a drain, or can crash under one).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)
FORCED_EXIT_STATUS = 1


class Interrupted(BaseException):
    """Start-up was interrupted (a BaseException, like KeyboardInterrupt: no `except Exception` may swallow it)."""


class Interrupts:
    """A context manager that owns SIGINT and SIGTERM while it is open (on the main thread)."""

    def __init__(self):
        self.requested = threading.Event()  # a first signal came
        self.serving = False  # set by the caller once ready: from then on a first signal asks for a drain
        self._count = 0

    def __enter__(self) -> Interrupts:
        read_end, self._write_end = os.pipe()
        os.set_blocking(self._write_end, False)  # the C handler must never block
        self._previous_fd = signal.set_wakeup_fd(self._write_end, warn_on_full_buffer=False)
        self._previous = {signum: signal.signal(signum, self._on_main_thread) for signum in SIGNALS}
        self._watcher = threading.Thread(target=self._watch, args=(read_end,), name="jaxserve-signals", daemon=True)
        self._watcher.start()
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._write_end)  # the watcher reads end-of-file and returns
        self._watcher.join()

    def _on_main_thread(self, signum: int, frame) -> None:
        """Python's own handler does nothing: the watcher answers (Python's default would raise KeyboardInterrupt
        wherever the main thread is)."""

    def check(self) -> None:
        """Raise Interrupted if a signal came during start-up (call it at points where stopping is clean)."""
        if self.requested.is_set() and not self.serving:
            raise Interrupted("start-up interrupted")

    def _watch(self, read_end: int) -> None:
        with os.fdopen(read_end, "rb", buffering=0) as signals:
            while data := signals.read(64):
                for signum in data:
                    if signum in SIGNALS:
                        self._answer(signal.Signals(signum).name)

    def _answer(self, name: str) -> None:
        self._count += 1
        if self._count > 1:
            sys.stdout.flush()
            print(
                f"jaxserve: second {name}: quitting now, without waiting for running work", file=sys.stderr, flush=True
            )
            os._exit(FORCED_EXIT_STATUS)
        self.requested.set()
        if not self.serving:
            print(
                f"jaxserve: {name} during start-up: stopping once the step shape being compiled (if any) is done; "
                "press Ctrl-C again to quit at once",
                file=sys.stderr,
                flush=True,
            )
