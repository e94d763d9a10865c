"""lm-evaluation-harness (`lm_eval --model local-completions`, tokenizer_backend=remote) against the server on
loopback with no network, on the repo's own two-part task (tests/lm_eval_task: a multiple-choice part, scored from
loglikelihoods sent with echo and logprobs, and a generate_until part), and its scores reproduced from
transformers' DeepSeek-V4 reading the same checkpoint (tests/reference.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from reference import load_reference, reference_greedy, reference_logprobs
from served_runner import MODEL
from test_server import serving, settled, wait_for

from jaxserve.checkpoints import default_checkpoint_path

TASKS = Path(__file__).parent / "lm_eval_task"
CHOICE, GENERATE = "jaxserve_tiny_choice", "jaxserve_tiny_generate"
TOL = 1e-4
DEAD_PROXY = "http://127.0.0.1:9"  # anything lm-eval tried to fetch from outside would fail here


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_lm_eval(url: str, out: Path) -> tuple[dict, dict[str, list[dict]]]:
    """lm_eval in a subprocess, offline; (the results table, each task's logged samples)."""
    home = out / "hf-home"
    env = {
        **os.environ,
        "HF_HOME": str(home),
        "HF_DATASETS_CACHE": str(home / "datasets"),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_EVALUATE_OFFLINE": "1",
        "HTTP_PROXY": DEAD_PROXY,
        "HTTPS_PROXY": DEAD_PROXY,
        "http_proxy": DEAD_PROXY,
        "https_proxy": DEAD_PROXY,
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }
    model_args = (
        f"model={MODEL},base_url={url}/v1/completions,tokenizer_backend=remote,tokenized_requests=True,"
        "num_concurrent=1,max_retries=1"
    )
    command = [
        sys.executable,
        "-m",
        "lm_eval",
        "run",
        "--model",
        "local-completions",
        "--model_args",
        model_args,
        "--tasks",
        CHOICE,
        GENERATE,
        "--include_path",
        str(TASKS),
        "--batch_size",
        "1",
        "--output_path",
        str(out / "results"),
        "--log_samples",
    ]
    done = subprocess.run(command, cwd=TASKS, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    (results,) = (out / "results").rglob("results_*.json")
    samples = {
        task: read_jsonl(next((out / "results").rglob(f"samples_{task}_*.jsonl"))) for task in (CHOICE, GENERATE)
    }
    return json.loads(results.read_text())["results"], samples


def reference_choice(model, tokenizer, doc: dict) -> list[tuple[float, bool]]:
    """(loglikelihood, is_greedy) of each choice after the context, tokenized as lm-eval does: the whole string
    encoded once and split after the context's tokens."""
    context = f"Question: {doc['question']}\nAnswer:"
    scores = []
    for choice in doc["choices"]:
        whole = tokenizer.encode(context + " " + choice, add_special_tokens=False)
        start = len(tokenizer.encode(context, add_special_tokens=False))
        rows = reference_logprobs(model, whole)[start - 1 : -1]  # the rows that predict the choice's tokens
        continuation = whole[start:]
        scores.append(
            (
                float(sum(row[t] for row, t in zip(rows, continuation))),
                all(int(np.argmax(row)) == t for row, t in zip(rows, continuation)),
            )
        )
    return scores


def reference_generation(model, tokenizer, doc: dict, eos_ids) -> str:
    """Greedy, at most 2 tokens, ended by an EOS id, special tokens dropped, cut at the first newline."""
    tokens, _ = reference_greedy(model, tokenizer.encode(doc["prompt"], add_special_tokens=False), 2)
    ends = [i for i, t in enumerate(tokens) if t in eos_ids]
    return tokenizer.decode(tokens[: ends[0]] if ends else tokens).split("\n")[0]


def test_lm_eval_scores_match_the_reference_model(runner, loaded, tmp_path):
    started = time.perf_counter()
    with serving(runner, loaded) as server:
        results, samples = run_lm_eval(server.url, tmp_path)
        wait_for(lambda: settled(server.engine), 5, "every page back")
        finished = server.engine.stats().finished
    elapsed = time.perf_counter() - started
    print(f"lm-eval against the server: {elapsed:.1f} s, {results}")
    tokenizer = loaded.tokenizer
    model = load_reference(default_checkpoint_path())

    choice_docs = read_jsonl(TASKS / "tiny_choice.jsonl")
    logged = sorted(samples[CHOICE], key=lambda s: s["doc_id"])
    assert len(logged) == len(choice_docs)
    acc, acc_norm = [], []
    for doc, sample in zip(choice_docs, logged):
        expected = reference_choice(model, tokenizer, doc)
        got = [(float(ll), str(greedy) == "True") for ll, greedy in sample["filtered_resps"]]  # logged as strings
        assert [g for _, g in got] == [g for _, g in expected], doc
        np.testing.assert_allclose([ll for ll, _ in got], [ll for ll, _ in expected], atol=TOL)
        lls = np.array([ll for ll, _ in expected])
        acc.append(int(np.argmax(lls)) == doc["answer"])
        acc_norm.append(int(np.argmax(lls / np.array([len(c) for c in doc["choices"]]))) == doc["answer"])
    assert results[CHOICE]["acc,none"] == pytest.approx(np.mean(acc))
    assert results[CHOICE]["acc_norm,none"] == pytest.approx(np.mean(acc_norm))

    docs = read_jsonl(TASKS / "tiny_generate.jsonl")
    logged = sorted(samples[GENERATE], key=lambda s: s["doc_id"])
    texts = [reference_generation(model, tokenizer, doc, set(tokenizer.eos_ids)) for doc in docs]
    assert [s["filtered_resps"][0] for s in logged] == texts
    assert results[GENERATE]["exact_match,none"] == pytest.approx(
        np.mean([t == d["target"] for t, d in zip(texts, docs)])
    )
    # One request per choice (echo, logprobs, max_tokens 1) and one per generation, each finished once.
    assert sum(finished.values()) == sum(len(d["choices"]) for d in choice_docs) + len(docs)
