"""`--distributed ray`: a staged OUT's stages as Ray actors give the in-process logits, and each way it
can fail (Ray missing, an address where no cluster answers, an actor that dies or cannot load its
stage, a stage that does not answer) is one clear error naming what to do, or the stage and host."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qwen2om.runtime import standalone
from qwen2om.runtime.standalone import BackendError, Engine, RuntimeInputError

PROMPT = [9707, 11, 1879, 0, 576, 3974, 13876, 38835, 43, 11, 323, 279, 1156, 220, 17, 13]  # 16 tokens: 2 chunks
RAY = Path(sys.executable).parent / "ray"


# -- fixtures -----------------------------------------------------------------------------------------
@pytest.fixture
def outs(staged_outs: Callable[..., Path]) -> Callable[..., Path]:
    """`outs(model, stages)` → an fp32 output directory (stages 0: unstaged), shared with test_stages.py."""
    return staged_outs


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """One local Ray cluster of 2 CPUs for the module; engines find it initialised and use it."""
    import logging

    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    yield ray
    ray.shutdown()


def run_through(engine: Engine, steps: int = 6) -> tuple[np.ndarray, list[int]]:
    """Prefill PROMPT (two chunks), then greedy decode `steps` tokens: every logits row, and the tokens."""
    engine.reset()
    rows, tokens = [engine.prefill([PROMPT] * engine.batch)[0]], []
    for _ in range(steps):
        tokens.append(int(np.argmax(rows[-1])))
        rows.append(engine.step([tokens[-1]] * engine.batch)[0])
    return np.stack(rows), tokens


def logits_of(out: Path, **kwargs: Any) -> tuple[np.ndarray, list[int]]:
    with Engine(out, **kwargs) as engine:
        return run_through(engine)


def gone(pid: int, seconds: float = 20.0) -> bool:
    import psutil

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.2)
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- through Ray, the in-process logits ------------------------------------------------------------------
W4A16 = "w4a16"  # the llmcompressor_ckpt fixture (conftest.py): llm-compressor's W4A16 tiny-qwen3
CASES = [("builtin:tiny-qwen3", 2), ("builtin:tiny-qwen3", 3), ("builtin:tiny-qwen3-moe", 2),
         ("builtin:tiny-qwen3-5", 3),  # qwen3-5: linear-attention states and KV caches in different actors
         ("builtin:tiny-qwen3-fp8", 2),  # each actor feeds its own stage's FP8 scale inputs
         (W4A16, 2)]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "stages"), CASES, ids=[f"{m.removeprefix('builtin:')}-{k}" for m, k in CASES])
def test_ray_stages_give_the_in_process_logits(outs: Callable[[str, int], Path], cluster: Any, model: str,
                                               stages: int, request: pytest.FixtureRequest) -> None:
    if model == W4A16:
        model = str(request.getfixturevalue("llmcompressor_ckpt"))
    staged = outs(model, stages)
    want, want_tokens = logits_of(staged)
    with Engine(staged, distributed="ray") as engine:
        got, got_tokens = run_through(engine)
        again, _ = run_through(engine)  # reset: lengths, and each actor's states cleared
        places = engine.graphs["decode"].stages.places  # type: ignore[attr-defined]
        assert engine.caches == {}  # the caches live in the actors
    assert [p.index for p in places] == list(range(stages))
    assert len({p.pid for p in places} | {os.getpid()}) == stages + 1  # one process per stage, not this one
    assert np.abs(got - want).max() <= 1e-6 and got_tokens == want_tokens
    assert np.abs(again - want).max() <= 1e-6
    if model == "builtin:tiny-qwen3":  # and the unstaged conversion's
        whole, whole_tokens = logits_of(outs(model, 0))
        assert np.abs(got - whole).max() <= 1e-6 and got_tokens == whole_tokens


@pytest.mark.slow
def test_run_verify_and_eval_take_distributed_ray(outs: Callable[[str, int], Path], cluster: Any, cli: Any) -> None:
    staged = outs("builtin:tiny-qwen3", 2)
    args = ("run", staged, "--ids", ",".join(map(str, PROMPT)), "--greedy", "--max-new-tokens", "6", "--json")
    code, stdout, err = cli(*args)
    assert code == 0, err
    code, ray_stdout, err = cli(*args, "--distributed", "ray")
    assert code == 0, err
    assert json.loads(ray_stdout)["tokens"] == json.loads(stdout)["tokens"]
    code, stdout, err = cli("verify", staged, "--tokens", "4", "--prompt", "Hello", "--distributed", "ray")
    assert code == 0 and "PASS" in stdout, stdout + err
    ppl = [cli("eval", "ppl", staged, "--window", "12", "--max-windows", "1", "--json", *extra)
           for extra in ((), ("--distributed", "ray"))]
    assert all(code == 0 for code, _, _ in ppl), ppl
    assert json.loads(ppl[0][1])["ppl"] == pytest.approx(json.loads(ppl[1][1])["ppl"], rel=1e-6)
    assert cluster.is_initialized()  # an engine that did not start Ray leaves it running


# -- failures ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_killed_actor_is_named_and_close_ends_the_others(outs: Callable[[str, int], Path], cluster: Any) -> None:
    engine = Engine(outs("builtin:tiny-qwen3", 2), distributed="ray")
    try:
        engine.prefill([PROMPT])
        places = engine.graphs["decode"].stages.places  # type: ignore[attr-defined]
        os.kill(places[1].pid, signal.SIGKILL)
        began = time.monotonic()
        with pytest.raises(BackendError, match=rf"stage 1 \(layers 2-3\) on host {places[1].host} "
                                               rf"\({places[1].ip}, pid {places[1].pid}\): its Ray actor died"):
            engine.step([5])
        assert time.monotonic() - began < 30  # reported, not waited on
        with pytest.raises(BackendError, match=r"stage 1 \(layers 2-3\)"):  # and again, not a hang
            engine.step([5])
    finally:
        engine.close()
    assert gone(places[0].pid)


@pytest.mark.slow
def test_a_stage_that_cannot_load_is_named(outs: Callable[[str, int], Path], cluster: Any, tmp_path: Path) -> None:
    staged = outs("builtin:tiny-qwen3", 2)
    broken = tmp_path / "01"
    shutil.copytree(staged / "stages" / "01", broken)
    with open(broken / "model.decode.onnx", "r+b") as fh:  # after the driver's check: the actor's own copy
        fh.truncate(100)
    manifest = json.loads((broken / "manifest.json").read_text())
    engine = types.SimpleNamespace(stages=[(broken, manifest)])
    with pytest.raises(BackendError, match=r"stage 0 \(layers 2-3\) on host .*model\.decode\.onnx is 100 bytes"):
        standalone.open_ray(engine)  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_stage_that_does_not_answer_in_time_is_named(outs: Callable[[str, int], Path], cluster: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QWEN2OM_RAY_CALL_TIMEOUT", "0.001")
    with pytest.raises(BackendError, match=r"stage 0 \(layers 0-1\) did not load its graphs within 0.001 s "
                                           r"\(\$QWEN2OM_RAY_CALL_TIMEOUT\)"):
        Engine(outs("builtin:tiny-qwen3", 2), distributed="ray")


@pytest.mark.slow
def test_without_ray_the_cli_names_the_extra(outs: Callable[[str, int], Path], cli: Any,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    code, _, err = cli("run", outs("builtin:tiny-qwen3", 2), "--prompt", "Hi", "--distributed", "ray")
    assert code == 2 and "pip install 'qwen2om[ray]'" in err and "Traceback" not in err


def test_ray_missing_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(BackendError, match=r"needs Ray, which is not installed here .*pip install 'qwen2om\[ray\]'"):
        standalone.import_ray()


def test_an_address_where_nothing_listens_fails_at_once() -> None:
    began = time.monotonic()
    with pytest.raises(BackendError, match=r"--address 127.0.0.1:\d+: no Ray cluster answers there"):
        standalone.check_reachable(f"127.0.0.1:{free_port()}", 30)
    assert time.monotonic() - began < 5
    with pytest.raises(BackendError, match="give the head node's HOST:PORT"):
        standalone.check_reachable("headnode", 30)
    standalone.check_reachable("auto", 30)  # left to Ray


def test_timeouts_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert standalone.seconds_from_env("QWEN2OM_RAY_TEST_UNSET", 7.0) == 7.0
    monkeypatch.setenv("QWEN2OM_RAY_TEST", "2.5")
    assert standalone.seconds_from_env("QWEN2OM_RAY_TEST", 7.0) == 2.5
    for bad in ("0", "-1", "soon", "inf"):
        monkeypatch.setenv("QWEN2OM_RAY_TEST", bad)
        with pytest.raises(RuntimeInputError, match=r"\$QWEN2OM_RAY_TEST=.*: give a number of seconds > 0"):
            standalone.seconds_from_env("QWEN2OM_RAY_TEST", 7.0)


@pytest.mark.slow
def test_run_py_gives_up_on_an_address_that_never_answers(outs: Callable[[str, int], Path]) -> None:
    """Something listens, but not Ray: ray.init would retry for ever. A fresh process (the abandoned
    connection thread stays behind in it), as a user runs OUT/run.py."""
    staged = outs("builtin:tiny-qwen3", 2)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        began = time.monotonic()
        done = subprocess.run([sys.executable, staged / "run.py", "--prompt", "Hi", "--distributed", "ray",
                               "--address", f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "QWEN2OM_RAY_CONNECT_TIMEOUT": "4"})
    assert done.returncode == 2, done.stderr
    assert f"--address 127.0.0.1:{port}: no Ray cluster answered within 4 s" in done.stderr
    assert "Traceback" not in done.stderr and time.monotonic() - began < 60


# -- a head and a worker started with `ray start` -------------------------------------------------------
class RayNode:
    """`ray start --block` in its own process group: `stop` kills that group only (the head's or worker's
    raylet, GCS and workers), where `ray stop` would end every Ray on the machine, this module's included."""

    def __init__(self, *args: str, env: dict[str, str]) -> None:
        self.process = subprocess.Popen([str(RAY), "start", "--block", "--disable-usage-stats", *args], env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(ln) for ln in self.process.stdout or ()], daemon=True).start()

    def wait_started(self, seconds: float = 120.0) -> None:
        deadline, seen = time.monotonic() + seconds, []
        while time.monotonic() < deadline:
            try:
                seen.append(self.lines.get(timeout=1))
            except queue.Empty:
                if self.process.poll() is not None:
                    break
                continue
            if "Ray runtime started" in seen[-1]:
                return
        raise AssertionError("ray start did not start:\n" + "".join(seen[-30:]))

    def stop(self) -> None:
        with __import__("contextlib").suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)


