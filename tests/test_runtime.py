"""The runtime: in-place KV cache, chunked prefill, sampling, chat format, and the standalone run.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from qwen2om.runtime.standalone import Engine, RuntimeInputError, Sampling


@pytest.fixture(scope="module")
def engine(converted) -> Engine:
    return Engine(converted("tiny-qwen3", "fp32"))


def test_kv_cache_is_preallocated_and_written_in_place(engine: Engine) -> None:
    buffers = {k: v for k, v in engine.caches.items()}
    addresses = {k: v.ctypes.data for k, v in buffers.items()}
    engine.reset()
    for v in engine.caches.values():
        v.fill(0)
    ids = engine.encode("In place, please: the cache must not move.")
    engine.prefill([ids])
    engine.step([ids[-1]])
    n = len(ids) + 1
    for name, buf in engine.caches.items():
        assert buf is buffers[name] and buf.ctypes.data == addresses[name]
        assert np.abs(buf[:, :, :n]).sum() > 0, name  # the prompt's and the step's slots are filled
        assert not buf[:, :, n:].any(), name  # nothing beyond them was touched
    # Both graphs read the very same memory: the session inputs are bound to these arrays.
    for g in engine.graphs.values():
        for name, buf in engine.caches.items():
            assert g.buffers[name] is buf


def test_chunked_prefill_equals_token_by_token(engine: Engine) -> None:
    ids = engine.encode("A prompt long enough to need several prefill chunks. " * 6)
    assert len(ids) > 2 * engine.graphs["prefill"].tokens
    engine.reset()
    chunked = engine.prefill([ids])[0].copy()
    engine.reset()
    for tok in ids[:-1]:
        engine.step([tok])
    stepwise = engine.step([ids[-1]])[0]
    assert np.abs(chunked - stepwise).max() < 1e-4


def test_short_prompts_go_through_the_decode_graph(engine: Engine, monkeypatch) -> None:
    """A prompt of at most chunk // SHORT_PROMPT tokens is fed token by token through the decode
    graph (a whole prefill chunk would cost more), with the logits the prefill graph gives."""
    from qwen2om.runtime import standalone

    short = max(engine.graphs["prefill"].gears) // standalone.SHORT_PROMPT
    ids = engine.encode("A prompt long enough to cut")[:short]
    assert 1 < len(ids) == short
    calls: list[str] = []
    original = engine._call
    monkeypatch.setattr(engine, "_call", lambda kind, rows: calls.append(kind) or original(kind, rows))
    engine.reset()
    via_decode = engine.prefill([ids])[0].copy()
    assert calls == ["decode"] * short
    monkeypatch.setattr(standalone, "SHORT_PROMPT", 10**6)  # no prompt is short: the prefill graph runs
    calls.clear()
    engine.reset()
    via_prefill = engine.prefill([ids])[0]
    assert calls == ["prefill"]
    assert np.abs(via_decode - via_prefill).max() < 1e-4
    engine.reset()
    engine.prefill([ids + ids[:1]])  # one token more than `short`: a prefill call again
    assert calls[-1] == "prefill"


def test_sampling_is_seeded(engine: Engine) -> None:
    ids = engine.encode("Sampling test")
    run = lambda s: engine.generate(ids, max_new_tokens=12, sampling=s)[0]  # noqa: E731
    assert run(Sampling(0.9, 50, 0.95, seed=1)) == run(Sampling(0.9, 50, 0.95, seed=1))
    assert run(Sampling(1.5, 0, 1.0, seed=1)) != run(Sampling(1.5, 0, 1.0, seed=2))
    greedy = run(Sampling(0.0))
    assert run(Sampling(1.0, top_k=1, seed=3)) == greedy


def test_top_p_keeps_the_nucleus() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    picks = {Sampling(1.0, 0, 0.7, seed=s).pick(logits) for s in range(200)}
    assert picks == {0, 1}


@pytest.mark.parametrize(("option", "value", "message"), [
    ("--temperature", "-1", "temperature -1.0 must be >= 0"), ("--top-k", "-3", "top-k -3 must be >= 0"),
    ("--top-p", "-0.1", "top-p -0.1 must be in [0, 1]"), ("--top-p", "1.5", "top-p 1.5 must be in [0, 1]"),
    ("--max-new-tokens", "-2", "--max-new-tokens -2 must be >= 0")])
def test_run_refuses_sampling_settings_that_mean_nothing(engine: Engine, capsys, option, value, message) -> None:
    from qwen2om.runtime.standalone import main

    try:
        code = main(["--prompt", "hi", option, value], model_dir=engine.dir)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    assert code == 2 and message in capsys.readouterr().err


def test_generation_stops_at_eos(engine: Engine) -> None:
    ids = engine.encode("stop")
    greedy_first = engine.generate(ids, max_new_tokens=1, sampling=Sampling(0.0))[0][0]
    saved = engine.eos
    engine.eos = {greedy_first}
    try:
        out, stats = engine.generate(ids, max_new_tokens=10, sampling=Sampling(0.0))
    finally:
        engine.eos = saved
    assert out == [greedy_first] and stats.stop == "eos"


def test_chat_format_matches_the_tokenizer_template(engine: Engine, converted) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(converted("tiny-qwen3", "fp32"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好, world"}]
    want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ours = engine.encode("你好, world", chat=True, system="Be brief.")
    assert ours == tok(want, add_special_tokens=False)["input_ids"]
    assert engine.encode("x", chat=True)[0] == 151644  # <|im_start|>


def test_capacity_is_exact(engine: Engine) -> None:
    """A prompt of exactly `capacity` tokens fits (one token can still be sampled); one more does not."""
    engine.reset()
    with pytest.raises(RuntimeInputError, match="capacity"):
        engine.prefill([[5] * (engine.capacity + 1)])
    engine.reset()
    engine.prefill([[5] * engine.capacity])
    with pytest.raises(RuntimeInputError, match="exceed the capacity"):
        engine.step([5])
    out, stats = engine.generate([5] * engine.capacity, max_new_tokens=3, sampling=Sampling(0.0))
    assert len(out) == 1 and stats.stop == "cache full"


def test_sampling_edge_cases() -> None:
    logits = np.array([0.0, 3.0, 1.0])
    assert Sampling(1.0, top_k=1000, seed=0).pick(logits) in (0, 1, 2)  # top_k above the vocabulary
    assert {Sampling(1.0, top_p=0.0, seed=s).pick(logits) for s in range(20)} == {1}  # top_p 0: argmax
    assert engine_free_generate_zero_tokens() == []


def engine_free_generate_zero_tokens() -> list[int]:
    from qwen2om.runtime.standalone import Engine as E

    e = E.__new__(E)  # generate() with 0 tokens must not touch the model at all
    e.reset = lambda: None  # type: ignore[method-assign]
    return e.generate([1, 2], max_new_tokens=0, sampling=Sampling(0.0))[0]


def test_run_cli_streams_and_reports_speed(converted, cli) -> None:
    code, stdout, err = cli("run", converted("tiny-qwen3", "fp32"), "--prompt", "Hello", "--greedy",
                            "--max-new-tokens", "8")
    assert code == 0
    assert stdout.strip()
    assert "prefill" in err and "tok/s" in err and "time to first token" in err


def test_run_reports_speeds_only_for_work_done(converted, cli) -> None:
    """`--max-new-tokens 0` runs nothing: it printed "prefill 1 tok in 0 ms (0.0 tok/s, …)"; one new token
    comes from the prefill alone: it printed "decode 1 tok at 0.0 tok/s"."""
    out = converted("tiny-qwen3", "fp32")
    code, stdout, err = cli("run", out, "--prompt", "Hello", "--greedy", "--max-new-tokens", "0")
    assert code == 0 and not stdout.strip(), err
    assert "nothing generated (no graph run)" in err and "tok/s" not in err and "prefill" not in err
    code, _, err = cli("run", out, "--prompt", "Hello", "--greedy", "--max-new-tokens", "1", "--ignore-eos")
    assert code == 0 and "prefill" in err and "time to first token" in err, err
    assert "1 tok, from the prefill (no decode step)" in err and "decode 1 tok at" not in err


def run_json(python: str, run_py: Path, cwd: Path, env: dict[str, str] | None = None) -> dict:
    proc = subprocess.run([python, str(run_py), "--prompt", "The standalone stub", "--max-new-tokens", "16",
                           "--greedy", "--json"], cwd=cwd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_run_py_matches_qwen2om_run_without_torch(converted, cli, tmp_path) -> None:
    """run.py, called from elsewhere with torch/transformers/qwen2om made unimportable, gives the same tokens."""
    out = converted("tiny-qwen3", "fp32")
    code, stdout, _ = cli("run", out, "--prompt", "The standalone stub", "--max-new-tokens", "16", "--greedy",
                          "--json")
    assert code == 0
    ours = json.loads(stdout)
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "transformers", "qwen2om", "onnx"):
                    raise ImportError(f"run.py must not import {name}")
        sys.meta_path.insert(0, Block())
    """))
    env = {**os.environ, "PYTHONPATH": str(blocker)}
    theirs = run_json(sys.executable, out / "run.py", cwd=tmp_path, env=env)
    assert theirs["tokens"] == ours["tokens"] and len(ours["tokens"]) == 16


