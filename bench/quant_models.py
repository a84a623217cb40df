"""W4A16 quality across the trained builtins: qwen2om RTN / GPTQ / AWQ against llm-compressor GPTQ, per
model, over several calibration sample sets, with the spread.

    .venv/bin/python bench/quant_models.py                 # the three trained builtins, 3 sets of 128 × 512, every row
    .venv/bin/python bench/quant_models.py --models builtin:tiny-qwen3-trained --sets 2 --num-samples 4 \\
        --seq-len 64 --rows rtn,gptq,llmc                  # a smoke run (numbers meaningless)

For each model and each calibration set, every row calibrates in a child process (timed there: the
tool's own report, and the process's wall time), then it is scored against the float model on that
model's held-out text with `qwen2om eval agree`'s pieces (qwen2om.evaluate: Scorer, windows, nll; the
float model's log-probabilities computed once per model): perplexity (non-overlapping windows), top-1
agreement and mean KL(float ‖ quantised) per position. Each window's negative log-likelihood is kept, so
a Δppl gets the standard error of the held-out text's sampling (window to window), and qwen2om GPTQ
minus llm-compressor GPTQ a paired one (the same windows) beside the set-to-set one (which also holds
how each calibration sample happens to round, the larger noise here); the paired KL difference likewise.
Each row prints mean ± sd and min–max over the sets of Δppl (vs the float model), top-1 agreement, mean
KL and calibration seconds, then one line per model: is qwen2om GPTQ's mean Δppl ≤ llm-compressor's? RTN
reads no data, so it runs once per model (n = 1).

Calibration sets (deterministic, disjoint): the model's own training text (`train_text()` of its
corpus in qwen2om/fixtures/trained.py, which never holds a held-out paragraph) is cut at blank lines
into blocks of at least BLOCK_CHARS characters; block i goes to set i mod --sets, and each set's blocks
are written, in order, one `{"text": block}` record each, to one JSONL file. Every set is a
stretch-by-stretch sample of the same corpus and no two share a block; windows pack the blocks joined
by end-of-text (they are not contiguous text), and a set's windows come from its first blocks (reading
stops once --num-samples windows are full, so qwen2om tokenises only what it uses). Both tools see
identical token windows: qwen2om calibrates with `--dataset SET.jsonl` and cuts its windows itself
with `qwen2om.datasets.windows`; this script calls the same function on the same file and hands
llm-compressor those windows as a JSON list of token ids (bench/llmcompressor_w4a16.py). qwen2om runs
through `--trace-windows`, which records the sha256 of the windows its calibration actually used; the
script stops if it differs from llm-compressor's.

Calibration seconds are each tool's own: qwen2om's report (opening the model, reading and tokenising
the set, the layers), llm-compressor's `oneshot` (on the given token ids); the JSON also has each
child process's wall time.

llm-compressor lives in its own environment, `.venv-llmc` (see bench/llmcompressor_w4a16.py); without
it the llmc row says so and the verdict line cannot be drawn.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from quant_quality import LLMC_PY, ROOT, run

MODELS = ("builtin:tiny-qwen3-trained", "builtin:tiny-qwen3-code", "builtin:tiny-qwen3-zh")
ROWS = {"rtn": "qwen2om rtn", "gptq": "qwen2om gptq", "gptq-clip": "qwen2om gptq --clip-search",
        "gptq-fisher": "qwen2om gptq --hessian fisher", "gptq-fisher-heads": "qwen2om gptq --hessian fisher-heads",
        "awq": "qwen2om awq", "llmc": "llm-compressor gptq"}
FLAGS = {"gptq-clip": ["--method", "gptq", "--clip-search"],  # a row's calibrate flags (default: --method ROW)
         "gptq-fisher": ["--method", "gptq", "--hessian", "fisher"],
         "gptq-fisher-heads": ["--method", "gptq", "--hessian", "fisher-heads"]}
GPTQ_ROWS = [r for r in ROWS if r.startswith("gptq")]  # each gets its paired difference from llm-compressor
BLOCK_CHARS = 4096
MAX_JSON = 64 << 20  # a recorded run is kilobytes; refuse reading something else whole


# -- per-model text: the two functions to adapt when a model's texts come from elsewhere -------------
def _corpus(model: str) -> Any:
    from qwen2om.fixtures import trained

    corpus = trained.CORPORA.get(model.removeprefix("builtin:"))
    if corpus is None:
        known = ", ".join("builtin:" + name for name in trained.CORPORA)
        raise SystemExit(f"{model}: not a trained builtin (known: {known})")
    return corpus


def heldout_text(model: str) -> str:
    """The text `model` is scored on: its corpus's held-out split (never trained on)."""
    return _corpus(model).heldout_text()


