"""The calibration driver's workers: one in this process, or N Ray actors (`calibrate --distributed ray`).

A pool owns the chunk → worker assignment and hides how a call reaches a worker. Calls go to every live
worker at once (`each`) or deal a list of jobs out (`solve`); a worker that dies is dropped, its chunks
are dealt to the others, which rebuild those chunks' activations from the embedding through the layers
already calibrated (`history(j)`: layer j's float weights and its calibrated result, as journaled), and
the step it died in is done again. Nothing a worker returns depends on which worker it is, so recovery
does not change a byte of the checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from qwen2om.layerwise import LayerTensors
from qwen2om.quant.schemes import CalibrationError
from qwen2om.quant.shard import Job, LayerResult, Settings, ShardWorker, Solved

# (chunk indices) → each chunk's (sample ids, tokens [B, T]), the sorted distinct token ids, their rows
Embedder = Callable[[list[int]], tuple[dict[int, tuple[list[int], np.ndarray]], np.ndarray, torch.Tensor]]
# layer j → (its float tensors, its calibrated result)
History = Callable[[int], tuple[dict[str, torch.Tensor], LayerResult]]


class WorkerLost(Exception):
    def __init__(self, k: int, why: str) -> None:
        super().__init__(why)
        self.k, self.why = k, why


@dataclasses.dataclass
class Place:
    """A worker as messages and the report name it."""

    index: int
    host: str = ""
    ip: str = ""
    pid: int = 0
    device: str = ""

    def __str__(self) -> str:
        return f"worker {self.index}" + (f" on {self.host} (pid {self.pid})" if self.host else "")


def nbytes(value: Any) -> int:
    """Bytes of the tensors and arrays in a value (what crosses to or from a worker)."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return int(value.nbytes)
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    if isinstance(value, (Job, Solved, LayerResult)):
        return sum(nbytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    return 0


class Pool:
    """Chunks dealt over workers; subclasses say how a call reaches one."""

    remote = False

    def __init__(self) -> None:
        self.places: list[Place] = []
        self.live: list[int] = []
        self.owner: dict[int, int] = {}  # chunk → worker
        self.count = 0
        self.level = 0  # the layer whose inputs every live chunk holds
        self.moved = 0  # bytes to and from workers since the last `take_moved`
        self.lost: list[dict[str, Any]] = []  # workers dropped: who, when, why
        self.embedder: Embedder | None = None
        self.history: History | None = None
        self.tick: Callable[[str], None] = lambda step: None  # after each worker's answer (progress)

    # -- how a call reaches a worker (subclasses) ------------------------------------------------
    def submit(self, k: int, method: str, *args: Any) -> Any:
        raise NotImplementedError

    def wait(self, k: int, future: Any) -> Any:
        raise NotImplementedError

    def share(self, value: Any) -> list[Any]:
        """`value` boxed for every worker (a Ray ObjectRef: put once, fetched by a worker when it needs it)."""
        return [value]

    def close(self) -> None:
        pass

    def layer(self) -> torch.nn.Module | None:
        """The worker's layer when it lives in this process (the driver then needs no copy of its own)."""
        return None

    # -- the driver's calls ----------------------------------------------------------------------
    def start(self, count: int, embedder: Embedder, history: History) -> None:
        """Deal `count` chunks out in contiguous runs and embed them."""
        self.count, self.embedder, self.history = count, embedder, history
        n = len(self.live)
        for j, k in enumerate(self.live):
            for c in range(count * j // n, count * (j + 1) // n):
                self.owner[c] = k
        self.each("embed", lambda k: self._embed_args(self.chunks_of(k)), recover=False)

    def chunks_of(self, k: int) -> list[int]:
        return sorted(c for c, w in self.owner.items() if w == k)

    def _embed_args(self, chunks: list[int]) -> tuple[Any, ...]:
        assert self.embedder is not None
        data, unique, rows = self.embedder(chunks)
        return self.count, data, unique, rows

    def each(self, method: str, args: Callable[[int], tuple[Any, ...]], *, recover: bool = True,
             ) -> dict[int, Any]:
        """`method` on every live worker (its arguments from `args(k)`); a worker lost on the way is
        recovered from and the call done again on the survivors."""
        while True:
            given = {k: args(k) for k in list(self.live)}
            sent = [(k, self.submit(k, method, *a)) for k, a in given.items()]
            self.moved += nbytes(list(given.values())) if self.remote else 0
            try:
                out = {}
                for k, f in sent:
                    out[k] = self.wait(k, f)
                    self.tick(method)
            except WorkerLost as lost:
                if not recover:
                    raise CalibrationError(f"{self.places[lost.k]} failed before calibrating: {lost.why}") from None
                self.recover(lost)
                continue
            self.moved += nbytes(list(out.values())) if self.remote else 0
            return out

    def solve(self, jobs: list[Job]) -> list[Solved]:
        """The jobs dealt round-robin over the live workers; the answers in the jobs' order."""
        done: dict[str, Solved] = {}
        while len(done) < len(jobs):
            todo = [j for j in jobs if j.name not in done]
            live = list(self.live)
            sent = [(k, self.submit(k, "solve", todo[i::len(live)])) for i, k in enumerate(live)]
            if self.remote:
                self.moved += nbytes(todo)
            for k, f in sent:
                try:
                    answers = self.wait(k, f)
                except WorkerLost as lost:
                    self.recover(lost)
                    continue
                self.moved += nbytes(answers) if self.remote else 0
                done |= {a.name: a for a in answers}
                self.tick("solve")
        return [done[j.name] for j in jobs]

    def recover(self, lost: WorkerLost) -> None:
        """Drop the lost worker; deal its chunks to the survivors, which rebuild them to `level`."""
        k = lost.k
        if k not in self.live:
            return
        self.live.remove(k)
        self.lost.append({"worker": k, "host": self.places[k].host, "pid": self.places[k].pid,
                          "layer": self.level, "why": lost.why})
        if not self.live:
            raise CalibrationError(f"every calibration worker is lost; the last, {self.places[k]}: {lost.why}. "
                                   "Finished layers are kept: rerun with --resume")
        orphans = self.chunks_of(k)
        n = len(self.live)
        adopted: dict[int, list[int]] = {}
        for j, w in enumerate(self.live):
            part = orphans[len(orphans) * j // n: len(orphans) * (j + 1) // n]
            adopted[w] = part
            for c in part:
                self.owner[c] = w
        assert self.history is not None
        try:
            for w, part in adopted.items():
                if part:
                    self.wait(w, self.submit(w, "embed", *self._embed_args(part)))
            for j in range(self.level):
                tensors, result = self.history(j)
                tbox, rbox = self.share(tensors), self.share(result)
                for w, part in adopted.items():
                    if part:
                        self.wait(w, self.submit(w, "advance", j, tbox, rbox))
        except WorkerLost as again:
            self.recover(again)

    def peaks(self) -> list[int]:
        return list(self.each("peak_rss", lambda k: (), recover=False).values())


class LocalPool(Pool):
    """One worker, in this process: calls are plain method calls."""

    def __init__(self, header: LayerTensors, settings: Settings) -> None:
        super().__init__()
        self.worker = ShardWorker(header, settings)
        self.places = [Place(0, **{k: v for k, v in self.worker.describe().items() if k in ("host", "ip", "pid")},
                             device=settings.device)]
        self.live = [0]

    def submit(self, k: int, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)

    def wait(self, k: int, future: Any) -> Any:
        return future

    def layer(self) -> torch.nn.Module | None:
        return self.worker.layer if self.worker.device.type == "cpu" else None

    def close(self) -> None:
        self.worker.close()


RAY_EXTRA = "pip install 'qwen2om[ray]'"


class RayPool(Pool):
    """N Ray actors, spread over the cluster's nodes; each one a ShardWorker."""

    remote = True

    def __init__(self, header: LayerTensors, settings: Settings, workers: int, address: str | None) -> None:
        super().__init__()
        from qwen2om.runtime import standalone as rt

        try:
            ray = rt.import_ray()
        except rt.BackendError:
            raise CalibrationError(f"--distributed ray needs Ray, which is not installed here: {RAY_EXTRA}") from None
        self.ray = ray
        self.seconds = _seconds("QWEN2OM_RAY_CALL_TIMEOUT", rt.RAY_CALL_SECONDS)
        try:
            self.started = rt.ray_connect(ray, address, max(workers, os.cpu_count() or 1),
                                          _seconds("QWEN2OM_RAY_CONNECT_TIMEOUT", rt.RAY_CONNECT_SECONDS))
        except rt.BackendError as e:
            raise CalibrationError(str(e)) from None
        self.actors: list[Any] = []
        try:
            cpus = float(ray.cluster_resources().get("CPU", 0))
            if not cpus:
                raise CalibrationError("the Ray cluster has no CPUs for the calibration workers")
            device = torch.device(settings.device)
            options: dict[str, Any] = {"num_cpus": min(1.0, cpus / workers), "scheduling_strategy": "SPREAD",
                                       "max_restarts": 0, "max_task_retries": 0}
            if device.type == "cuda":  # Ray gives each actor its own GPU (CUDA_VISIBLE_DEVICES): cuda:0 in it
                options["num_gpus"], settings = 1, dataclasses.replace(settings, device="cuda:0")
            elif device.type == "npu":  # and its own NPU (ASCEND_RT_VISIBLE_DEVICES)
                options["resources"], settings = {"NPU": 1}, dataclasses.replace(settings, device="npu:0")
            actor = ray.remote(ShardWorker).options(**options)
            self.actors = [actor.remote(header, settings) for _ in range(workers)]
            self.places = [Place(k) for k in range(workers)]
            self.live = list(range(workers))
            for k, info in self.each("describe", lambda k: (), recover=False).items():
                self.places[k] = Place(k, info["host"], info["ip"], info["pid"], info["device"])
        except BaseException:
            self.close()
            raise

    def submit(self, k: int, method: str, *args: Any) -> Any:
        return getattr(self.actors[k], method).remote(*args)

    def wait(self, k: int, future: Any) -> Any:
        from qwen2om.runtime.standalone import ray_reason

        ray = self.ray
        try:
            return ray.get(future, timeout=self.seconds)
        except ray.exceptions.GetTimeoutError:
            raise CalibrationError(f"{self.places[k]} did not answer within {self.seconds:g} s "
                                   "($QWEN2OM_RAY_CALL_TIMEOUT)") from None
        except ray.exceptions.RayActorError as e:
            raise WorkerLost(k, ray_reason(e)) from None
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, CalibrationError):
                raise cause from None
            raise CalibrationError(f"{self.places[k]}: {ray_reason(e)}") from None

    def share(self, value: Any) -> list[Any]:
        self.moved += nbytes(value) * len(self.live)  # put once; each worker fetches it (once) when it needs it
        return [self.ray.put(value)]

    def kill(self, k: int) -> None:
        """Stop worker `k` at once, as a crash would (tests, and the benchmark's fault run)."""
        self.ray.kill(self.actors[k], no_restart=True)

    def close(self) -> None:
        for a in self.actors:
            with contextlib.suppress(Exception):
                self.ray.kill(a, no_restart=True)
        self.actors = []
        if getattr(self, "started", False):
            with contextlib.suppress(Exception):
                self.ray.shutdown()
            self.started = False


def _seconds(name: str, default: float) -> float:
    from qwen2om.runtime.standalone import RuntimeInputError, seconds_from_env

    try:
        return seconds_from_env(name, default)
    except RuntimeInputError as e:
        raise CalibrationError(str(e)) from None


def open_pool(header: LayerTensors, settings: Settings, *, distributed: str | None, workers: int,
              address: str | None) -> Pool:
    if distributed is None:
        return LocalPool(header, settings)
    if distributed != "ray":
        raise CalibrationError(f"unknown --distributed {distributed!r} (known: ray)")
    return RayPool(header, settings, workers, address)