@pytest.mark.slow
def test_run_py_in_a_minimal_venv(converted, cli, tmp_path) -> None:
    """Acceptance: a venv with only numpy, onnxruntime and tokenizers runs OUT/run.py to the same tokens."""
    out = converted("tiny-qwen3", "fp32")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "-q", "numpy", "onnxruntime", "tokenizers"], check=True,
                   timeout=600)
    listed = subprocess.run([py, "-m", "pip", "list", "--format=json"], capture_output=True, text=True).stdout
    names = {p["name"].lower() for p in json.loads(listed)}
    assert not names & {"torch", "transformers", "qwen2om", "onnx"}
    code, stdout, _ = cli("run", out, "--prompt", "The standalone stub", "--max-new-tokens", "16", "--greedy",
                          "--json")
    assert code == 0
    assert run_json(py, out / "run.py", cwd=tmp_path)["tokens"] == json.loads(stdout)["tokens"]


def test_batch_rows_of_different_lengths_match_batch_one(converted) -> None:
    """A batch-2 graph: each row (left-padded to a common chunk count) equals the batch-1 result."""
    one = Engine(converted("tiny-qwen3", "fp32"))
    two = Engine(converted("tiny-qwen3", "fp32", "batch_size=2"))
    assert two.batch == 2
    a = one.encode("Short prompt.")
    b = one.encode("A much longer prompt that spans more than one prefill chunk of thirty-two tokens. " * 2)
    two.reset()
    both = two.prefill([a, b]).copy()
    nxt = two.step([7, 9]).copy()
    for row, ids, tok in ((0, a, 7), (1, b, 9)):
        one.reset()
        single = one.prefill([ids])[0].copy()
        assert np.abs(both[row] - single).max() < 1e-4
        assert np.abs(nxt[row] - one.step([tok])[0]).max() < 1e-4