@contextlib.contextmanager
def two_nodes() -> Iterator[tuple[str, dict[str, str]]]:
    """A head and a worker node on this host, each its own `ray start` process, 1 CPU each: yields the
    head's address and the environment a driver connecting to it needs; both stopped on the way out."""
    port = free_port()
    # A private temp dir: `ray start` records its cluster there, not in /tmp/ray where ray.init() looks.
    # Token authentication off for this cluster: a token left in ~/.ray by a local ray.init would turn it
    # on for `ray start` but not for a driver given an --address.
    temp = tempfile.mkdtemp(prefix="qr")  # short: Ray's socket paths live under it
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": ""}
    nodes: list[RayNode] = []
    try:
        nodes.append(RayNode("--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false",
                             f"--temp-dir={temp}", env=env))
        nodes[0].wait_started()
        nodes.append(RayNode(f"--address=127.0.0.1:{port}", "--num-cpus=1", env=env))
        nodes[1].wait_started()
        yield f"127.0.0.1:{port}", env
    finally:
        for node in reversed(nodes):
            node.stop()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_a_head_and_a_worker_started_with_ray_start(outs: Callable[[str, int], Path], tmp_path: Path) -> None:
    """Two nodes on this host, each process separate: the driver (a fresh process, as run.py is) connects
    with --address and places one stage on each node."""
    staged = outs("builtin:tiny-qwen3", 2)
    want, want_tokens = logits_of(staged)
    with two_nodes() as (address, env):
        script = (
            "import json, sys, numpy as np\n"
            "from qwen2om.runtime.standalone import Engine\n"
            "from test_ray_stages import run_through\n"
            f"with Engine({str(staged)!r}, distributed='ray', address={address!r}) as e:\n"
            "    rows, tokens = run_through(e)\n"
            "    nodes = [p.node for p in e.graphs['decode'].stages.places]\n"
            f"np.save({str(tmp_path / 'rows.npy')!r}, rows)\n"
            "print(json.dumps({'tokens': tokens, 'nodes': nodes}))\n")
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
                              cwd=Path(__file__).parent)
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["tokens"] == want_tokens
    assert np.abs(np.load(tmp_path / "rows.npy") - want).max() <= 1e-6
    assert len(set(report["nodes"])) == 2  # SPREAD: one stage per node


