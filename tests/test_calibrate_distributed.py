"""`calibrate --distributed ray`: N workers write the single process's checkpoint byte for byte, a worker
killed mid-run changes nothing, and a driver killed mid-run continues with --resume to the same bytes."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from qwen2om.quant.calibrate import CalibrationConfig, calibrate

pytestmark = pytest.mark.slow

MODELS = ["builtin:tiny-qwen3-trained", "builtin:tiny-qwen3-moe"]
# Small enough for seconds per run, big enough for several chunks per worker (8 samples, batch 1).
SAMPLES = {"num_samples": 8, "seq_len": 48, "dataset": "builtin:prose", "threads": 1}


def config(method: str, **extra: Any) -> CalibrationConfig:
    return CalibrationConfig(method=method, group_size=32, **SAMPLES, **extra)


def digests(out: Path) -> dict[str, str]:
    """Every file of a calibrated checkpoint but the report (which holds timings)."""
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(out.iterdir())
            if f.name != "calibration_report.json"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """One local Ray cluster of 2 CPUs for the module (3 workers share them: fractional CPUs)."""
    import logging

    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """The one-process calibration of (model, method), made once per module."""
    done: dict[tuple[str, str], Path] = {}

    def make(model: str, method: str) -> Path:
        if (model, method) not in done:
            out = tmp_path_factory.mktemp("single") / "q"
            calibrate(model, out, config(method))
            done[(model, method)] = out
        return done[(model, method)]
    return make


@pytest.mark.parametrize("method", ["gptq", "awq"])
@pytest.mark.parametrize("model", MODELS)
def test_one_two_and_three_workers_write_the_single_process_bytes(cluster, single, tmp_path, model: str,
                                                                   method: str) -> None:
    want = digests(single(model, method))
    for workers in (1, 2, 3):
        out = tmp_path / f"w{workers}"
        report = calibrate(model, out, config(method), distributed="ray", workers=workers).report
        assert digests(out) == want, f"{workers} workers"
        ex = report["execution"]
        assert ex["workers"] == workers and ex["threads"] == 1 and "binary tree" in ex["reduction"]
        assert len(ex["worker_peak_rss_bytes"]) == workers and min(ex["worker_peak_rss_bytes"]) > 0
        run = report["layers"][0]["run"]
        assert run["workers"] == workers and sum(run["samples_per_worker"]) == SAMPLES["num_samples"]
        assert run["bytes_moved"] > 0


@pytest.mark.parametrize("step", [1, 4, 7])  # after a worker's statistics, its solves, its next inputs
def test_a_worker_killed_mid_layer_changes_nothing(cluster, single, tmp_path, step: int) -> None:
    want = digests(single(MODELS[0], "gptq"))
    pools: list[Any] = []
    seen = {"layer": 0, "steps": 0, "killed": False}

    def progress(label: str, done: int, total: int, unit: str = "") -> None:
        if label == "calibrating layers":
            seen["layer"] = done
        elif seen["layer"] == 1 and not seen["killed"]:  # layer 1 in progress: kill worker 1 at `step`
            seen["steps"] += 1
            if seen["steps"] == step:
                pools[0].kill(1)
                seen["killed"] = True

    out = tmp_path / "q"
    report = calibrate(MODELS[0], out, config("gptq"), distributed="ray", workers=3, pool_hook=pools.append,
                       progress=progress).report
    assert seen["killed"]
    assert digests(out) == want
    lost = report["execution"]["workers_lost"]
    assert [x["worker"] for x in lost] == [1] and lost[0]["layer"] in (1, 2) and "killed" in lost[0]["why"]
    # ray.kill is asynchronous: the loss shows in layer 1, or in layer 2 when layer 1's step finished first
    at = lost[0]["layer"]
    assert [x["run"]["workers"] for x in report["layers"]] == [3] * at + [2] * (4 - at)
    assert report["layers"][at]["run"]["workers_lost"][0]["worker"] == 1


def test_fisher_hessians_on_two_workers_or_a_lost_one_write_the_single_process_bytes(cluster, tmp_path) -> None:
    """--hessian fisher-heads: the loss-gradient pass splits by chunk too, and the token weights the driver
    keeps reach whichever worker holds a chunk after a loss."""
    calibrate(MODELS[0], tmp_path / "one", config("gptq", hessian="fisher-heads"))
    want = digests(tmp_path / "one")
    calibrate(MODELS[0], tmp_path / "two", config("gptq", hessian="fisher-heads"), distributed="ray", workers=2)
    assert digests(tmp_path / "two") == want
    pools: list[Any] = []
    seen = {"layer": 0, "killed": False}

    def progress(label: str, done: int, total: int, unit: str = "") -> None:
        if label == "calibrating layers":
            seen["layer"] = done
        elif label.startswith("this layer") and seen["layer"] == 1 and not seen["killed"]:
            pools[0].kill(1)
            seen["killed"] = True
    report = calibrate(MODELS[0], tmp_path / "lost", config("gptq", hessian="fisher-heads"), distributed="ray",
                       workers=3, pool_hook=pools.append, progress=progress).report
    assert seen["killed"] and [x["worker"] for x in report["execution"]["workers_lost"]] == [1]
    assert digests(tmp_path / "lost") == want


def test_a_worker_process_that_dies_is_recovered_from(cluster, single, tmp_path) -> None:
    """SIGKILL of the actor's process (a crash, an OOM kill), not ray.kill."""
    want = digests(single(MODELS[1], "gptq"))
    pools: list[Any] = []

    def progress(label: str, done: int, total: int, unit: str = "") -> None:
        if label == "calibrating layers" and done == 1:
            os.kill(pools[0].places[0].pid, signal.SIGKILL)

    out = tmp_path / "q"
    report = calibrate(MODELS[1], out, config("gptq"), distributed="ray", workers=2, pool_hook=pools.append,
                       progress=progress).report
    assert digests(out) == want
    assert [x["worker"] for x in report["execution"]["workers_lost"]] == [0]