def calibration_text(model: str) -> str:
    """The text calibration sets are cut from: its corpus's training split (disjoint from the held-out)."""
    return _corpus(model).train_text()


# -- calibration sets ----------------------------------------------------------------------------------
def ids_sha256(samples: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(samples, separators=(",", ":")).encode()).hexdigest()


def split_sets(text: str, sets: int, block_chars: int = BLOCK_CHARS) -> list[list[str]]:
    """`text` cut at blank lines into blocks of at least `block_chars` characters, dealt round-robin."""
    blocks: list[str] = []
    cur: list[str] = []
    size = 0
    for para in text.split("\n\n"):
        cur.append(para)
        size += len(para) + 2
        if size >= block_chars:
            blocks.append("\n\n".join(cur))
            cur, size = [], 0
    if cur:
        blocks.append("\n\n".join(cur))
    return [blocks[k::sets] for k in range(sets)]


def write_set(path: Path, blocks: list[str]) -> Path:
    """A calibration set as the JSONL both tools read: one `{"text": block}` record a block, in order."""
    path.write_text("".join(json.dumps({"text": b}, ensure_ascii=False) + "\n" for b in blocks))
    return path


def read_json(path: Path, what: str) -> Any:
    """A recorded run's JSON, or a clear refusal (not a regular file — a FIFO would block —, unreadable, not JSON)."""
    if not path.is_file():
        raise SystemExit(f"{path}: not a regular file; expected {what}")
    if path.stat().st_size > MAX_JSON:
        raise SystemExit(f"{path}: {path.stat().st_size:,} bytes, too large for {what} ({MAX_JSON:,} at most)")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"{path}: not {what} ({e})") from None


