"""A step policy is one registration (docs/architecture.md, "How to add"): a StepPolicy class registered with
`register_step_policy` gets its flag on the CLI, its key in EngineConfig.step_policies with the config's type check,
its place in the scheduler, and the decodes it forces carry its name into the step counts, the engine's log, the
periodic stats line and /metrics. Shown with a policy defined here (the registry is restored after each test)."""

from __future__ import annotations

import logging

import pytest
from test_engine import CHUNK, fake_engine, greedy, prompt, run

from jaxserve.cli.main import engine_config, parse
from jaxserve.config import STEP_POLICIES, ConfigError, EngineConfig, Flag
from jaxserve.scheduler import MixedSteps, PolicyContext, StepPolicy, register_step_policy, step_policies
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.stats_log import stats_line


class DecodeFirst(StepPolicy):
    """Once `after` prefill steps ran, a decode goes first whenever one is runnable (a toy rule: what matters here is
    where it shows up)."""

    name = "eager"
    option = "decode_first_after"
    flag = Flag(int, "a decode step before any prefill step once N prefill steps ran")
    forced_words = "decoded first"
    metric_help = "Decode steps --decode-first-after asked for."

    def __init__(self, after: int):
        self.after = after
        self.prefill_steps = 0

    @classmethod
    def from_option(cls, value: float, context: PolicyContext) -> StepPolicy:
        return cls(int(value))

    def describe(self) -> str:
        return f"decode first after {self.after} prefill steps"

    def prefill_token_limit(self, budget: int) -> int:
        return 0 if self.prefill_steps >= self.after else budget

    def on_scheduled(self, plan) -> None:
        self.prefill_steps += bool(plan.prefill)


@pytest.fixture
def registered(monkeypatch):
    """DecodeFirst registered for one test: the registry's entries are a copy the test's end throws away."""
    assert "eager" not in STEP_POLICIES  # (this also loads the built-in policies)
    monkeypatch.setattr(STEP_POLICIES, "_entries", dict(STEP_POLICIES._entries))
    register_step_policy(DecodeFirst)
    return DecodeFirst


def test_the_registration_makes_a_flag_and_a_checked_config_key(registered, capsys):
    with pytest.raises(SystemExit):
        parse(["serve", "--help"])
    assert "--decode-first-after N" in capsys.readouterr().out
    _, args = parse(["serve", "--decode-first-after", "2", "--decode-interleave-every", "4"])
    cfg = engine_config(args)
    assert cfg.step_policies == {"decode_first_after": 2, "decode_interleave_every": 4}
    assert not cfg.mixed_steps  # like every step policy, it turns the default mixed steps off
    # the registry's order: eager, interleave, stall
    policies = step_policies(cfg, PolicyContext(page_size=16, min_chunk_tokens=16))
    assert [type(p).__name__ for p in policies] == ["DecodeFirst", "DecodeInterleavePolicy"]
    off = EngineConfig(step_policies={"decode_first_after": 0})
    assert off.mixed_steps and [type(p) for p in step_policies(off, PolicyContext(16, 16))] == [MixedSteps]
    with pytest.raises(ConfigError, match=r"decode_first_after=1\.5: must be an integer"):
        EngineConfig(step_policies={"decode_first_after": 1.5})
    with pytest.raises(ConfigError, match="'decode_first' is no step policy's option.*'decode_first_after'"):
        EngineConfig(step_policies={"decode_first": 1})


def test_its_forced_decodes_carry_its_name_to_the_counts_the_logs_and_the_metrics(registered, caplog):
    engine = fake_engine(step_policies={"decode_first_after": 1})
    before = engine.stats()
    handles = [engine.submit(prompt(3, 1), greedy(6)), engine.submit(prompt(4 * CHUNK, 2), greedy(1))]
    with caplog.at_level(logging.INFO, logger="jaxserve.engine"):
        run(engine, *handles)
    after = engine.stats()
    forced = after.steps.forced["eager"]
    assert forced == sum(r.forced_by == "eager" for r in engine.step_record) >= 3  # the short request's decodes
    assert forced == after.steps.forced_total
    lines = [r.getMessage() for r in caplog.records]
    assert sum(line.startswith("Decode batch (decode first after 1 prefill steps)") for line in lines) == forced
    line = stats_line(before, after, 1.0)
    assert line is not None and f"({forced} decoded first, 0 interleaved, 0 for the stall budget)" in line
    exposition = ServerMetrics(engine, "m").exposition().decode()
    assert "# HELP jaxserve:eager_decode_steps_total Decode steps --decode-first-after asked for." in exposition
    assert f'jaxserve:eager_decode_steps_total{{model_name="m"}} {forced:.1f}' in exposition
