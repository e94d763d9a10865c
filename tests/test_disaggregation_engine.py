"""Disaggregated serving through the real engines and schedulers over the fake runner (tests/fake_runner.py): a prefill
engine hands each prompt's sequence off after its first token, a decode engine admits remote requests against its own
prefix cache and decodes what arrives. Tokens are the model's own, the pages a decode engine holds do not travel
again, and a request whose state does not come, or that is aborted while it comes, gives every page back."""

from __future__ import annotations

import threading
import time

from fake_runner import FakeRunner, continuation
from test_engine import CFG, assert_nothing_leaked, engine_config, greedy, prompt

from jaxserve.config import EngineConfig
from jaxserve.engine import Engine
from jaxserve.engine.handoff import Arrival, PrefillAsk
from jaxserve.model.cache import kv_geometry
from jaxserve.request import FinishReason, SamplingParams
from jaxserve.runner import Buckets

EOS = (1,)
PAGE = 8  # engine_config's page size


def fake_engine(mode: str) -> Engine:
    cfg: EngineConfig = engine_config(disaggregation_mode=mode, mixed_batches=False)
    runner = FakeRunner(kv_geometry(cfg, CFG), Buckets.for_config(cfg), CFG.vocab_size)
    return Engine(cfg, CFG, runner, EOS)