# -- one calibration each ----------------------------------------------------------------------------
def qwen2om_calibrate(row: str, src: Path, out: Path, dataset: Path | None, args: argparse.Namespace
                      ) -> dict[str, Any]:
    """qwen2om calibrate in a child process; with data, through --trace-windows (its windows' sha256)."""
    cmd = ["calibrate", str(src), "-o", str(out), *FLAGS.get(row, ["--method", row]), "--group-size",
           str(args.group_size), "--force"]
    trace = out.with_name(out.name + ".windows.sha256")
    trace.unlink(missing_ok=True)
    if dataset is not None:
        cmd += ["--dataset", str(dataset), "--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len)]
    wall, _ = run([sys.executable, str(Path(__file__).resolve()), "--trace-windows", str(trace), "--", *cmd])
    report = json.loads((out / "calibration_report.json").read_text())
    return {"seconds": report["seconds"], "wall": round(wall, 2),
            "windows_sha256": trace.read_text().strip() if dataset is not None else None}


def llmc_calibrate(src: Path, out: Path, ids: Path, args: argparse.Namespace) -> dict[str, Any]:
    wall, stdout = run([str(LLMC_PY), "bench/llmcompressor_w4a16.py", "--model", str(src), "--samples", str(ids),
                        "--out", str(out), "--group-size", str(args.group_size)])
    reported = json.loads(stdout.strip().splitlines()[-1])
    return {"seconds": reported["seconds"], "wall": round(wall, 2),
            "windows_sha256": ids_sha256(json.loads(ids.read_text()))}


def traced_calibrate(trace: str, argv: list[str]) -> None:
    """`qwen2om ARGV`, writing to `trace` the sha256 of the token windows calibration cuts (child process)."""
    import qwen2om.quant.calibrate as cal
    from qwen2om.cli import main

    cut = cal.windows

    def windows(*a: Any, **k: Any) -> Any:
        w = cut(*a, **k)
        Path(trace).write_text(ids_sha256(w.samples) + "\n")
        return w

    cal.windows = windows
    sys.argv = ["qwen2om", *argv]
    main()


# -- scoring -------------------------------------------------------------------------------------------
class Judge:
    """`qwen2om eval agree`'s measures (qwen2om.evaluate: Scorer, the same windows, window_agreement, nll) of a
    checkpoint against the float model, with the float model's log-probabilities computed once per model
    and each window's negative log-likelihood kept, so that differences get a standard error."""

    def __init__(self, src: Path, heldout: Path, window: int, max_windows: int) -> None:
        from qwen2om.datasets import windows
        from qwen2om.evaluate import Scorer, nll

        self.samples = windows(str(heldout), src, num_samples=max_windows, seq_len=window).samples
        ref = Scorer(src)
        try:
            self.ref = [ref(ids) for ids in self.samples]
        finally:
            ref.close()
        self.ref_nll = [nll(lp, ids) for lp, ids in zip(self.ref, self.samples, strict=True)]
        self.tokens = sum(len(ids) - 1 for ids in self.samples)

    def __call__(self, out: Path) -> dict[str, Any]:
        from qwen2om.evaluate import Scorer, nll, window_agreement

        model = Scorer(out)
        agree = kl = 0.0
        window_nll: list[float] = []
        try:
            for ids, lb in zip(self.samples, self.ref, strict=True):
                fa = model(ids)
                same, div = window_agreement(fa, lb)
                agree, kl = agree + same, kl + div
                window_nll.append(nll(fa, ids))
        finally:
            model.close()
        return {"ppl": math.exp(sum(window_nll) / self.tokens), "ref_ppl": math.exp(sum(self.ref_nll) / self.tokens),
                "top1": agree / self.tokens, "kl": kl / self.tokens, "tokens": self.tokens,
                "window_dnll": [a - b for a, b in zip(window_nll, self.ref_nll, strict=True)]}


def dppl_se(r: dict[str, Any], window_dnll: list[float]) -> float:
    """The standard error of a Δppl from the held-out text's sampling, window to window: Δppl ≈ ppl ·
    Σ Δnll / tokens, so ppl / (tokens per window) · sd(per-window Δnll) / √windows."""
    d = window_dnll
    return r["ref_ppl"] / (r["tokens"] / len(d)) * statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else 0.0


def between_sets_se(values: list[float]) -> float:
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan


def paired(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Δppl(a) − Δppl(b) and KL(a) − KL(b) over the sets both rows ran, and the mean difference's standard
    errors from its two samples. Every set is scored on the same held-out windows, so the held-out text's
    sampling error is shared by the sets and does not shrink with them: `se_heldout` takes each window's
    Δnll difference averaged over the sets, then window to window (per set, `per_set_se`, the same on
    that set alone). `se_sets`: set to set, sd(per-set differences)/√n — which calibration sample a tool
    was given decides how its weights round. `se`: both, √(se_heldout² + se_sets²), a little
    conservative (each set's difference also carries some held-out noise)."""
    sets = {r["set"]: r for r in b}
    diffs, ses, kls, windows = [], [], [], []
    for r in a:
        other = sets.get(r["set"])
        if other is None:
            continue
        diffs.append((r["ppl"] - r["ref_ppl"]) - (other["ppl"] - other["ref_ppl"]))
        windows.append([x - y for x, y in zip(r["window_dnll"], other["window_dnll"], strict=True)])
        ses.append(dppl_se(r, windows[-1]))
        kls.append(r["kl"] - other["kl"])
    if not diffs:
        return None
    heldout = dppl_se(a[0], [statistics.fmean(w) for w in zip(*windows, strict=True)])
    between = between_sets_se(diffs) if len(diffs) > 1 else 0.0
    return {"mean": statistics.fmean(diffs), "se": math.hypot(heldout, between), "se_heldout": heldout,
            "se_sets": between, "n": len(diffs), "per_set": diffs, "per_set_se": ses,
            "kl_mean": statistics.fmean(kls), "kl_se_sets": between_sets_se(kls), "kl_per_set": kls}


# -- summary -------------------------------------------------------------------------------------------
def spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def summarise(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    return {"dppl": spread([r["ppl"] - r["ref_ppl"] for r in results]),
            "dppl_se": spread([dppl_se(r, r["window_dnll"]) for r in results]),
            "top1": spread([r["top1"] for r in results]),
            "kl": spread([r["kl"] for r in results]), "seconds": spread([r["seconds"] for r in results]),
            "wall": spread([r["wall"] for r in results])}


def cells(s: dict[str, float], fmt: str, scale: float = 1.0) -> str:
    m, sd, lo, hi = (s[k] * scale for k in ("mean", "sd", "min", "max"))
    return f"{m:{fmt}} ± {sd:{fmt.lstrip('+')}} | {lo:{fmt}} – {hi:{fmt}}"


def print_model(m: dict[str, Any], sets: int) -> None:
    print(f"\n{m['model']}: float perplexity {m['float_ppl']:.3f} on {m['heldout_tokens']} held-out tokens; "
          f"{sets} calibration sets × {m['samples']} windows × {m['seq_len']} tokens of its training text")
    print("| tool | n | Δ ppl mean ± sd | Δ ppl min – max | one run's Δ ppl SE | top-1 % mean ± sd | "
          "top-1 % min – max | mean KL mean ± sd | KL min – max | calibration s mean ± sd | s min – max |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row, s in m["summary"].items():
        if "error" in s:
            print(f"| {ROWS[row]} | 0 | {s['error']} | | | | | | | | |")
            continue
        print(f"| {ROWS[row]} | {s['dppl']['n']} | {cells(s['dppl'], '+.4f')} | {s['dppl_se']['mean']:.4f} | "
              f"{cells(s['top1'], '.2f', 100)} | "
              f"{cells(s['kl'], '.2e')} | {cells(s['seconds'], '.1f')} |")
    print(m["verdict"])


def verdict(model: str, summary: dict[str, dict[str, Any]]) -> tuple[str, bool | None]:
    ours, theirs = summary.get("gptq", {}).get("dppl"), summary.get("llmc", {}).get("dppl")
    if ours is None or theirs is None:
        return f"{model}: no verdict (needs both the gptq and llmc rows)", None
    ok = ours["mean"] <= theirs["mean"]
    line = (f"{model}: qwen2om GPTQ mean Δppl {ours['mean']:+.4f} {'≤' if ok else '>'} llm-compressor's "
            f"{theirs['mean']:+.4f}: {'yes' if ok else 'NO'}")
    if d := summary["gptq"].get("vs_llmc"):
        line += f" ({difference(d)})"
    for row in GPTQ_ROWS[1:]:
        if d := summary.get(row, {}).get("vs_llmc"):
            line += f"\n{model}: {ROWS[row]} minus llm-compressor GPTQ: {difference(d)}"
    return line, ok


def difference(d: dict[str, Any]) -> str:
    """A paired difference in words: Δppl with its standard error (and that error's two parts), whether it
    is beyond twice that, and the KL difference with its set-to-set error (KL's held-out error is small)."""
    each = ", ".join(f"{x:+.4f} ± {e:.4f}" for x, e in zip(d["per_set"], d["per_set_se"], strict=True))
    beyond = "beyond" if abs(d["mean"]) > 2 * d["se"] else "within"
    return (f"Δppl difference {d['mean']:+.4f} ± {d['se']:.4f} ({beyond} 2 SE; held-out text "
            f"± {d['se_heldout']:.4f}, set to set ± {d['se_sets']:.4f}) over {d['n']} sets, per set {each}; "
            f"mean KL difference {d['kl_mean']:+.2e} ± {d['kl_se_sets']:.2e} set to set")


def conclude(model: str, rows: list[str], results: dict[str, list[dict[str, Any]]], errors: dict[str, str]
             ) -> tuple[dict[str, dict[str, Any]], str, bool | None]:
    """Each row's summary over the sets, each qwen2om GPTQ row's paired difference from llm-compressor's,
    and the verdict line."""
    summary: dict[str, dict[str, Any]] = {row: {"error": errors[row]} if row in errors else summarise(results[row])
                                          for row in rows}
    if results.get("llmc") and "llmc" not in errors:
        for row in GPTQ_ROWS:
            if results.get(row) and row not in errors:
                summary[row]["vs_llmc"] = paired(results[row], results["llmc"])
    line, ok = verdict(model, summary)
    return summary, line, ok


def report(path: Path) -> int:
    """Print an earlier run's tables again from its --json: its measurements, this script's statistics."""
    run = read_json(path, "a --json file of this benchmark")
    try:
        models = run["models"]
    except (KeyError, TypeError) as e:
        raise SystemExit(f"{path}: not a --json file of this benchmark ({e})") from None
    for m in models:
        rows = [r for r in ROWS if r in m["summary"]]
        errors = {r: s["error"] for r, s in m["summary"].items() if "error" in s}
        m["summary"], m["verdict"], m["gptq_at_least_as_good"] = conclude(m["model"], rows, m["results"], errors)
        print_model(m, len(m["sets"]))
    print(f"\n(measured in {run.get('seconds', '?')} s; re-summarised from {path})")
    return 0


# -- main ----------------------------------------------------------------------------------------------
def bench_model(model: str, rows: list[str], args: argparse.Namespace) -> dict[str, Any]:
    from qwen2om.builtin import resolve_model
    from qwen2om.datasets import windows

    src = resolve_model(model)
    work = args.workdir / model.removeprefix("builtin:")
    work.mkdir(parents=True, exist_ok=True)
    heldout = work / "heldout.txt"
    heldout.write_text(heldout_text(model))
    set_texts = split_sets(calibration_text(model), args.sets)
    results: dict[str, list[dict[str, Any]]] = {row: [] for row in rows}
    errors: dict[str, str] = {}
    sets: list[dict[str, Any]] = []

    judge = Judge(src, heldout, args.window, args.windows)

    def score(row: str, out: Path, timing: dict[str, Any], index: int | None) -> None:
        t0 = time.perf_counter()
        q = judge(out)
        results[row].append({"set": index, **timing, **q, "eval_seconds": round(time.perf_counter() - t0, 2)})
        log(f"  {ROWS[row]}: Δppl {q['ppl'] - q['ref_ppl']:+.4f}, top-1 {q['top1']:.2%}, KL {q['kl']:.2e}, "
            f"calibration {timing['seconds']:.1f} s (wall {timing['wall']:.1f} s), "
            f"eval {time.perf_counter() - t0:.1f} s")

    if "rtn" in rows:  # data-free: the same checkpoint whatever the set, so once
        log(f"{model}: rtn")
        out = work / "rtn"
        score("rtn", out, qwen2om_calibrate("rtn", src, out, None, args), None)
    if "llmc" in rows and not LLMC_PY.exists():
        errors["llmc"] = f"{LLMC_PY} not found (see bench/llmcompressor_w4a16.py)"
    for k, blocks in enumerate(set_texts):
        dataset = write_set(work / f"set-{k}.jsonl", blocks)
        data = windows(str(dataset), src, num_samples=args.num_samples, seq_len=args.seq_len)
        for note in data.notes:
            log(f"{model} set {k}: {note}")
        ids = work / f"set-{k}.ids.json"
        ids.write_text(json.dumps(data.samples))
        sha = ids_sha256(data.samples)
        sets.append({"set": k, "file": str(dataset), "blocks": len(blocks), "documents_read": data.documents,
                     "samples": len(data.samples), "text_sha256": data.sha256, "windows_sha256": sha})
        log(f"{model}: set {k} ({len(data.samples)} × {args.seq_len} tokens, windows sha256 {sha[:16]}…)")
        for row in rows:
            if row == "rtn" or row in errors:
                continue
            out = work / f"set-{k}" / row
            out.parent.mkdir(exist_ok=True)
            stamp = out.with_name(out.name + ".timing.json")  # beside OUT: the tools own OUT's contents
            same = {"windows_sha256": sha, "group_size": args.group_size}
            if row in args.reuse and stamp.exists() and same.items() <= json.loads(stamp.read_text()).items():
                timing = json.loads(stamp.read_text())
                log(f"  {ROWS[row]}: reusing {out} (calibrated on these windows earlier)")
            else:
                stamp.unlink(missing_ok=True)
                timing = (llmc_calibrate(src, out, ids, args) if row == "llmc"
                          else qwen2om_calibrate(row, src, out, dataset, args))
                stamp.write_text(json.dumps({**timing, "group_size": args.group_size}))
            if timing["windows_sha256"] != sha:
                raise SystemExit(f"{model} set {k}: {ROWS[row]} calibrated on windows sha256 "
                                 f"{timing['windows_sha256']}, not the set's {sha}")
            score(row, out, timing, k)
    summary, line, ok = conclude(model, rows, results, errors)
    first = next((r for rs in results.values() for r in rs), {"ref_ppl": float("nan"), "tokens": "?"})
    return {"model": model, "source": str(src), "float_ppl": first["ref_ppl"], "heldout_tokens": first["tokens"],
            "samples": args.num_samples, "seq_len": args.seq_len, "sets": sets, "results": results,
            "summary": summary, "verdict": line, "gptq_at_least_as_good": ok}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--trace-windows"]:  # the child process of qwen2om_calibrate
        traced_calibrate(argv[1], argv[3:] if argv[2:3] == ["--"] else argv[2:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated trained builtins")
    ap.add_argument("--sets", type=int, default=3, help="disjoint calibration sample sets per model")
    ap.add_argument("--num-samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {', '.join(ROWS)}")
    ap.add_argument("--window", type=int, default=256, help="held-out window (tokens)")
    ap.add_argument("--windows", type=int, default=256, help="held-out windows at most (fewer if the text is short; "
                    "the three builtins' held-out texts are 9k, 21k and 49k tokens)")
    ap.add_argument("--workdir", type=Path, default=ROOT / ".cache" / "bench" / "quant-models")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--reuse", default="", help="comma-separated rows whose checkpoints from an earlier run on the "
                    "same windows are scored again instead of recalibrated (e.g. llmc, while changing qwen2om)")
    ap.add_argument("--report", type=Path, metavar="JSON", help="print the tables of an earlier run's --json again "
                    "(its measurements, this script's statistics); calibrates and scores nothing")
    args = ap.parse_args(argv)
    if args.report:
        return report(args.report)
    args.workdir = args.workdir.resolve()  # the children run in the repository root
    rows = args.rows.split(",")
    args.reuse = [r for r in args.reuse.split(",") if r]
    if unknown := [r for r in rows if r not in ROWS]:
        ap.error(f"unknown rows {unknown} (known: {', '.join(ROWS)})")
    if args.sets < 1:
        ap.error("--sets must be at least 1")
    t0 = time.perf_counter()
    done: list[dict[str, Any]] = []
    for model in args.models.split(","):
        done.append(bench_model(model, rows, args))
        if args.json:  # after every model, so that a long run keeps what it has
            args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "models": done,
                                             "seconds": round(time.perf_counter() - t0, 1)}, indent=2))
    print(f"group {args.group_size} symmetric; held-out windows of {args.window} tokens (at most {args.windows}); "
          f"Δ ppl = quantised − float perplexity; KL(float ‖ quantised) in nats per position")
    for m in done:
        print_model(m, args.sets)
    print(f"\nwall time {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