# -- the ACL backend in the actors, through fakes of Ray and pyACL ---------------------------------------
class FakeRef:
    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error


class FakeRay(types.ModuleType):
    """Enough of `ray` for open_ray, in this process: actors are plain objects, a task runs when it is
    sent, ObjectRefs hold its result or error (raised as RayTaskError from get, as Ray does)."""

    class exceptions:  # noqa: N801 - Ray's module name
        class RayError(Exception):
            pass

        class RayActorError(RayError):
            actor_id = ""

        class RayTaskError(RayError):
            def __init__(self, cause: BaseException) -> None:
                super().__init__(str(cause))
                self.cause, self.ip, self.pid = cause, "127.0.0.1", os.getpid()

        class GetTimeoutError(RayError):
            pass

    def __init__(self) -> None:
        super().__init__("ray")
        self.killed: list[Any] = []
        self.alive = 1  # nodes
        self.util = types.SimpleNamespace(get_node_ip_address=lambda: "127.0.0.1")

    def is_initialized(self) -> bool:
        return True

    def cluster_resources(self) -> dict[str, float]:
        return {"CPU": 2.0}

    def nodes(self) -> list[dict[str, Any]]:
        return [{"Alive": True}] * self.alive

    def get_runtime_context(self) -> Any:
        return types.SimpleNamespace(get_node_id=lambda: "fake-node")

    def remote(self, cls: type) -> Any:
        ray = self

        class Handle:
            def __init__(self, obj: Any) -> None:
                self.obj, self._actor_id = obj, types.SimpleNamespace(hex=lambda: str(id(obj)))

            def __getattr__(self, name: str) -> Any:
                def send(*args: Any) -> FakeRef:
                    try:
                        return FakeRef(getattr(self.obj, name)(*[ray.resolve(a) for a in args]))
                    except Exception as e:
                        return FakeRef(error=ray.exceptions.RayTaskError(e))

                return types.SimpleNamespace(remote=send)

        return types.SimpleNamespace(options=lambda **kw: types.SimpleNamespace(
            remote=lambda *args: Handle(cls(*args))))

    def resolve(self, x: Any) -> Any:
        if isinstance(x, FakeRef):
            if x.error is not None:
                raise x.error.cause  # type: ignore[attr-defined]
            return x.value
        return x

    def get(self, refs: list[FakeRef], timeout: float | None = None) -> list[Any]:
        for r in refs:
            if r.error is not None:
                raise r.error
        return [r.value for r in refs]

    def put(self, value: Any) -> FakeRef:
        return FakeRef(value)

    def wait(self, refs: list[FakeRef], num_returns: int = 1, timeout: float | None = None) -> tuple[list, list]:
        return refs, []

    def kill(self, handle: Any) -> None:
        self.killed.append(handle)