class LocalPrefill:
    """A StateSource over a prefill engine in this process: the engine side of a prefill server, no transport."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.asks: list[PrefillAsk] = []

    def fetch(self, ask: PrefillAsk) -> Arrival:
        self.asks.append(ask)
        handle = self.engine.submit(
            ask.prompt_ids, ask.sampling, request_id=f"prefill-{ask.request_id}", hand_off_from=ask.skip_pages
        )
        last = list(handle.sync_events(timeout=30))[-1]
        if last.error is not None:
            raise RuntimeError(last.error)
        first = last.token_ids[0] if last.token_ids else None
        return Arrival(first, last.logprobs[0] if last.logprobs else None, last.prompt_logprobs, last.parcel)

    def cancel(self, ask: PrefillAsk) -> None:
        self.engine.abort(f"prefill-{ask.request_id}")


class Pair:
    def __init__(self):
        self.prefill, self.decode = fake_engine("prefill"), fake_engine("decode")
        self.source = LocalPrefill(self.prefill)

    def __enter__(self) -> Pair:
        self.prefill.start()
        self.decode.start()
        return self

    def __exit__(self, *exc) -> None:
        self.decode.shutdown()
        self.prefill.shutdown()

    def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str):
        return self.decode.submit(prompt_ids, sampling, request_id=request_id, remote=self.source).wait(timeout=30)


def test_remote_requests_generate_the_models_tokens_and_give_every_page_back():
    prompts = [prompt(n, seed) for seed, n in enumerate((5, 37, 64, 90))]
    with Pair() as pair:
        finished = [pair.generate(p, greedy(9), f"r{i}") for i, p in enumerate(prompts)]
    for p, (tokens, reason, error) in zip(prompts, finished):
        assert (tokens, reason, error) == (continuation(p, 9, CFG.vocab_size), FinishReason.LENGTH, None)
    assert_nothing_leaked(pair.decode)
    assert_nothing_leaked(pair.prefill)
    prefill_runner = pair.prefill.runner
    assert isinstance(prefill_runner, FakeRunner)
    assert all(not step.decode for step in prefill_runner.steps)  # a handed-off request never decodes there
    decode_runner = pair.decode.runner
    assert isinstance(decode_runner, FakeRunner)
    assert all(not step.prefill for step in decode_runner.steps)  # nor prefills here
    # Each arrival filled every page of its prompt: nothing was cached here yet.
    assert [len(pages) for _, pages, _ in decode_runner.installed] == [-(-len(p) // PAGE) for p in prompts]


def test_a_decode_engine_reuses_the_pages_it_holds_without_a_snapshot():
    first = prompt(45, 1)
    second = first[:33] + prompt(20, 2)  # four whole pages in common, then its own
    with Pair() as pair:
        pair.generate(first, greedy(4), "first")
        tokens, _, _ = pair.generate(second, greedy(4), "second")
    assert tokens == continuation(second, 4, CFG.vocab_size)
    assert [ask.skip_pages for ask in pair.source.asks] == [0, 4]
    decode_runner = pair.decode.runner
    assert isinstance(decode_runner, FakeRunner)
    assert len(decode_runner.installed[-1][1]) == -(-len(second) // PAGE) - 4  # only the missing pages travelled
    assert pair.decode.stats().prefix_cache.hits == 4 * PAGE
    assert_nothing_leaked(pair.decode)


class Failing:
    def __init__(self):
        self.release = threading.Event()
        self.cancelled: list[str] = []

    def fetch(self, ask: PrefillAsk) -> Arrival:
        self.release.wait(30)
        raise ConnectionError("prefill server http://nowhere: connection refused")

    def cancel(self, ask: PrefillAsk) -> None:
        self.cancelled.append(ask.request_id)


def test_a_state_that_does_not_come_fails_its_request_and_frees_its_pages():
    engine = fake_engine("decode")
    source = Failing()
    source.release.set()
    engine.start()
    try:
        handle = engine.submit(prompt(30, 3), greedy(5), request_id="lost", remote=source)
        tokens, reason, error = handle.wait(timeout=30)
    finally:
        engine.shutdown()
    assert (tokens, reason) == ([], FinishReason.ERROR)
    assert error == "prefill failed: prefill server http://nowhere: connection refused"
    assert_nothing_leaked(engine)


def test_a_request_aborted_while_its_state_comes_gives_its_pages_back_at_once():
    engine = fake_engine("decode")
    source = Failing()
    engine.start()
    try:
        handle = engine.submit(prompt(30, 4), greedy(5), request_id="gone", remote=source)
        while engine.stats().running == 0:  # admitted: pages reserved, its state asked for
            threading.Event().wait(0.01)
        assert engine.stats().free_pages < engine.pages.pages.size
        engine.abort("gone")
        tokens, reason, _ = handle.wait(timeout=30)
        assert (tokens, reason) == ([], FinishReason.ABORT)
        assert_nothing_leaked(engine)
        deadline = time.monotonic() + 10
        while not source.cancelled:  # the source is told to stop making it
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert source.cancelled == ["gone"]
        source.release.set()  # what comes (here an error) now finds the request gone: nothing happens
        threading.Event().wait(0.2)
        assert_nothing_leaked(engine)
        assert engine.stats().finished == {FinishReason.ABORT: 1}
    finally:
        engine.shutdown()


def test_the_first_token_runs_the_decode_servers_stop_checks_and_prompt_logprobs_travel():
    p = prompt(21, 5)
    first = continuation(p, 1, CFG.vocab_size)[0]
    with Pair() as pair:
        stopped = pair.generate(p, greedy(6, stop_token_ids=[first]), "stops")
        handle = pair.decode.submit(
            p, SamplingParams(max_tokens=0, prompt_logprobs=1), request_id="echo", remote=pair.source
        )
        events = list(handle.sync_events(timeout=30))
    assert stopped == ([first], FinishReason.STOP, None)
    assert events[-1].finish_reason is FinishReason.LENGTH and not events[-1].token_ids
    assert [lp.token_id for lp in events[-1].prompt_logprobs] == p[1:]
    assert_nothing_leaked(pair.decode)


def test_a_remote_request_aborted_before_admission_leaves_nothing_behind():
    engine = fake_engine("decode")
    source = Failing()
    engine.start()
    try:
        # max_num_seqs is 4: the fifth waits for a slot, and goes before it is admitted
        handles = [engine.submit(prompt(30, i), greedy(5), request_id=f"r{i}", remote=source) for i in range(5)]
        while engine.stats().running < 4:
            threading.Event().wait(0.01)
        assert engine.stats().waiting == 1
        for i in range(5):
            engine.abort(f"r{i}")
        assert [h.wait(timeout=30)[1] for h in handles] == [FinishReason.ABORT] * 5
        assert_nothing_leaked(engine)
        assert not engine._sources  # noqa: SLF001 - the waiting one's source is not kept
    finally:
        source.release.set()
        engine.shutdown()


class Recorded(LocalPrefill):
    """LocalPrefill, saying when it was asked and when told to stop."""

    def __init__(self, engine: Engine):
        super().__init__(engine)
        self.asked, self.cancelled = threading.Event(), threading.Event()

    def fetch(self, ask: PrefillAsk) -> Arrival:
        self.asked.set()
        return super().fetch(ask)

    def cancel(self, ask: PrefillAsk) -> None:
        super().cancel(ask)
        self.cancelled.set()


def test_a_decode_request_that_ends_while_its_prompt_is_prefilled_aborts_the_prefill():
    prefill, decode = fake_engine("prefill"), fake_engine("decode")
    prefill_runner = prefill.runner
    assert isinstance(prefill_runner, FakeRunner)
    hold = threading.Event()
    prefill_runner.fail = lambda batch: None if hold.wait(30) else None  # a prefill step waits until `hold`
    source = Recorded(prefill)
    prefill.start()
    decode.start()
    try:
        handle = decode.submit(prompt(40, 6), greedy(5), request_id="left", remote=source)  # 3 chunks of 16
        assert source.asked.wait(10)
        decode.abort("left")
        finished = handle.wait(timeout=30)
        assert finished[1] is FinishReason.ABORT, finished
        assert source.cancelled.wait(10)
        hold.set()  # the prefill engine goes on: the abort waits in its inbox, ahead of the prompt's next chunk
        deadline = time.monotonic() + 10
        while prefill.stats().finished.get(FinishReason.ABORT) != 1:
            assert time.monotonic() < deadline, prefill.stats()
            time.sleep(0.01)
    finally:
        hold.set()
        decode.shutdown()
        prefill.shutdown()
    assert prefill.stats().finished == {FinishReason.ABORT: 1}  # it never handed a state off
    assert_nothing_leaked(prefill)
    assert_nothing_leaked(decode)