def kill_after_layers(args: list[str], stage: Path, layers: int, env: dict[str, str]) -> list[int]:
    """Run the calibrate command, SIGKILL it (and its Ray processes) once its journal lists `layers`."""
    process = subprocess.Popen(args, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env=env)
    journal, done = stage / "journal.json", []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        try:
            done = json.loads(journal.read_text())["data"].get("layers", [])
        except (OSError, ValueError):
            done = []
        if len(done) >= layers:
            break
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(30)
    assert len(done) >= layers, f"the run ended before layer {layers}: {process.stderr and process.stderr.read()}"
    return done


@pytest.mark.parametrize("resume_with", [[], ["--distributed", "ray", "--workers", "2"]])
def test_a_killed_driver_resumes_to_the_same_bytes(single, tmp_path, resume_with: list[str]) -> None:
    """Killed (SIGKILL: nothing runs on the way out) after two of four layers, then --resume: in one
    process, and with two Ray workers (it started as one process: the workers do not matter)."""
    model = MODELS[0]
    want = digests(single(model, "gptq"))
    out = tmp_path / "q"
    env = {**os.environ, "RAY_ADDRESS": ""}
    args = [sys.executable, "-m", "qwen2om", "calibrate", model, "-o", str(out), "--group-size", "32",
            "--num-samples", str(SAMPLES["num_samples"]), "--seq-len", str(SAMPLES["seq_len"]),
            "--dataset", SAMPLES["dataset"], "--threads", "1", "--batch-size", "1"]
    done = kill_after_layers(args, tmp_path / ".q.partial", 2, env)
    assert not out.exists() and (tmp_path / ".q.partial" / ".calibration" / "layer-00001.pt").exists()
    refused = subprocess.run(args, capture_output=True, text=True, env=env)
    assert refused.returncode == 2 and "--resume" in refused.stderr
    other = subprocess.run([*args[:-2], "--batch-size", "2", "--resume"], capture_output=True, text=True, env=env)
    assert other.returncode == 2 and "different" in other.stderr and "--force" in other.stderr
    finished = subprocess.run([*args, "--resume", *resume_with], capture_output=True, text=True, env=env,
                              timeout=600)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert f"resumed: {len(done)} layers came from the interrupted run" in finished.stdout
    assert digests(out) == want
    assert not (tmp_path / ".q.partial").exists()
    report = json.loads((out / "calibration_report.json").read_text())
    assert report["execution"]["resumed_layers"] == len(done) and len(report["layers"]) == 4
    assert all(x["linears"] for x in report["layers"])  # the resumed layers' reports came from the journal


def test_a_head_and_a_worker_started_with_ray_start(single, tmp_path) -> None:
    """Two nodes on this host, each its own `ray start` process; the command connects with --address."""
    from test_ray_stages import two_nodes

    want = digests(single(MODELS[0], "gptq"))
    out = tmp_path / "q"
    with two_nodes() as (address, env):
        done = subprocess.run(
            [sys.executable, "-m", "qwen2om", "calibrate", MODELS[0], "-o", str(out), "--group-size", "32",
             "--num-samples", str(SAMPLES["num_samples"]), "--seq-len", str(SAMPLES["seq_len"]), "--dataset",
             SAMPLES["dataset"], "--threads", "1", "--distributed", "ray", "--workers", "2", "--address", address],
            capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert digests(out) == want
    places = json.loads((out / "calibration_report.json").read_text())["execution"]["places"]
    assert len(places) == 2 and len({p["pid"] for p in places}) == 2


def test_no_cluster_at_the_address_is_one_clear_error(tmp_path) -> None:
    from test_ray_stages import free_port

    port = free_port()
    done = subprocess.run([sys.executable, "-m", "qwen2om", "calibrate", MODELS[0], "-o", str(tmp_path / "q"),
                           "--group-size", "32", "--num-samples", "2", "--seq-len", "16", "--distributed", "ray",
                           "--address", f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RAY_ADDRESS": ""})
    assert done.returncode == 2 and f"--address 127.0.0.1:{port}: no Ray cluster answers there" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "q").exists() and not (tmp_path / ".q.partial").exists()