@pytest.mark.slow
def test_acl_actors_open_their_stage_on_their_device(outs: Callable[[str, int], Path], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage k's actor opens the stage's .om files on NPU devices[k]; one id d: d, d+1 on one node (as
    in-process), d on each stage's own node."""
    from fake_acl import FakeAcl
    from test_acl_backend import staged_with_om

    staged = outs("builtin:tiny-qwen3", 2)
    want = logits_of(staged)[1]
    mirror = staged_with_om(staged, tmp_path / "acl")
    fake_ray = FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    per_stage = 0
    for devices, nodes, used in (([3, 5], 1, [3, 5]), ([7], 1, [7, 8]), ([7], 2, [7, 7])):
        acl, fake_ray.alive = FakeAcl(), nodes
        monkeypatch.setitem(sys.modules, "acl", acl)
        with Engine(mirror, backend="acl", devices=devices, distributed="ray") as engine:
            assert run_through(engine)[1] == want
        per_stage = per_stage or acl.calls["execute on device 3"]
        assert per_stage > 0
        for d in set(used):  # two nodes: both stages on NPU 7 of their own host (one fake here)
            assert acl.calls[f"execute on device {d}"] == used.count(d) * per_stage
        assert acl.leaks() == []  # each actor released its NPU on close
    assert len(fake_ray.killed) == 6
    with pytest.raises(BackendError, match="--devices names 3 NPUs for 2 stages"):
        Engine(mirror, backend="acl", devices=[0, 1, 2], distributed="ray")


@pytest.mark.slow
@pytest.mark.parametrize(("model", "stages"), [("builtin:tiny-qwen3", 2), ("builtin:tiny-qwen3-5", 3)],
                         ids=["tiny-qwen3-2", "tiny-qwen3-5-3"])
def test_several_prompts_in_flight_give_each_prompts_own_tokens(outs: Callable[[str, int], Path], cluster: Any,
                                                                 model: str, stages: int) -> None:
    """Micro-batches: up to one prompt per stage in flight, each in its own cache slot of every actor;
    each prompt's continuation is what it gets alone (greedy and seeded sampling), whatever the mix of
    prefill chunks and decode steps in a round, and slots are reused as prompts finish."""
    from qwen2om.runtime.standalone import Sampling

    staged = outs(model, stages)
    prompts = [PROMPT, PROMPT[:3], PROMPT[5:], [42], PROMPT[::2]]  # 16, 3, 11, 1 and 8 tokens

    def sampled(i: int) -> Sampling:
        return Sampling(0.8, 20, 0.95, seed=i)

    with Engine(staged) as alone:
        want = [alone.generate(p, max_new_tokens=9, sampling=sampled(i), ignore_eos=True)[0]
                for i, p in enumerate(prompts)]
        want_greedy = [alone.generate(p, max_new_tokens=5, sampling=Sampling(), ignore_eos=True)[0] for p in prompts]
    with Engine(staged, distributed="ray") as engine:
        assert engine.generate_many(prompts, max_new_tokens=9, sampling=sampled, ignore_eos=True) == want
        assert engine.generate_many(prompts, max_new_tokens=5, sampling=lambda i: Sampling(),
                                    ignore_eos=True) == want_greedy
        # the engine's own single-sequence path still gives its tokens after the slots were used
        assert engine.generate(prompts[2], max_new_tokens=5, sampling=Sampling(), ignore_eos=True)[0] == want_greedy[2]
