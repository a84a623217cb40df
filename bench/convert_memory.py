#!/usr/bin/env python3
"""Conversion memory benchmark: peak RSS and wall time of turning a Qwen checkpoint into ONNX.

Each measurement converts one synthetic checkpoint (random bf16 weights with published Qwen3 shapes,
`qwen2om.fixtures.synthetic`, cached under `--workdir`) with one tool at one precision, in a fresh
child process:

- `qwen2om`: `qwen2om convert CKPT -o OUT --dtype D --max-seq-len P --prefill-chunk T --force`
  (static prefill and decode graphs with a KV cache of capacity P);
- `torch-export`: what users do today, `AutoModelForCausalLM.from_pretrained(CKPT, dtype=D)` then
  `torch.onnx.export(model, (input_ids, attention_mask), dynamo=True)` of the cache-less forward
  (`use_cache=False`, example input [1, T]) and `ONNXProgram.save(..., external_data=True)`;
- `ort-genai`: ONNX Runtime GenAI's model builder,
  `python -m onnxruntime_genai.models.builder -i CKPT -o OUT -p D -e cpu -c CACHE` (dynamic shapes;
  it has no capacity option, so P does not apply to it).

Why a child process and `ru_maxrss`
    The peak resident set size is read from `os.wait4`'s rusage of that child when it exits: the
    kernel's own high-water mark, exact (no sampling can miss a short spike), and the child's alone
    (not this process, not earlier measurements; for a child that itself forks, Linux reports the
    largest of it and its waited-for descendants). A fresh interpreter also means every tool pays
    its own imports and nothing is cached between measurements.

How to read the numbers
    RSS counts *file-backed* pages too: a memory-mapped safetensors shard or ONNX data file that has
    been read is resident, although the kernel can drop those pages at any time without swapping.
    So next to the exact RSS peak the table has the peak of `RssAnon` (anonymous memory, what really
    has to fit), polled from /proc/PID/status every `--poll-s` seconds over the child and its
    descendants; a polled peak can miss a spike shorter than the interval, so it is a lower bound.
    - qwen2om memory-maps the checkpoint and its output data file (ONNX Runtime checks the graphs
      at the end), so its RSS includes mapped file pages; RssAnon is its real footprint.
    - torch-export materialises the whole model in D (transformers copies the bf16 shards into new
      tensors), the exported program and the serialised protobuf: almost all anonymous, RSS ~ RssAnon.
    - ort-genai loads the model with `from_pretrained` in the checkpoint's own dtype (bf16 tensors
      stay views of the mapped shards, i.e. file-backed) and converts weights as it writes them, so
      its RSS is about RssAnon plus the mapped checkpoint.
    Wall time is the child's whole life (imports included). Another process busy on the same cores
    inflates it; the peak RSS does not depend on CPU contention.

Safety on a shared machine: a child is killed (its whole process group) and the case recorded as
aborted when the machine's MemAvailable drops below `--min-free-gib` or the child's polled RSS passes
`--max-rss-gib`; a case whose RSS, extrapolated from a smaller finished case of the same tool and
precision, would pass `--max-rss-gib` is skipped with that reason. Outputs are deleted after each
measurement unless `--keep`.

    .venv/bin/python bench/convert_memory.py --torch-export --ort-genai --json .cache/bench/base.json
    .venv/bin/python bench/convert_memory.py --qwen2om --qwen2om-rev HEAD --json .cache/bench/q.json
    .venv/bin/python bench/convert_memory.py --render .cache/bench/base.json .cache/bench/q.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
BF16_BYTES = 2
BYTES_PER = {"fp32": 4, "fp16": 2, "int4": 0.5}

# torch-export, run as `python -c` in the child: the plain user path, timed per stage.
TORCH_EXPORT_CHILD = r"""
import json, resource, sys, time
from pathlib import Path
t0 = time.perf_counter()
import torch, transformers
ckpt, out, dtype, seq, report = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
stages = []
def mark(name, t):
    stages.append([name, time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024])
    return time.perf_counter()
t = mark("import", t0)
model = transformers.AutoModelForCausalLM.from_pretrained(
    ckpt, dtype={"fp32": torch.float32, "fp16": torch.float16}[dtype]).eval()
