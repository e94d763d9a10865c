"""The text layer over one request's token events (jaxserve.text.generation): an event may carry several tokens (a
verify step's accepted drafts and its sampled token), and a stop string inside such a run ends the output at the
token that completes it, as if the tokens had come one an event."""

from __future__ import annotations

import asyncio

from jaxserve.checkpoints import default_checkpoint_path
from jaxserve.engine import RequestHandle, TokenEvent
from jaxserve.request import FinishReason, SamplingParams
from jaxserve.text.generation import Generation
from jaxserve.text.tokenizer import load_tokenizer

TOKENIZER = load_tokenizer(default_checkpoint_path())


class OneRequestEngine:
    """What Generation asks of the engine: submit() hands back a handle the test feeds, abort() is recorded."""

    def __init__(self) -> None:
        self.handle: RequestHandle | None = None
        self.aborted: list[tuple[str, FinishReason, str | None]] = []

    def submit(self, prompt_ids, sampling, request_id, priority, remote) -> RequestHandle:
        self.handle = RequestHandle(request_id, prompt_ids)
        return self.handle

    def abort(self, request_id: str, reason: FinishReason, stop_reason: str | None = None) -> None:
        self.aborted.append((request_id, reason, stop_reason))


def _deltas(events: list[TokenEvent], stop: tuple[str, ...], sampling: SamplingParams) -> tuple[list, list]:
    async def run():
        engine = OneRequestEngine()
        generation = Generation(engine, TOKENIZER, [5, 6], sampling, stop, "r")  # type: ignore[arg-type]
        assert engine.handle is not None
        for event in events:
            engine.handle._push(event)
        return [delta async for delta in generation.deltas()], engine.aborted

    return asyncio.run(run())


def test_a_stop_string_inside_a_run_of_tokens_cuts_the_run_at_the_token_that_completes_it():
    ids = TOKENIZER.encode("def main(argv):\n    return parse(argv)\n")
    stop = "return"
    # The first token whose text completes the stop string, found by decoding growing prefixes.
    end = next(j for j in range(len(ids)) if stop in TOKENIZER.decode(ids[: j + 1]))
    assert 2 <= end < len(ids) - 2  # inside the run, with tokens after it
    sampling = SamplingParams(max_tokens=100)
    deltas, aborted = _deltas([TokenEvent((ids[0],)), TokenEvent(tuple(ids[1:]))], (stop,), sampling)
    assert [d.token_ids for d in deltas] == [(ids[0],), tuple(ids[1 : end + 1])]
    assert "".join(d.text for d in deltas) == TOKENIZER.decode(ids[: end + 1]).split(stop)[0]
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason, deltas[-1].num_generated) == ("stop", stop, end + 1)
    assert aborted == [("r", FinishReason.STOP, stop)]  # the engine request ends where the text did


def test_a_run_of_tokens_without_a_stop_is_one_delta_with_all_its_text():
    ids = TOKENIZER.encode("x = [1, 2, 3]\n")
    events = [TokenEvent((ids[0],)), TokenEvent(tuple(ids[1:]), finish_reason=FinishReason.LENGTH)]
    deltas, aborted = _deltas(events, ("never there",), SamplingParams(max_tokens=len(ids)))
    assert [d.token_ids for d in deltas] == [(ids[0],), tuple(ids[1:])]
    assert "".join(d.text for d in deltas) == TOKENIZER.decode(ids)
    assert (deltas[-1].finish_reason, deltas[-1].num_generated) == ("length", len(ids)) and aborted == []
