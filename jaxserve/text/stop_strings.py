"""Stop strings over streamed text: the output is cut before the first stop string, and no part of one ever leaks.

Text that could still turn out to be the start of a stop string is held back until the next piece decides it.
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: tuple[str, ...], include_stop: bool = False):
        """`include_stop` (vLLM's include_stop_str_in_output): the output ends after the stop string, not before."""
        self.stops = stops
        self.include_stop = include_stop
        self._held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """(text safe to emit now, the stop string matched or None). After a match, nothing more is emitted."""
        if not self.stops:
            return text, None
        buffer = self._held + text
        found = [(buffer.find(s), s) for s in self.stops if s in buffer]
        if found:
            cut, stop = min(found)
            self._held = ""
            return buffer[: cut + len(stop) if self.include_stop else cut], stop
        keep = self._longest_stop_prefix_at_end(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], None

    def flush(self) -> str:
        """At the end of the output: what was held back was not a stop string after all."""
        held, self._held = self._held, ""
        return held

    def _longest_stop_prefix_at_end(self, buffer: str) -> int:
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:n]):
                    longest = n
                    break
        return longest