model.config.use_cache = False
t = mark("load", t)
ids = torch.zeros(1, seq, dtype=torch.int64)
mask = torch.ones(1, seq, dtype=torch.int64)
with torch.no_grad():
    prog = torch.onnx.export(model, (ids, mask), dynamo=True, opset_version=18,
                             input_names=["input_ids", "attention_mask"], output_names=["logits"])
t = mark("export", t)
out.mkdir(parents=True, exist_ok=True)
prog.save(str(out / "model.onnx"), external_data=True)
t = mark("save", t)
Path(report).write_text(json.dumps({"stages": stages}))
"""


# -- what is measured -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    """A synthetic checkpoint: preset shapes with `layers` decoder layers."""

    preset: str
    layers: int
    seed: int = 0

    @property
    def key(self) -> str:
        return f"{self.preset}-L{self.layers}"

    @classmethod
    def parse(cls, text: str) -> Case:
        """`qwen3-1.7b:14` or `1.7b:14`."""
        preset, _, layers = text.partition(":")
        if not layers.isdigit():
            raise argparse.ArgumentTypeError(f"case {text!r}: expected PRESET:LAYERS, e.g. qwen3-1.7b:14")
        return cls(preset if preset.startswith("qwen3-") else f"qwen3-{preset}", int(layers))


@dataclasses.dataclass(frozen=True)
class Job:
    """Everything one measurement needs: the command, its environment and working directory."""

    tool: str
    case: Case
    dtype: str
    cmd: list[str]
    out: Path
    env: dict[str, str]
    cwd: Path
    report: Path | None = None  # a JSON the child writes about itself (stage timings), if any
    scratch: tuple[Path, ...] = ()  # deleted after the measurement as well


@dataclasses.dataclass(frozen=True)
class Tool:
    """A converter under test: the precisions it is run at and how to build its command."""

    name: str
    dtypes: tuple[str, ...]
    make_job: Callable[[Tool, Case, str, Path, Path, argparse.Namespace], Job]
    describe: str
    #: a regex over the child's output giving (stage name, seconds) when the tool prints its own stages
    stage_pattern: str | None = None


def _qwen2om_job(tool: Tool, case: Case, dtype: str, ckpt: Path, out: Path, a: argparse.Namespace) -> Job:
    env = dict(os.environ)
    if a.qwen2om_site:
        env["PYTHONPATH"] = str(a.qwen2om_site)
    cmd = [str(a.qwen2om_bin), "convert", str(ckpt), "-o", str(out), "--dtype", dtype,
           "--max-seq-len", str(a.max_seq_len), "--prefill-chunk", str(a.seq_len), "--force"]
    # cwd = the work directory: from the repository root a `python -m`/`-c` child would import the
    # local ./qwen2om folder ahead of the --qwen2om-rev install
    return Job(tool.name, case, dtype, cmd, out, env, out.parent)


def _torch_export_job(tool: Tool, case: Case, dtype: str, ckpt: Path, out: Path, a: argparse.Namespace) -> Job:
    report = out.parent / f"{out.name}.report.json"
    cmd = [sys.executable, "-c", TORCH_EXPORT_CHILD, str(ckpt), str(out), dtype, str(a.seq_len), str(report)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return Job(tool.name, case, dtype, cmd, out, env, REPO, report=report, scratch=(report,))


def _ort_genai_job(tool: Tool, case: Case, dtype: str, ckpt: Path, out: Path, a: argparse.Namespace) -> Job:
    cache = out.parent / f"{out.name}.cache"
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(ckpt), "-o", str(out),
           "-p", dtype, "-e", "cpu", "-c", str(cache)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    # cwd = the work directory, so nothing the builder writes relative to it lands in the repository
    return Job(tool.name, case, dtype, cmd, out, env, out.parent, scratch=(cache,))


TOOLS: dict[str, Tool] = {
    t.name: t
    for t in (
        Tool("qwen2om", ("fp32", "fp16"), _qwen2om_job,
             "qwen2om convert CKPT -o OUT --dtype D --max-seq-len P --prefill-chunk T --force",
             stage_pattern=r"^\S+ (\w+) ([0-9.]+)s$"),
        Tool("ort-genai", ("fp32", "fp16", "int4"), _ort_genai_job,
             "python -m onnxruntime_genai.models.builder -i CKPT -o OUT -p D -e cpu -c CACHE"),
        Tool("torch-export", ("fp32", "fp16"), _torch_export_job,
             "from_pretrained(dtype=D) + torch.onnx.export(dynamo=True, opset 18) of forward(input_ids, "
             "attention_mask), use_cache=False, example [1, T]; save(external_data=True)"),
    )
}
DEFAULT_CASES = ("qwen3-1.7b:4", "qwen3-1.7b:14", "qwen3-8b:4", "qwen3-1.7b:28")


# -- running a child ------------------------------------------------------------------------
@dataclasses.dataclass
class Result:
    """One measurement; `status` is "ok", "failed", "aborted" or "skipped" (then `error` says why)."""

    tool: str
    case: str
    dtype: str
    status: str
    params: int
    checkpoint_bytes: int
    peak_rss_bytes: int | None = None
    peak_anon_polled_bytes: int | None = None
    wall_s: float | None = None
    output_bytes: int | None = None
    returncode: int | None = None
    error: str = ""
    stages: list[list[Any]] = dataclasses.field(default_factory=list)
    log: str = ""


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def _mem_available() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


class Watch(threading.Thread):
    """Polls the child's process tree: peak summed RssAnon, and a kill switch on low memory."""

    def __init__(self, pid: int, poll_s: float, min_free: int, max_rss: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.poll_s, self.min_free, self.max_rss = pid, poll_s, min_free, max_rss
        self.peak_anon = 0
        self.abort_reason = ""
        self.done = threading.Event()

    def _tree(self) -> list[int]:
        try:
            return [self.pid] + [c.pid for c in psutil.Process(self.pid).children(recursive=True)]
        except psutil.Error:
            return []

    def run(self) -> None:
        while not self.done.wait(self.poll_s):
            anon = rss = 0
            for pid in self._tree():
                try:
                    anon += _status_kib(pid, "RssAnon:") * 1024
                    rss += _status_kib(pid, "VmRSS:") * 1024
                except (OSError, ValueError):
                    pass
            self.peak_anon = max(self.peak_anon, anon)
            free = _mem_available()
            if free < self.min_free:
                self.abort_reason = (f"aborted: MemAvailable {free / GIB:.1f} GiB < {self.min_free / GIB:.1f} GiB "
                                     f"(child RSS {rss / GIB:.1f} GiB)")
            elif rss > self.max_rss:
                self.abort_reason = f"aborted: child RSS {rss / GIB:.1f} GiB > limit {self.max_rss / GIB:.1f} GiB"
            if self.abort_reason:
                try:
                    os.killpg(self.pid, signal.SIGKILL)  # the child leads its own session/group
                except ProcessLookupError:
                    pass
                return


def run_measured(job: Job, log: Path, a: argparse.Namespace) -> tuple[int, float, int, int, str]:
    """Run the job's command in its own process group; (exit code, wall s, ru_maxrss bytes, polled
    RssAnon peak bytes, abort reason)."""
    with open(log, "w") as fh:
        fh.write("$ " + " ".join(job.cmd[:2] + ["<script>"] + job.cmd[3:] if job.cmd[1] == "-c" else job.cmd) + "\n")
        fh.flush()
        t0 = time.perf_counter()
        proc = subprocess.Popen(job.cmd, cwd=job.cwd, env=job.env, stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        watch = Watch(proc.pid, a.poll_s, int(a.min_free_gib * GIB), int(a.max_rss_gib * GIB))
        watch.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        watch.done.set()
        watch.join()
        proc.returncode = os.waitstatus_to_exitcode(status)  # wait4 reaped it; tell Popen
    return proc.returncode, wall, usage.ru_maxrss * 1024, watch.peak_anon, watch.abort_reason


def error_line(log: Path) -> str:
    """The most telling line of a failed run: the last exception line, else the last non-empty line."""
    lines = [ln.rstrip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    for ln in reversed(lines):
        head = ln.split(":", 1)[0].strip()
        if head.endswith(("Error", "Exception")) or head.startswith(("Error", "error")):
            return ln.strip()[:400]
    return lines[-1].strip()[:400] if lines else "(no output)"


def log_stages(tool: str, log: str) -> list[list[Any]]:
    """(name, seconds, None) per stage line the tool printed itself, e.g. qwen2om's `✓ export_onnx 13.2s`."""
    pattern = TOOLS[tool].stage_pattern if tool in TOOLS else None
    if not pattern or not log or not Path(log).is_file():
        return []
    return [[m[1], float(m[2]), None] for m in re.finditer(pattern, Path(log).read_text(errors="replace"), re.M)]


def dir_bytes(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


# -- checkpoints ----------------------------------------------------------------------------
def ensure_checkpoint(workdir: Path, case: Case) -> Path:
    """The cached synthetic checkpoint; written (in a child, streamed, < 1.5 GiB RSS) when absent."""
    dest = workdir / f"ckpt-{case.preset}-L{case.layers}-s{case.seed}"
    if (dest / "config.json").is_file() and (dest / "model.safetensors.index.json").is_file():
        return dest
    print(f"writing checkpoint {dest} ...", flush=True)
    subprocess.run([sys.executable, "-m", "qwen2om.fixtures.synthetic", case.preset, str(dest),
                    "--layers", str(case.layers), "--seed", str(case.seed)], cwd=REPO, check=True)
    return dest


def checkpoint_bytes(ckpt: Path) -> int:
    return int(json.loads((ckpt / "model.safetensors.index.json").read_text())["metadata"]["total_size"])


# -- qwen2om at a given commit --------------------------------------------------------------
def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout.strip()


def install_qwen2om_rev(workdir: Path, rev: str) -> tuple[Path, Path, str]:
    """Install the package as it is at `rev` into `workdir/qwen2om-SHA/site` (pip --target, no deps),
    so the measurement sees that commit and not a work tree someone is editing. Returns (site, the
    console script, full commit hash)."""
    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    root = workdir / f"qwen2om-{sha[:12]}"
    site, script = root / "site", root / "site" / "bin" / "qwen2om"
    if not script.is_file():
        remove(root)
        src = root / "src"
        src.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", "--format=tar", sha], cwd=REPO, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                        "--target", str(site), str(src)], check=True)
    return site, script, sha


# -- the plan -------------------------------------------------------------------------------
def predicted_peak(done: Sequence[Result], tool: str, dtype: str, params: int) -> tuple[int, str] | None:
    """Extrapolate peak RSS linearly in parameter count from the largest finished case of the same
    tool and precision (fixed overhead included, so it errs high for a bigger model)."""
    prior = [r for r in done if r.tool == tool and r.dtype == dtype and r.status == "ok" and r.peak_rss_bytes]
    if not prior:
        return None
    ref = max(prior, key=lambda r: r.params)
    assert ref.peak_rss_bytes is not None
    return int(ref.peak_rss_bytes * params / ref.params), ref.case


def measure(tool: Tool, case: Case, dtype: str, a: argparse.Namespace, done: Sequence[Result]) -> Result:
    ckpt = ensure_checkpoint(a.workdir, case)
    ckb = checkpoint_bytes(ckpt)
    params = ckb // BF16_BYTES
    res = Result(tool.name, case.key, dtype, "ok", params, ckb)
    guess = predicted_peak(done, tool.name, dtype, params)
    if guess and guess[0] > a.max_rss_gib * GIB:
        res.status = "skipped"
        res.error = (f"skipped: {guess[0] / GIB:.1f} GiB predicted from {guess[1]} "
                     f"(> {a.max_rss_gib:g} GiB limit)")
        return res
    out = a.workdir / f"out-{tool.name}-{case.key}-{dtype}"
    for p in (out, out.parent / f"{out.name}.cache", out.parent / f"{out.name}.report.json"):
        remove(p)
    job = tool.make_job(tool, case, dtype, ckpt, out, a)
    log = a.workdir / "logs" / f"{tool.name}-{case.key}-{dtype}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    res.log = str(log)
    print(f"[{time.strftime('%H:%M:%S')}] {tool.name} {case.key} {dtype} ...", flush=True)
    rc, wall, peak, anon, abort = run_measured(job, log, a)
    res.returncode, res.wall_s, res.peak_rss_bytes, res.peak_anon_polled_bytes = rc, wall, peak, anon
    res.output_bytes = dir_bytes(out)
    if abort:
        res.status, res.error = "aborted", abort
    elif rc:
        res.status, res.error = "failed", error_line(log)
    if job.report and job.report.is_file():
        res.stages = json.loads(job.report.read_text()).get("stages", [])
    res.stages = res.stages or log_stages(tool.name, res.log)
    if not a.keep:
        for p in (out, *job.scratch):
            remove(p)
    print(f"    {res.status}: peak RSS {peak / GIB:.2f} GiB, RssAnon (polled) {anon / GIB:.2f} GiB, "
          f"{wall:.0f} s {res.error}", flush=True)
    return res


def plan(a: argparse.Namespace) -> list[tuple[Tool, Case, str]]:
    """Cases in the given order (smallest first by default); within a case qwen2om, ort-genai, then
    torch-export, so the heaviest run (torch-export of the biggest case) comes last."""
    dtypes = [d for d in a.dtypes.split(",") if d]
    jobs = []
    for case in a.cases:
        for tool in TOOLS.values():
            if tool.name not in a.tools:
                continue
            wanted = [*dtypes, *(["int4"] if a.int4 else [])]
            jobs += [(tool, case, d) for d in wanted if d in tool.dtypes]
    return jobs


# -- reporting ------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    import importlib.metadata as md

    def version(name: str) -> str:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "-"

    cpu = ""
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpus": os.cpu_count(), "cpu": cpu, "mem_gib": round(psutil.virtual_memory().total / GIB, 1),
            "python": platform.python_version(), "kernel": platform.release(),
            **{p: version(p) for p in ("torch", "transformers", "onnx", "onnxruntime", "onnxscript",
                                       "onnxruntime-genai")}}


def _gib(b: int | None) -> str:
    return "—" if b is None else f"{b / GIB:.2f}"


def cell(r: Result | None) -> str:
    if r is None:
        return "—"
    if r.status == "ok":
        return f"{_gib(r.peak_rss_bytes)} / {_gib(r.peak_anon_polled_bytes)} / {r.wall_s:.0f} s"
    return r.status


def render(results: Sequence[Result], meta: dict[str, Any]) -> str:
    """A pivot (rows: checkpoint, columns: tool x precision) and the full list with errors."""
    # float columns per tool, then int4 as a side column (only ort-genai quantises)
    cols = [(t, d) for d in ("fp32", "fp16") for t in TOOLS] + [(t, "int4") for t in TOOLS]
    cols = [(t, d) for t, d in cols if any(r.tool == t and r.dtype == d for r in results)]
    cases = list(dict.fromkeys(r.case for r in results))
    label = {t: f"{t} @ {meta['qwen2om_commit'][:9]}" if t == "qwen2om" and meta.get("qwen2om_commit") else t
             for t in TOOLS}
    lines = ["| checkpoint | params | bf16 GiB | " + " | ".join(f"{label[t]} {d}" for t, d in cols) + " |",
             "|---|---:|---:|" + "---:|" * len(cols)]
    by = {(r.tool, r.case, r.dtype): r for r in results}
    for c in cases:
        any_r = next(r for r in results if r.case == c)
        row = [c, f"{any_r.params / 1e9:.2f}B", _gib(any_r.checkpoint_bytes)]
        row += [cell(by.get((t, c, d))) for t, d in cols]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Cells: peak RSS GiB (ru_maxrss, exact) / peak RssAnon GiB (polled) / wall time.", "",
              "| tool | checkpoint | dtype | status | peak RSS GiB | RssAnon GiB (polled) | wall s | output GiB "
              "| stages: s (ru_maxrss GiB after, where known) / error |",
              "|---|---|---|---|---:|---:|---:|---:|---|"]
    for r in results:
        detail = r.error or ", ".join(f"{n} {s:.0f} s" + (f" ({m / GIB:.1f})" if m else "")
                                      for n, s, m in r.stages or log_stages(r.tool, r.log))
        lines.append(f"| {label[r.tool]} | {r.case} | {r.dtype} | {r.status} | {_gib(r.peak_rss_bytes)} | "
                     f"{_gib(r.peak_anon_polled_bytes)} | {'—' if r.wall_s is None else f'{r.wall_s:.0f}'} | "
                     f"{_gib(r.output_bytes)} | {detail.replace('|', '/')} |")
    return "\n".join(lines)


def load(paths: Sequence[Path]) -> tuple[list[Result], dict[str, Any]]:
    results: list[Result] = []
    meta: dict[str, Any] = {}
    for p in paths:
        data = json.loads(p.read_text())
        results += [Result(**r) for r in data["results"]]
        for k, v in data["meta"].items():
            if not meta.get(k):  # first non-empty value wins (e.g. the qwen2om commit of the run that has one)
                meta[k] = v
    return results, meta


# -- main -----------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    for name in TOOLS:
        ap.add_argument(f"--{name}", action="store_true", help=f"measure {name} ({TOOLS[name].describe})")
    ap.add_argument("--cases", type=Case.parse, nargs="+", default=[Case.parse(c) for c in DEFAULT_CASES],
                    metavar="PRESET:LAYERS", help=f"checkpoints, in run order (default: {' '.join(DEFAULT_CASES)})")
    ap.add_argument("--dtypes", default="fp32,fp16", help="precisions, comma-separated (default fp32,fp16)")
    ap.add_argument("--no-int4", dest="int4", action="store_false", help="skip ort-genai's int4 side column")
    ap.add_argument("--max-seq-len", type=int, default=512, help="qwen2om KV capacity P (default 512)")
    ap.add_argument("--seq-len", type=int, default=128,
                    help="qwen2om prefill chunk T and torch-export's example length (default 128)")
    ap.add_argument("--qwen2om-rev", help="measure qwen2om as committed at REV (installed under --workdir), "
                                          "not the editable work tree")
    ap.add_argument("--workdir", type=Path, default=REPO / ".cache" / "bench")
    ap.add_argument("--keep", action="store_true", help="keep the conversion outputs")
    ap.add_argument("--min-free-gib", type=float, default=3.0, help="kill a child when MemAvailable drops below")
    ap.add_argument("--max-rss-gib", type=float, default=20.0, help="kill / skip a child above this RSS")
    ap.add_argument("--poll-s", type=float, default=0.2, help="RssAnon and watchdog polling interval")
    ap.add_argument("--json", type=Path, help="write results, machine and arguments as JSON")
    ap.add_argument("--render", type=Path, nargs="+", metavar="JSON", help="only print the tables of saved runs")
    a = ap.parse_args(argv)
    a.tools = [t for t in TOOLS if getattr(a, t.replace("-", "_"))] or list(TOOLS)
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    if a.render:
        print(render(*load(a.render)))
        return 0
    a.workdir = a.workdir.resolve()
    a.workdir.mkdir(parents=True, exist_ok=True)
    a.qwen2om_site, a.qwen2om_bin, commit = None, Path(sys.executable).parent / "qwen2om", ""
    if "qwen2om" in a.tools:
        if a.qwen2om_rev:
            a.qwen2om_site, a.qwen2om_bin, commit = install_qwen2om_rev(a.workdir, a.qwen2om_rev)
        else:
            dirty = git("status", "--porcelain", "--", "qwen2om", "passes", "kernels", "recipes", "fixtures")
            commit = git("rev-parse", "HEAD") + ("-dirty" if dirty else "")
    meta = {"machine": machine(), "qwen2om_commit": commit, "date": time.strftime("%Y-%m-%d %H:%M %Z"),
            "argv": sys.argv, "max_seq_len": a.max_seq_len, "seq_len": a.seq_len,
            "commands": {t: TOOLS[t].describe for t in a.tools}}
    results: list[Result] = []

    def save() -> None:
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps({"meta": meta, "results": [dataclasses.asdict(r) for r in results]},
                                         indent=1))

    for tool, case, dtype in plan(a):
        results.append(measure(tool, case, dtype, a, results))
        save()  # after every case: a long run that is stopped keeps what it measured
    print(render(results, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
