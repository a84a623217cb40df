"""The `qwen2om` command line: thin typer commands over library calls, rich output."""

from __future__ import annotations

import hashlib
import inspect as pyinspect
import json
import os
import re
import shlex
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rich.text import Text
from typer.core import TyperCommand, TyperGroup, TyperOption

from qwen2om.errors import Qwen2omError, caused_by_interrupt
from qwen2om.runtime.standalone import RuntimeInputError, printable

if TYPE_CHECKING:
    from qwen2om.inspect import CheckpointInfo


def without_flag_metavars(params: list[Any]) -> list[Any]:
    """Boolean flags take no value, but typer 0.29's rich help prints `<bool>` after each (`--force
    <bool>`): an empty metavar leaves their type column blank; other options keep theirs."""
    for p in params:
        if isinstance(p, TyperOption) and p.is_flag and p.metavar is None:
            p.metavar = ""
    return params


class Command(TyperCommand):
    """A command whose --help puts no `<bool>` after its flags."""

    def get_params(self, ctx: Any) -> list[Any]:
        return without_flag_metavars(super().get_params(ctx))


class Group(TyperGroup):
    """A command group whose --help puts no `<bool>` after its flags."""

    def get_params(self, ctx: Any) -> list[Any]:
        return without_flag_metavars(super().get_params(ctx))


app = typer.Typer(
    cls=Group,
    help="Turn Hugging Face Qwen checkpoints into static-shape ONNX models and Ascend offline models (.om); "
    "quantise, run, verify and evaluate them.\n\n"
    "MODEL is a checkpoint directory (config.json + safetensors) or builtin:NAME, a tiny model built "
    "offline (tiny-qwen2, tiny-qwen3, tiny-qwen3-moe, tiny-qwen3-5, tiny-qwen3-next, tiny-qwen3-trained, "
    "tiny-qwen3-fp8, …; an unknown NAME lists them all).",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
)
out_console = Console()
err = Console(stderr=True)


def _version(value: bool) -> None:
    if value:
        from qwen2om.output import tool_versions

        versions = tool_versions()
        out_console.print(f"qwen2om {versions.pop('qwen2om')}", highlight=False)
        out_console.print(", ".join(f"{k} {v}" for k, v in versions.items()), highlight=False, soft_wrap=True)
        raise typer.Exit()


@app.callback()
def _options(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                   help="print qwen2om's version and its tools', then exit")]
             = False) -> None:
    pass


class CountColumn(ProgressColumn):
    """`12/28` for counts, `1.2/6.8 GB` for a bar whose unit is bytes."""

    def render(self, task: Any) -> Text:
        if task.fields.get("unit") == "bytes":
            return DownloadColumn().render(task)
        return MofNCompleteColumn().render(task)


class RateColumn(ProgressColumn):
    def render(self, task: Any) -> Text:
        return TransferSpeedColumn().render(task) if task.fields.get("unit") == "bytes" else Text("")


@contextmanager
def progress_bar(enabled: bool = True) -> Iterator[Callable[..., None]]:
    """A progress callback `(label, done, total, unit="")` drawing one rich bar per label."""
    if not enabled or not err.is_terminal:
        yield lambda label, done, total, unit="": None
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), CountColumn(), RateColumn(),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=err, transient=True) as bars:
        tasks: dict[str, Any] = {}

        def update(label: str, done: int, total: int, unit: str = "") -> None:
            if label not in tasks:
                tasks[label] = bars.add_task(label, total=total, unit=unit)
            bars.update(tasks[label], completed=done, total=total)

        yield update


def plain(label: str, style: str, message: str) -> Text:
    """`label: message` for the terminal, the message as it is: not read as rich markup (a `[lo, hi]`
    in it would vanish) and with control characters escaped (names come from checkpoints and outputs)."""
    return Text.assemble((f"{label}:", style), " ", printable(message))


def shown(value: object) -> str:
    """A name from a checkpoint or output directory, safe to put in a rich markup string."""
    return escape(printable(str(value)))


def note(message: str) -> None:
    err.print(plain("note", "yellow", message), soft_wrap=True, highlight=False)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def as_typed(executable: str | Path) -> str:
    """How to type `executable` in this shell: its bare name when PATH finds this very file (not a
    namesake), else its path, relative to the working directory when under it."""
    path = Path(os.path.abspath(executable))
    found = shutil.which(path.name)
    if found and Path(os.path.abspath(found)) == path:
        return path.name
    if path.is_relative_to(Path.cwd()):
        rel = path.relative_to(Path.cwd())
        return shlex.quote(str(rel) if len(rel.parts) > 1 else f"./{rel}")
    return shlex.quote(str(path))


def qwen2om_command(argv0: str | None = None) -> str:
    """This qwen2om as the user can run it again: `qwen2om` when it is on PATH, else e.g.
    `.venv/bin/qwen2om` (a virtual environment that is not activated), or `python -m qwen2om`."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    if Path(argv0).name == "__main__.py":
        return f"{as_typed(sys.executable)} -m qwen2om"
    exe = argv0 if os.sep in argv0 else shutil.which(argv0)
    return as_typed(exe) if exe else "qwen2om"


def next_commands(out: Path, manifest: dict[str, Any]) -> list[str]:
    """What to do with a fresh output, as commands that work as typed here. run.py runs standard ONNX
    only: an Ascend output runs on CPU through `qwen2om run` (qwen2om's reference kernels), and through
    run.py only on the NPU (--backend acl), once its .om files are compiled."""
    qwen2om, o = qwen2om_command(), shlex.quote(str(out))
    run_py = f"{as_typed(sys.executable)} {shlex.quote(str(out / 'run.py'))}"
    commands = [f"{qwen2om} run {o} --prompt 'Hello' --greedy"]
    from qwen2om.targets import ORT, TARGETS

    target = TARGETS.get(manifest["recipe"].get("target", ORT.name))
    if not target.device_backend:
        return [*commands, f"{qwen2om} verify {o}", f"{run_py} --prompt 'Hello'"]
    compiled = any(s["pass"] == "compile_ascend" and s["stats"].get("compiled") for s in manifest.get("stages", []))
    return [*commands, f"{qwen2om} inspect {o} --check {target.name}", f"{qwen2om} verify {o}",
            *([f"{run_py} --backend {target.device_backend} --prompt 'Hello'"] if compiled else [])]


def as_set(value: object) -> str:
    """A typed recipe setting as `--set` spells it: gears (16, 32) → 16,32."""
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


@app.command()
def convert(
    model: Annotated[str, typer.Argument(help="checkpoint directory or builtin:NAME")],
    out: Annotated[Path, typer.Option("--out", "-o", help="output directory (built atomically)")],
    recipe: Annotated[str | None, typer.Option(help="bundled recipe (ort, ascend, or per family: qwen3-fp32, "
                                               "qwen3-ascend-fp16, ...) or YAML file; default: the target's, "
                                               "named <family>-<dtype>")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="recipe override key=value (repeatable)")] = None,
    dtype: Annotated[str | None, typer.Option(help="compute dtype: fp32 or fp16")] = None,
    max_seq_len: Annotated[int | None, typer.Option(help="KV cache capacity P (default 2048 or the model's "
                                                     "limit)")] = None,
    prefill_chunk: Annotated[int | None, typer.Option(help="tokens per prefill call (default 128)")] = None,
    batch_size: Annotated[int | None, typer.Option(help="static batch size (default 1)")] = None,
    target: Annotated[str | None, typer.Option(help="compile target: ort (ONNX Runtime, default) or ascend (ATC "
                                               "offline model; default dtype fp16)")] = None,
    soc_version: Annotated[str | None, typer.Option("--soc-version", help="--target ascend: the Ascend SoC, as "
                                                    "`npu-smi info` names it (e.g. Ascend910B3, Ascend310P3, "
                                                    "Ascend310B1); implies --target ascend")] = None,
    precision: Annotated[str | None, typer.Option(help="--target ascend: ATC --precision_mode_v2: origin (keep "
                                                  "the graph's dtypes, default), mixed_float16 or fp16")] = None,
    gears: Annotated[str | None, typer.Option(help="prefill chunk sizes one prefill graph serves, e.g. "
                                              "16,32,64,128 (the largest is the prefill chunk); each prompt chunk "
                                              "runs at the smallest that holds it, so a short prompt does not pay "
                                              "for a whole chunk. On Ascend they are compiled into one .om with "
                                              "ATC --dynamic_dims")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="--target ascend: write OUT/ascend/ (the atc "
                                          "commands and their files) without running atc, even if CANN is "
                                          "installed")] = False,
    scales: Annotated[str | None, typer.Option(help="quantised checkpoints: inputs (each weight's scale a graph "
                                               "input `<weight>.scale`, with scale_map.json + scales.safetensors), "
                                               "constants, or auto (default: inputs for FP8, constants for int4)"
                                               )] = None,
    force: Annotated[bool, typer.Option("--force", help="replace OUT if it exists (and discard an interrupted "
                                        "run's work)")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="continue an interrupted conversion into OUT: finished "
                                         "tensors are re-checked by hash and kept; source shards must be "
                                         "unchanged")] = False,
    workers: Annotated[int | None, typer.Option(help="threads for reading, converting, writing and hashing "
                                                "(default: all cores; capped at them)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the manifest summary as JSON")] = False,
    dump_graph: Annotated[bool, typer.Option("--dump-graph", help="write each graph after each pass to "
                                             "OUT/graphs/NN_<pass>.<kind>.txt (one line per node), to diff what "
                                             "each pass did")] = False,
    allow_unused: Annotated[bool, typer.Option("--allow-unused", help="leave out, with a warning, tensors "
                                               "config.json does not account for (default: refuse them)")] = False,
    stages: Annotated[str | None, typer.Option(help="cut the model into K pipeline stages (OUT/stages/NN/, one "
                                               "complete static model per device, layers split so stage bytes "
                                               "are balanced), or 'auto': the fewest that fit --device-memory "
                                               "(`qwen2om plan` shows the split first)")] = None,
    device_memory: Annotated[float | None, typer.Option("--device-memory", help="GiB per device, for --stages "
                                                        "(default with --soc-version: the SoC's memory)")] = None,
    only_stage: Annotated[int | None, typer.Option("--only-stage", help="with --stages: convert stage k only (each "
                                                   "host its own; copy the stages/NN folders into one OUT to run "
                                                   "them in one place)")] = None,
) -> None:
    """Convert MODEL into a static-shape ONNX output directory (manifest, graphs, tokenizer, run.py).

    OUT appears whole or not at all. Memory stays flat in the model size (weights are streamed).
    Interrupted (Ctrl-C, kill, full disk)? Rerun the same command with --resume.
    """
    import signal

    from qwen2om.convert import ConvertOptions
    from qwen2om.convert import convert as run_convert
    from qwen2om.recipe import parse_overrides, setting

    # `kill` (SIGTERM) stops a conversion as cleanly as Ctrl-C: finished work kept for --resume.
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    settings = parse_overrides(set_ or [])  # recipe field → typed value; the flags below win over --set
    if soc_version is not None and target is None:  # the target whose chips it names
        from qwen2om.targets import TARGETS

        target = next(t.name for t in TARGETS if t.socs)
    for key, value in (("dtype", dtype), ("max_seq_len", max_seq_len), ("prefill_chunk", prefill_chunk),
                       ("batch_size", batch_size), ("target", target), ("scales", scales),
                       ("soc_version", soc_version), ("precision", precision), ("gears", gears),
                       ("compile", "dry-run" if dry_run else None)):
        if value is None:
            continue
        # typed as --set's strings are (--gears 16,32 → (16, 32)); a bad value reads as the --set it stands for
        typed = setting(key, value.strip() if isinstance(value, str) else value, f"--set {key}={value}")
        if key in settings and settings[key] != typed:
            flag = "--dry-run" if key == "compile" else f"--{key.replace('_', '-')} {value}"
            note(f"{flag} overrides --set {key}={as_set(settings[key])}")
        settings[key] = typed
    options = ConvertOptions(recipe, settings, force=force, resume=resume, workers=workers, dump_graphs=dump_graph,
                             allow_unused=allow_unused, stages=stage_count(stages), device_memory=device_memory,
                             only_stage=only_stage)
    with progress_bar(not as_json) as progress:
        result = run_convert(model, out, options, progress=progress, log=note,
                             on_step=lambda s: None if as_json else err.print(
                                 f"[green]✓[/] {s.name} [dim]{s.seconds:.2f}s[/]"))
    m = result.manifest
    if "split" in m:
        print_split(out, m, as_json)
        return
    if as_json:
        print(json.dumps({k: m[k] for k in ("architecture", "recipe", "stages", "graphs", "files")}, indent=2))
        return
    table = Table(title=f"{model} → {out}", show_lines=False)
    for col in ("pass", "seconds", "changed", "what it did"):
        table.add_column(col)
    for s in m["stages"]:
        stats = ", ".join(f"{k}={v}" for k, v in s["stats"].items())
        table.add_row(s["pass"], f"{s['seconds']:.2f}", "yes" if s["modified"] else "no", stats)
    out_console.print(table)
    files = Table(title="files written")
    files.add_column("file")
    files.add_column("size", justify="right")
    for f in m["files"]:
        files.add_row(f["name"], fmt_bytes(f["bytes"]))
    # the manifest lists every file but itself
    files.add_row("manifest.json", fmt_bytes((out / "manifest.json").stat().st_size))
    out_console.print(files)
    rt = m["runtime"]
    shapes = [f"{k} (T={g['tokens']}" + (f", gears {','.join(map(str, g['gears']))})" if g.get("gears") else ")")
              for k, g in m["graphs"].items()]
    out_console.print(f"{m['architecture']} · {rt['dtype']} · cache capacity {rt['capacity']} · batch {rt['batch']} "
                      f"· graphs: " + ", ".join(shapes))
    out_console.print("next: " + "   |   ".join(next_commands(out, m)), soft_wrap=True, highlight=False)


def stage_count(value: str | None) -> int | str | None:
    """--stages: a count or "auto" (a bad word is the recipe error convert names)."""
    if value is None or value.strip() == "auto":
        return None if value is None else "auto"
    try:
        return int(value)
    except ValueError:
        from qwen2om.errors import RecipeError

        raise RecipeError(f"--stages takes a number of stages or 'auto', not {value!r}") from None


def print_split(out: Path, m: dict[str, Any], as_json: bool) -> None:
    """A staged OUT: one row per stage (layers, estimated device bytes, folder)."""
    split = m["split"]
    if as_json:
        print(json.dumps({k: m[k] for k in ("architecture", "recipe", "split", "files")}, indent=2))
        return
    table = Table(title=f"{out}: {split['count']} pipeline stages (split {split['id']})")
    for col in ("stage", "layers", "device bytes (est.)", "folder"):
        table.add_column(col)
    for s in split["stages"]:
        a, b = s["layers"]
        here = (out / s["dir"] / "manifest.json").is_file()
        table.add_row(str(s["index"]), f"{a}–{b - 1}", fmt_bytes(s["device_bytes"]),
                      s["dir"] + ("" if here else " (not converted here)"))
    out_console.print(table)
    rt = m["runtime"]
    out_console.print(f"{m['architecture']} · {rt['dtype']} · cache capacity {rt['capacity']} · batch {rt['batch']}")
    out_console.print("next: " + "   |   ".join(next_commands(out, m)), soft_wrap=True, highlight=False)


@app.command()
def run(
    out: Annotated[Path, typer.Argument(help="a qwen2om output directory")],
    prompt: Annotated[str | None, typer.Option(help="text to continue (default: Hello; with --messages, one more "
                                              "user turn if given)")] = None,
    ids: Annotated[str | None, typer.Option(help="comma-separated token ids instead of --prompt")] = None,
    prompts_file: Annotated[Path | None, typer.Option(help="a text file, one prompt per line, each continued on "
                                                      "its own (prompt i sampled with seed --seed + i); a staged "
                                                      "OUT with --distributed ray keeps up to one prompt per stage "
                                                      "in flight, so the stages work at the same time")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=0, help="stop after this many new tokens")] = 64,
    chat: Annotated[bool, typer.Option("--chat", help="format the prompt as a user turn with the model's chat "
                                       "template (OUT's chat_template.jinja or tokenizer_config.json; ChatML if "
                                       "it has none)")] = False,
    system: Annotated[str | None, typer.Option(help="system message (implies --chat)")] = None,
    messages: Annotated[Path | None, typer.Option(help="JSON file: the conversation so far, a list of {role, "
                                                  "content, ...} (tool_calls, role tool, reasoning_content); "
                                                  "implies --chat")] = None,
    tools: Annotated[Path | None, typer.Option(help="JSON file: a list of OpenAI-style tool schemas for the chat "
                                               "template (implies --chat)")] = None,
    enable_thinking: Annotated[bool | None, typer.Option("--enable-thinking/--no-thinking", help="enable_thinking "
                                                         "for the chat template (Qwen3: --no-thinking opens an "
                                                         "empty think block); default: the template's own; "
                                                         "implies --chat")] = None,
    print_prompt: Annotated[bool, typer.Option("--print-prompt", help="print the prompt text as the model would "
                                               "read it (the rendered chat template) and exit")] = False,
    greedy: Annotated[bool, typer.Option("--greedy", help="deterministic greedy decoding (= --temperature 0)")] = False,
    temperature: Annotated[float | None, typer.Option(help="sampling temperature (0 = greedy); default: the "
                                                      "checkpoint's generation_config.json, else 0.7",
                                                      show_default=False)] = None,
    top_k: Annotated[int | None, typer.Option(help="sample from the k most likely tokens (0 = all); default: the "
                                              "checkpoint's, else 20", show_default=False)] = None,
    top_p: Annotated[float | None, typer.Option(help="nucleus sampling mass; default: the checkpoint's, else 0.8",
                                                show_default=False)] = None,
    seed: Annotated[int, typer.Option(help="sampling seed")] = 0,
    truncate: Annotated[bool, typer.Option("--truncate", help="drop the oldest prompt tokens if too long")] = False,
    threads: Annotated[int, typer.Option(min=0, help="ONNX Runtime intra-op threads (0 = $QWEN2OM_THREADS, else "
                                                           "all cores)")] = 0,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="keep generating past EOS")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object instead of streaming")] = False,
    backend: Annotated[str, typer.Option(help="ort: ONNX Runtime on the .onnx graphs; acl: pyACL (CANN) on an "
                                         "Ascend NPU with OUT/ascend/model.<kind>.om")] = "ort",
    device: Annotated[int, typer.Option(help="NPU device id (--backend acl)")] = 0,
    devices: Annotated[str | None, typer.Option(help="a staged OUT's NPU per stage, comma-separated, e.g. 0,1 "
                                                "(--backend acl; default --device, --device+1, ...)")] = None,
    check_hashes: Annotated[bool, typer.Option("--check-hashes", help="check every file of OUT against the "
                                               "sha256 in its manifest before loading (sizes are always "
                                               "checked)")] = False,
    distributed: Annotated[str | None, typer.Option(help="ray: each stage of a staged OUT in its own Ray actor, its "
                                                    "caches kept there (pip install 'qwen2om[ray]')")] = None,
    address: Annotated[str | None, typer.Option(help="with --distributed ray: the Ray head's HOST:PORT, or auto; "
                                                "default: a local cluster for this run")] = None,
) -> None:
    """Generate text with a converted model, streaming tokens; prints prefill and decode speed."""
    from qwen2om.runtime import standalone

    argv = ["--max-new-tokens", str(max_new_tokens), "--seed", str(seed), "--threads", str(threads),
            "--backend", backend, "--device", str(device)]
    for flag, value in (("--prompt", prompt), ("--system", system), ("--ids", ids), ("--messages", messages),
                        ("--tools", tools), ("--temperature", temperature), ("--top-k", top_k), ("--top-p", top_p),
                        ("--devices", devices), ("--distributed", distributed), ("--address", address),
                        ("--prompts-file", prompts_file)):
        if value is not None:  # flag=value: a prompt that starts with "-" stays a value
            argv.append(f"{flag}={value}")
    if enable_thinking is not None:
        argv.append("--enable-thinking" if enable_thinking else "--no-thinking")
    argv += [flag for flag, on in (("--chat", chat), ("--greedy", greedy), ("--truncate", truncate),
                                   ("--ignore-eos", ignore_eos), ("--json", as_json), ("--print-prompt", print_prompt))
             if on]
    from qwen2om.targets import ASCEND

    if backend != ASCEND.device_backend:  # on CPU, an Ascend-target output runs through the reference kernels
        from qwen2om.kernels.ascend import cpu_runnable

        with cpu_runnable(out, check_hashes=check_hashes) as view:  # OUT's own files: the view's differ
            code = standalone.main(argv, model_dir=view)
    else:
        code = standalone.main(argv + ["--check-hashes"] * check_hashes, model_dir=out)
    if code:
        raise typer.Exit(code)


@app.command()
def verify(
    out: Annotated[Path, typer.Argument(help="a qwen2om output directory")],
    reference: Annotated[str | None, typer.Option(help="the checkpoint to compare with (directory or "
                                                 "builtin:NAME); default: the one OUT was converted from, "
                                                 "as its manifest records it (an error if its files have "
                                                 "changed since)")] = None,
    tokens: Annotated[int, typer.Option(min=1, help="greedy tokens generated per prompt")] = 32,
    prompt: Annotated[list[str] | None, typer.Option(help="prompt (repeatable; default: three built-in "
                                                     "prompts, one longer than a prefill chunk)")] = None,
    json_file: Annotated[Path | None, typer.Option("--json", help="also write the report as JSON here")] = None,
    reference_loader: Annotated[str, typer.Option(help="exact (qwen2om's reader: the safetensors convert "
                                                  "read; quantised weights dequantised exactly, as OUT holds them) "
                                                  "or transformers (its own from_pretrained, safetensors "
                                                  "only)")] = "exact",
    check_hashes: Annotated[bool, typer.Option("--check-hashes/--no-check-hashes", help="check every file of OUT "
                                               "against the sha256 in its manifest first, so what is verified "
                                               "is what was converted")] = True,
    tolerance: Annotated[float | None, typer.Option(min=0, help="max |Δlogits| allowed (also the tie gap), in "
                                                    "place of the dtype's criterion (fp32: 4 × the reference's "
                                                    "own noise, at least 1e-4); reported as set")] = None,
    distributed: Annotated[str | None, typer.Option(help="ray: each stage of a staged OUT in its own Ray actor, its "
                                                    "caches kept there (pip install 'qwen2om[ray]')")] = None,
    address: Annotated[str | None, typer.Option(help="with --distributed ray: the Ray head's HOST:PORT, or auto; "
                                                "default: a local cluster for this run")] = None,
) -> None:
    """Compare OUT against transformers on the same tokens: max |Δlogits| and greedy-token agreement."""
    from qwen2om.verify import default_reference, describe, describe_tie
    from qwen2om.verify import verify as run_verify

    if json_file is not None and not json_file.parent.is_dir():  # found now, not after the whole comparison
        raise Qwen2omError(f"--json {json_file}: no directory {json_file.parent} to write it in")
    reference = default_reference(out) if reference is None else reference
    with progress_bar() as progress:
        report = run_verify(out, reference, tokens=tokens, prompts=prompt, progress=progress,
                            loader=reference_loader, check_hashes=check_hashes, tolerance=tolerance,
                            distributed=distributed, address=address)
    table = Table(title=f"verify {out} against {reference} ({report.dtype})")
    for col in ("prompt", "prompt tok", "steps", "max |Δlogits|", "ref noise", "top-1 agree", "first mismatch"):
        table.add_column(col)
    for p in report.prompts:
        short = p.prompt.replace("\n", "⏎")[:40]
        agree = f"{p.agreement:.1%}" + (f" ({p.ties} tied)" if p.ties else "")
        table.add_row(short, str(p.prompt_tokens), str(p.steps), f"{p.max_abs:.2e}", f"{p.noise:.2e}", agree,
                      "-" if p.first_disagreement is None else str(p.first_disagreement))
    out_console.print(table)
    tol = report.tolerance
    if any(p.ties for p in report.prompts):
        out_console.print(f"tied: the reference's own logits for the two tokens differ by at most {describe_tie(tol)}, "
                          "so either is right; which one wins depends on the CPU's float rounding")
    verdict = "[green]PASS[/]" if report.passed else "[red]FAIL[/]"
    out_console.print(f"{verdict}: max |Δlogits| {report.max_abs:.2e}, top-1 agreement {report.agreement:.1%} "
                      f"(tolerance: {escape(describe(tol))})")
    if json_file:
        try:
            json_file.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        except OSError as e:
            raise Qwen2omError(f"--json {json_file}: cannot write the report ({e.strerror or e})") from None
    if not report.passed:
        raise typer.Exit(1)


@app.command()
def calibrate(
    model: Annotated[str, typer.Argument(help="float checkpoint directory or builtin:NAME")],
    out: Annotated[Path, typer.Option("--out", "-o", help="quantised checkpoint directory to write")],
    scheme: Annotated[str, typer.Option(help="w4a16 (int4 weights in groups, calibrated) or fp8-block (e4m3fn "
                                        "weights in 128×128 tiles, data-free; Hugging Face's fine-grained FP8 "
                                        "format, as Qwen3-*-FP8)")] = "w4a16",
    method: Annotated[str | None, typer.Option(help="gptq (default; Hessian-based, static act-order), awq "
                                               "(activation-aware scaling + clipping search) or rtn (data-free)"
                                               )] = None,
    group_size: Annotated[int | None, typer.Option(help="input columns sharing one scale (default 128)")] = None,
    sym: Annotated[bool | None, typer.Option("--sym/--asym", help="symmetric (default; no zero point) or "
                                             "asymmetric")] = None,
    dataset: Annotated[str | None, typer.Option(help="JSONL ({text} or {messages}), a text file, or "
                                                "builtin:NAME[+NAME] (prose, code, chinese, chat); default "
                                                "builtin:chat+prose+code")] = None,
    num_samples: Annotated[int | None, typer.Option(help="calibration samples (default 500)")] = None,
    seq_len: Annotated[int | None, typer.Option(min=2, help="tokens per sample (default 2048 or the model's "
                                                "limit)")] = None,
    batch_size: Annotated[int | None, typer.Option(help="samples per forward (default 1: least memory)")] = None,
    compute_dtype: Annotated[str | None, typer.Option(help="dtype of the layers' forward passes: float32 "
                                                      "(default), bfloat16, float16, or auto (the checkpoint's); "
                                                      "Hessians and quantisation stay float32")] = None,
    quantize_lm_head: Annotated[bool | None, typer.Option("--quantize-lm-head", help="also quantise lm_head")] = None,
    clip_search: Annotated[bool | None, typer.Option("--clip-search/--no-clip-search", help="gptq: per output row, "
                                                     "keep the clipping ratio of the group ranges (1, 0.95, 0.9, "
                                                     "0.85) with the least output error on the calibration data "
                                                     "(GPTQ ~3x slower); default off: min-max ranges, as "
                                                     "llm-compressor")] = None,
    hessian: Annotated[str | None, typer.Option(help="gptq: plain (default; every calibration token alike, as "
                                                "llm-compressor), fisher (each token's xxᵀ weighted by the "
                                                "calibration loss's squared gradient at the linear's output: one "
                                                "more forward and backward first) or fisher-heads (q/k/v per "
                                                "attention head)")] = None,
    ignore: Annotated[list[str] | None, typer.Option(help="regex of weights to keep float (repeatable; adds to "
                                                     "the recipe's)")] = None,
    fmt: Annotated[str | None, typer.Option("--format", help="compressed-tensors (default; transformers, vLLM, "
                                            "convert) or ascendv1 (msModelSlim's W4A16: MindIE, vLLM-Ascend, "
                                            "convert)")] = None,
    recipe: Annotated[Path | None, typer.Option(help="YAML file with any of these settings (method, group_size, "
                                                "symmetric, dataset, num_samples, seq_len, batch_size, compute_dtype, "
                                                "ignore, quantize_lm_head, format, damp, actorder, clip_search, "
                                                "hessian); flags override it")] = None,
    device: Annotated[str | None, typer.Option(help="where the layers' forward passes and the GPTQ/AWQ arithmetic "
                                               "run: cpu (default), cuda[:i] or npu[:i] (torch-npu and CANN)")] = None,
    threads: Annotated[int | None, typer.Option(min=1, help="torch threads of this process and of every worker "
                                                "(default: this process's); the checkpoint's bytes depend on it")
                       ] = None,
    distributed: Annotated[str | None, typer.Option(help="ray: spread the samples' activations and the per-module "
                                                    "solves over Ray actors (pip install 'qwen2om[ray]'); the "
                                                    "checkpoint is byte-identical to one process's")] = None,
    address: Annotated[str | None, typer.Option(help="with --distributed ray: the cluster's head HOST:PORT, or auto "
                                                "(default: a local cluster started for this run)")] = None,
    workers: Annotated[int, typer.Option(min=1, help="with --distributed ray: Ray actors, each holding 1/N of the "
                                         "samples")] = 2,
    resume: Annotated[bool, typer.Option("--resume", help="continue an interrupted GPTQ/AWQ calibration of OUT from "
                                         "its last finished layer (same settings and samples)")] = False,
    force: Annotated[bool, typer.Option("--force", help="replace OUT if it exists")] = False,
) -> None:
    """Quantise MODEL's linear weights (int4 W4A16, or FP8 blocks) into a checkpoint `convert` reads.

    Layer by layer; norms, embeddings, RoPE and router gates always stay float. Writes a
    compressed-tensors checkpoint that `convert`, transformers and vLLM read (or msModelSlim's
    layout), with calibration_report.json."""
    from qwen2om.quant.calibrate import calibrate as run_calibrate
    from qwen2om.quant.config import calibration_config
    from qwen2om.quant.schemes import FP8_BLOCK

    # Every check (a flag --scheme fp8-block ignores, a method or format it does not take) is the
    # library's: calibration_config builds the CalibrationConfig, which its scheme checks.
    flags = {"scheme": scheme, "method": method, "group_size": group_size, "symmetric": sym, "dataset": dataset,
             "num_samples": num_samples, "seq_len": seq_len, "batch_size": batch_size,
             "compute_dtype": compute_dtype, "quantize_lm_head": quantize_lm_head, "fmt": fmt, "device": device,
             "threads": threads, "clip_search": clip_search, "hessian": hessian}
    if (address is not None or workers != 2) and distributed is None:
        raise Qwen2omError("--address and --workers are for --distributed ray")
    cfg = calibration_config(recipe, {k: v for k, v in flags.items() if v is not None}, tuple(ignore or ()))
    with progress_bar() as progress:
        result = run_calibrate(model, out, cfg, force=force, progress=progress, log=note, resume=resume,
                               distributed=distributed, workers=workers, address=address)
    r = result.report
    if r["scheme"] == FP8_BLOCK.name:
        print_fp8_report(model, out, r)
        return
    table = Table(title=f"calibrate {model} → {out} ({r['method']}, group {r['group_size']}, "
                        f"{'sym' if r['symmetric'] else 'asym'})")
    for col in ("layer", "seconds", "linears", "mean RTN error", "mean error"):
        table.add_column(col)
    for layer in r["layers"]:
        errs = [x for x in layer["linears"] if x["error"] is not None]
        rtn_e = sum(x["rtn_error"] for x in errs) / len(errs) if errs else None
        err_e = sum(x["error"] for x in errs) / len(errs) if errs else None
        table.add_row(str(layer["layer"]), f"{layer['seconds']:.2f}", str(len(layer["linears"])),
                      "-" if rtn_e is None else f"{rtn_e:.2e}", "-" if err_e is None else f"{err_e:.2e}")
    out_console.print(table)
    starved = [f"layer {x['layer']}: {', '.join(map(str, x['experts']['rtn_experts']))}" for x in r["layers"]
               if x.get("experts", {}).get("rtn_experts")]
    if starved:
        out_console.print("experts with too few calibration tokens, quantised by RTN: " + "; ".join(starved))
    ds = r["dataset"]
    if ds:
        out_console.print(f"{ds['samples']} samples × {ds['seq_len']} tokens from {ds['source']}")
    ex = r.get("execution") or {}
    if ex.get("distributed"):
        moved = sum(x.get("run", {}).get("bytes_moved", 0) for x in r["layers"])
        peak = max(ex["worker_peak_rss_bytes"], default=0)
        out_console.print(f"{ex['workers']} Ray workers on {len({p['host'] for p in ex['places']})} host(s), "
                          f"{moved / 2**20:.1f} MiB moved, worker peak RSS {peak / 2**30:.2f} GiB"
                          + (f"; {len(ex['workers_lost'])} worker(s) lost and recovered from" if ex["workers_lost"]
                             else ""))
    if ex.get("resumed_layers"):
        out_console.print(f"resumed: {ex['resumed_layers']} layers came from the interrupted run")
    out_console.print(f"{r['quantized']} weights quantised in {r['seconds']:.1f} s; "
                      f"report: {out}/calibration_report.json")


@app.command()
def inspect(
    path: Annotated[str, typer.Argument(help="a qwen2om output directory, an .onnx file, or a checkpoint directory "
                                        "(or builtin:NAME)")],
    other: Annotated[str | None, typer.Argument(help="with --diff: the output directory or .onnx file to compare "
                                                "PATH with", show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print everything as JSON")] = False,
    check: Annotated[str | None, typer.Option("--check", help="ascend: list every node or tensor ATC would "
                                              "reject, with the reason; exit code 1 when there is any")] = None,
    soc_version: Annotated[str | None, typer.Option("--soc-version", help="with --check ascend: also check what "
                                                    "this SoC cannot run (e.g. int4 matmuls on Ascend310B1)")] = None,
    cann_table: Annotated[Path | None, typer.Option("--cann-table", metavar="FILE", help="with --check ascend: the "
                                                    "table of CANN's ONNX parser registrations to check against, "
                                                    "instead of the one qwen2om ships (tools/cann_table.py writes "
                                                    "a newer one)")] = None,
    cann_version: Annotated[str | None, typer.Option("--cann-version", help="with --check ascend: the CANN release "
                                                     "the graphs are for, where the table and older releases "
                                                     "disagree: 7.x or 8.x (default: the safer rule) or 'table' "
                                                     "(a CANN built from the table's commits)")] = None,
    dump_graph: Annotated[Path | None, typer.Option("--dump-graph", metavar="FILE", help="draw the graph into "
                                                    "FILE.dot, .svg (full size: every label, zoomable), .png (scaled "
                                                    "down to fit a 1920×1200 screen; graphviz's dot draws these two) "
                                                    "or .txt (one line per node): one decoder layer node by node, "
                                                    "every other layer one box, in order beside it")] = None,
    layer: Annotated[int, typer.Option(help="with --dump-graph: the decoder layer drawn node by node")] = 0,
    full: Annotated[bool, typer.Option("--full", help="with --dump-graph: draw every layer node by node")] = False,
    graph: Annotated[str | None, typer.Option(help="with --dump-graph, for an output directory: decode (default) "
                                              "or prefill")] = None,
    diff: Annotated[bool, typer.Option("--diff", help="compare PATH with OTHER: I/O signature, ops, opset/IR, "
                                       "initializer names/dtypes/shapes; for output directories also recipe, tools, "
                                       "source and file hashes from the manifests")] = False,
    checksums: Annotated[bool, typer.Option("--checksums", help="also the sha256 of every weight (with --diff: "
                                            "compared); the only option that reads the weight data")] = False,
) -> None:
    """What a conversion (or a checkpoint) holds: inputs and outputs, ops, weights, scales.

    Graph inputs/outputs with roles, ops, weights by dtype, and every scale input with the layer and
    module it feeds (or, for a checkpoint, its quantisation). Graphs are read without their weights
    (only --checksums reads those).

    With --check ascend: only the ATC legality check. With --dump-graph FILE: only the picture or text.
    With --diff: only the differences between PATH and OTHER.

    Exit codes: 0 = done (--diff: identical; --check: nothing ATC rejects);
    1 = --diff: PATH and OTHER differ, --check: problems listed;
    2 = bad input (a path that is no output directory, .onnx file or checkpoint; an unreadable ONNX file;
    a missing or truncated external data file);
    3 = --dump-graph .svg/.png but graphviz's `dot` is not installed (FILE's .dot is written instead)."""
    from qwen2om.inspect import CheckpointInfo, OutputInfo, grouped_io
    from qwen2om.inspect import inspect as run_inspect

    if other is not None and not diff:
        raise Qwen2omError(f"a second path ({other}) is only read with --diff")
    if dump_graph is None and (layer != 0 or full or graph is not None):
        raise Qwen2omError("--layer, --full and --graph go with --dump-graph FILE")
    if check is None and (cann_table is not None or cann_version is not None):
        raise Qwen2omError("--cann-table and --cann-version go with --check ascend")
    if check is not None:
        print_check(path, check, soc_version, as_json, cann_table, cann_version)
        return
    if diff:
        print_diff(path, other, checksums, as_json)
        return
    if dump_graph is not None:
        print_dump(path, dump_graph, graph, layer, full, as_json)
        return
    info = run_inspect(path, checksums)
    if as_json:
        print(json.dumps(info.to_dict(), indent=2))
        return
    if isinstance(info, CheckpointInfo):
        quantised = ", ".join(f"{n} {kind}" for kind, n in info.quantized.items()) or "none"
        out_console.print(f"checkpoint {shown(path)}: {shown(info.model_type)} ({info.architecture}), "
                          f"{info.layers} layers, hidden {info.hidden}, {info.tensors} tensors in "
                          f"{len(info.shards)} shard(s); "
                          f"quantised weights: {quantised}")
        if info.quantized_modules:
            print_quantized_modules(info)
        for shard, sha in (info.checksums or {}).items():
            out_console.print(f"  {shown(shard)} sha256 {sha}")
        return
    graphs = info.graphs if isinstance(info, OutputInfo) else {"graph": info.graph}
    for kind, g in graphs.items():
        out_console.print(f"[bold]{shown(kind)}[/] ({shown(path if g.file is None else g.file)}): {g.nodes} nodes, "
                          f"opset {g.opset}, IR {g.ir_version}; top ops: "
                          + ", ".join(f"{shown(op)} {n}" for op, n in list(g.ops.items())[:8]))
        # Kernel ops of other domains (ONNX Runtime's com.microsoft, the NPU's npu) are what a target's
        # fusion passes bought: listed whether or not they are among the most frequent
        if kernels := [f"{shown(op)} {n}" for op, n in g.ops.items() if "::" in op]:
            out_console.print(f"  kernel ops: {', '.join(kernels)}")
        weights = ", ".join(f"{dt} {v.count} ({fmt_bytes(v.bytes)})" for dt, v in g.initializers.items())
        out_console.print(f"  initializers: {weights}")
        if g.external_data:
            data = ", ".join(f"{shown(f)} {fmt_bytes(n)}" for f, n in g.external_data.items())
            read = "read for --checksums" if g.checksums is not None else "not read"
            out_console.print(f"  external data ({read}): {data}")
        if g.checksums is not None:
            combined = hashlib.sha256("".join(f"{n} {h}\n" for n, h in sorted(g.checksums.items())).encode())
            out_console.print(f"  weights sha256: {len(g.checksums)} initializers hashed, combined "
                              f"{combined.hexdigest()} (--json lists each)")
        if g.inputs is None or g.outputs is None:
            continue
        table = Table(title=f"{kind}: inputs and outputs")
        for col in ("", "name", "dtype", "shape", "role", "count"):
            table.add_column(col, overflow="fold")
        for side, ios in (("input", g.inputs), ("output", g.outputs)):
            for row in grouped_io(ios):
                table.add_row(side, shown(row["name"]), row["dtype"], row["shape"], shown(row["role"]),
                              str(row["count"]))
        out_console.print(table)
    if not isinstance(info, OutputInfo):
        return
    if info.scale_inputs:
        first = info.scale_inputs[0]
        table = Table(title=f"scale inputs: {len(info.scale_inputs)}, float32, values in scales.safetensors; "
                            f"each feeds the module its name starts with (source e.g. {first['source']})")
        table.add_column("input", overflow="fold")
        for col in ("layer", "shape", "scheme", "block"):
            table.add_column(col, no_wrap=True)
        for e in info.scale_inputs:
            block = e.get("block_size") or [1, e.get("group_size")]
            table.add_row(e["name"], str(e["layer"]), str(e["shape"]), e["scheme"], f"{block[0]}×{block[1]}")
        out_console.print(table)
    if info.scale_ranges:
        out_console.print("scale range per layer: " + "; ".join(
            f"{r['layer']}: {r['min']:.3g}…{r['max']:.3g}" for r in info.scale_ranges))


def print_quantized_modules(info: CheckpointInfo) -> None:
    """A quantised checkpoint's weights by module (layers folded), and how it was made."""
    from qwen2om.quant.formats import FORMATS

    qc = info.quantization_config or {}
    made = qc.get("qwen2om") or {}
    # an ascendv1 checkpoint says what it is in its marker file (quant_model_description.json), not in config.json;
    # Hugging Face's FP8 names its element format `fmt` (e4m3) and its tiles `weight_block_size`
    fmt = qc.get("format") or qc.get("fmt") or " · ".join(f for f in info.formats if FORMATS.get(f).marker)
    block = qc.get("weight_block_size")
    parts = (qc.get("quant_method"), fmt, block and "×".join(map(str, block)) + " blocks", made.get("method"),
             made.get("dataset"))
    how = " · ".join(dict.fromkeys(str(v) for v in parts if v))  # each once: FP8's method and format are both fp8
    table = Table(title=f"quantised weights ({how})" if how else "quantised weights")
    for col in ("module", "scheme", "block", "zero point", "count"):
        table.add_column(col, justify="right" if col == "count" else "left")
    for row in info.quantized_modules:
        zero = "-" if row.symmetric is None else "none (symmetric)" if row.symmetric else "yes (asymmetric)"
        table.add_row(row.module, row.scheme, "×".join(map(str, row.block)), zero, str(row.count))
    out_console.print(table)
    ignored = qc.get("ignore") or qc.get("modules_to_not_convert")
    if ignored:
        out_console.print("kept float by the checkpoint's config: " + ", ".join(map(str, ignored[:8]))
                          + (f", … ({len(ignored)} in all)" if len(ignored) > 8 else ""))


def print_check(path: str, target: str, soc_version: str | None, as_json: bool, cann_table: Path | None = None,
                cann_version: str | None = None) -> None:
    from qwen2om.ascend import cann_release
    from qwen2om.builtin import resolve_model
    from qwen2om.cann import load_table
    from qwen2om.inspect import check_graphs

    found = check_graphs(resolve_model(path), target, soc_version, cann_table and str(cann_table), cann_version)
    total = sum(len(v) for v in found.values())
    table_used, release = load_table(cann_table), cann_release(cann_version)
    against = f"table {table_used.path}: {table_used.provenance()}; --cann-version {release.name}"
    if as_json:
        print(json.dumps({"check": target, "soc_version": soc_version, "cann_table": table_used.path,
                          "cann_sources": dict(table_used.repos), "cann_version": release.name, "problems": found},
                         indent=2))
    elif not total:
        out_console.print(f"[green]✓[/] {path}: no construct ATC is known to reject ({', '.join(found)}; "
                          f"{shown(against)})")
    else:
        table = Table(title=f"{path}: {total} construct(s) ATC would reject ({shown(against)})")
        for col in ("graph", "count", "nodes / tensors", "what", "why", "source"):
            table.add_column(col, overflow="fold", justify="right" if col == "count" else "left")
        for kind, items in found.items():
            # One row per kind of problem: a layer-by-layer model repeats each one per layer (--json lists all).
            groups: dict[tuple[str, str, str], list[str]] = {}
            for p in items:
                groups.setdefault((p["what"], p["reason"], p["source"]), []).append(p["where"])
            for (what, why, source), where in groups.items():
                first = where[0] + (f", … ({len(where) - 1} more)" if len(where) > 1 else "")
                table.add_row(kind, str(len(where)), shown(first), shown(what), shown(why), shown(source))
        out_console.print(table)
    if total:
        raise typer.Exit(1)


def print_diff(a: str, b: str | None, checksums: bool, as_json: bool) -> None:
    """`inspect A B --diff`: a table of the differences; exit 1 when there is any."""
    from qwen2om.builtin import resolve_model
    from qwen2om.graphdiff import diff

    if b is None:
        raise Qwen2omError("--diff needs two paths: qwen2om inspect A B --diff")
    result = diff(resolve_model(a), resolve_model(b), checksums=checksums)
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
    elif result.identical:
        out_console.print(f"[green]✓[/] {a} and {b}: no differences (graphs {', '.join(result.compared)}: I/O, ops, "
                          f"opset/IR, initializers{', weight checksums' if checksums else ''})")
    else:
        table = Table(title=f"{len(result.differences)} difference(s): A = {a}, B = {b}")
        for col in ("graph", "what", "name", "A", "B"):
            table.add_column(col, overflow="fold")
        shown: dict[tuple[str, str], int] = {}
        for d in result.differences:
            key = (d["graph"], d["section"])
            shown[key] = shown.get(key, 0) + 1
            if shown[key] <= DIFF_ROWS:
                table.add_row(d["graph"], d["section"], d["name"], diff_cell(d["a"]), diff_cell(d["b"]))
        for (graph, section), n in shown.items():
            if n > DIFF_ROWS:
                table.add_row(graph, section, f"… and {n - DIFF_ROWS} more (--json lists all)", "", "")
        out_console.print(table)
    if not result.identical:
        raise typer.Exit(result.exit_code)


DIFF_ROWS = 12  # per graph and section in the table; --json has every row


def diff_cell(value: object) -> str:
    """A table cell of --diff: '-' for absent, sha256s shortened (--json has them whole)."""
    if value is None:
        return "-"
    text = str(value)
    return text[:12] + "…" if len(text) == 64 and all(c in "0123456789abcdef" for c in text) else text


def print_dump(path: str, out: Path, graph: str | None, layer: int, full: bool, as_json: bool) -> None:
    from qwen2om.builtin import resolve_model
    from qwen2om.graphdump import dump_graph

    r = dump_graph(resolve_model(path), out, kind=graph, layer=layer, full=full)
    if as_json:
        print(json.dumps(r.to_dict(), indent=2))
        return
    how = (f"layer {r.expanded} node by node, {r.collapsed} other layers as one box each"
           if r.expanded is not None else "every node")
    unit = "lines" if r.format == "txt" else "boxes"
    out_console.print(f"wrote {out}: {r.graph}, {r.nodes} nodes; {how} ({r.drawn} {unit})", soft_wrap=True)
    if r.note:  # a PNG scaled down to fit a screen: where the full-size picture is
        out_console.print(r.note, soft_wrap=True)


def print_fp8_report(model: str, out: Path, r: dict) -> None:
    table = Table(title=f"calibrate {model} → {out} (fp8-block, e4m3fn, {r['block_size'][0]}×{r['block_size'][1]} "
                        "tiles, data-free)")
    for col in ("layer", "seconds", "linears", "mean ‖ΔW‖/‖W‖", "scale min", "scale max"):
        table.add_column(col)
    for layer in r["layers"]:
        lin = layer["linears"]
        if not lin:
            continue
        table.add_row(str(layer["layer"]), f"{layer['seconds']:.2f}", str(len(lin)),
                      f"{sum(x['relative_error'] for x in lin) / len(lin):.2e}",
                      f"{min(x['scale_min'] for x in lin):.3g}", f"{max(x['scale_max'] for x in lin):.3g}")
    out_console.print(table)
    out_console.print(f"{r['quantized']} weights to FP8 in {r['seconds']:.1f} s; kept float: "
                      f"{', '.join(r['left_float']) or 'none'}; report: {out}/calibration_report.json")


eval_app = typer.Typer(help="Measure quality: perplexity, and agreement with a float reference.",
                       no_args_is_help=True, cls=Group)
app.add_typer(eval_app, name="eval")
EVAL_DATASET = "builtin:prose"
DatasetOpt = Annotated[str, typer.Option(help="JSONL, text file or builtin:NAME")]
WindowOpt = Annotated[int, typer.Option(min=2, help="tokens per non-overlapping window")]
WindowsOpt = Annotated[int, typer.Option(min=1, help="windows scored")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON")]


def windows_of(count: int, window: int) -> str:
    return f"{count} window{'s' if count != 1 else ''} of {window}"


@eval_app.command("ppl")
def eval_ppl(
    model: Annotated[str, typer.Argument(help="checkpoint directory, builtin:NAME, or qwen2om output directory")],
    dataset: DatasetOpt = EVAL_DATASET, window: WindowOpt = 256, max_windows: WindowsOpt = 16,
    as_json: JsonOpt = False,
    distributed: Annotated[str | None, typer.Option(help="ray: each stage of a staged OUT in its own Ray actor, its "
                                                    "caches kept there (pip install 'qwen2om[ray]')")] = None,
    address: Annotated[str | None, typer.Option(help="with --distributed ray: the Ray head's HOST:PORT, or auto; "
                                                "default: a local cluster for this run")] = None,
) -> None:
    """Perplexity over non-overlapping windows: exp(total NLL / scored tokens)."""
    from qwen2om.evaluate import perplexity

    with progress_bar(not as_json) as progress:
        r = perplexity(model, dataset, window=window, max_windows=max_windows,
                       progress=lambda d, t: progress("windows", d, t), log=note, distributed=distributed,
                       address=address)
    if as_json:
        print(json.dumps(r.to_dict(), indent=2))
        return
    out_console.print(f"perplexity {r.ppl:.3f} on {r.tokens} tokens ({windows_of(r.windows, r.window)}, "
                      f"no overlap) of {r.dataset}")


@eval_app.command("agree")
def eval_agree(
    model: Annotated[str, typer.Argument(help="the (quantised) model: checkpoint or output directory")],
    reference: Annotated[str, typer.Option(help="the float reference: checkpoint or output directory")],
    dataset: DatasetOpt = EVAL_DATASET, window: WindowOpt = 256, max_windows: WindowsOpt = 16,
    as_json: JsonOpt = False,
    distributed: Annotated[str | None, typer.Option(help="ray: each stage of a staged OUT in its own Ray actor, its "
                                                    "caches kept there (pip install 'qwen2om[ray]')")] = None,
    address: Annotated[str | None, typer.Option(help="with --distributed ray: the Ray head's HOST:PORT, or auto; "
                                                "default: a local cluster for this run")] = None,
) -> None:
    """Top-1 agreement and mean KL(reference ‖ model) per position, plus both perplexities."""
    from qwen2om.evaluate import agreement

    with progress_bar(not as_json) as progress:
        r = agreement(model, reference, dataset, window=window, max_windows=max_windows,
                      progress=lambda d, t: progress("windows", d, t), log=note, distributed=distributed,
                      address=address)
    if as_json:
        print(json.dumps(r.to_dict(), indent=2))
        return
    out_console.print(f"top-1 agreement {r.top1_agreement:.2%}, mean KL {r.mean_kl:.3g} nats, perplexity "
                      f"{r.ppl:.3f} vs {r.reference_ppl:.3f} (reference) on {r.tokens} tokens "
                      f"({windows_of(r.windows, r.window)}) of {r.dataset}")


@app.command()
def doctor(
    as_json: Annotated[bool, typer.Option("--json", help="print the checks as JSON")] = False,
) -> None:
    """What this machine can do: Python packages, CANN, atc, pyACL, npu-smi, torch-npu, graphviz.

    Each line is ok, missing (some commands need it; the line says which) or problem.

    A problem is installs that contradict each other, e.g. torch-npu without CANN (breaks `import torch`).

    Exit code: 0, or 1 when any problem is found; missing tools alone never fail.
    """
    from qwen2om.doctor import diagnose

    report = diagnose()
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        table = Table(title="qwen2om doctor")
        for col in ("check", "status", "found", "needed for"):
            table.add_column(col, overflow="fold")
        colour = {"ok": "green", "missing": "yellow", "problem": "red"}
        for c in report.checks:
            table.add_row(c.name, f"[{colour[c.status]}]{c.status}[/]", c.detail, c.needed_for)
        out_console.print(table)
        if report.problems:
            out_console.print(f"[red]{len(report.problems)} problem(s):[/] "
                              + "; ".join(c.name for c in report.problems))
    raise typer.Exit(report.exit_code)


@app.command()
def plan(
    model: Annotated[str, typer.Argument(help="checkpoint directory or builtin:NAME; only config.json and the "
                                         "safetensors headers are read")],
    target: Annotated[str | None, typer.Option(help="compile target: ort (default) or ascend")] = None,
    soc_version: Annotated[str | None, typer.Option("--soc-version", help="the Ascend SoC (e.g. Ascend910B3, "
                                                    "Ascend310P3); its memory is the device's; implies --target "
                                                    "ascend")] = None,
    devices: Annotated[int | None, typer.Option(help="split into this many stages, one per device, balanced; "
                                                "default: the fewest that fit")] = None,
    device_memory: Annotated[float | None, typer.Option("--device-memory", metavar="GiB", help="memory of one "
                                                        "device, in GiB (default: the SoC's, from qwen2om's table; "
                                                        "target ort: this machine's RAM)")] = None,
    max_seq_len: Annotated[int | None, typer.Option(help="KV cache capacity P (default 2048 or the model's "
                                                     "limit)")] = None,
    batch_size: Annotated[int | None, typer.Option(help="static batch size B (default 1)")] = None,
    prefill_chunk: Annotated[int | None, typer.Option(help="tokens per prefill call (default 128): sizes the "
                                                      "workspace")] = None,
    dtype: Annotated[str | None, typer.Option(help="compute dtype: fp16 or fp32 (default: the target's)")] = None,
    scheme: Annotated[str | None, typer.Option(help="a float checkpoint's weights counted as if calibrated: "
                                               "w4a16 (symmetric int4, groups of 128) or fp8-block (e4m3fn, "
                                               "128×128 tiles)")] = None,
    group_size: Annotated[int, typer.Option(help="with --scheme w4a16: input columns sharing one scale")] = 128,
    recipe: Annotated[str | None, typer.Option(help="bundled recipe or YAML file, as convert takes it (its "
                                               "passes decide how weights are stored)")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="recipe override key=value (repeatable), as "
                                                   "convert takes it")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False,
) -> None:
    """How much memory MODEL needs per device, and the stage split a conversion would use.

    Reads only config.json and the safetensors headers (no tensor data). Per device (one pipeline
    stage each): the weights by dtype as the conversion stores them (float in the compute dtype; int4
    and FP8 as the target's lowering writes them), the KV cache and linear-attention state at capacity
    max_seq_len × batch_size, a workspace estimate (the peak working set of one prefill call, layer by
    layer: see docs/plan.md), and the total against the device's memory.

    Device memory: --device-memory, else the SoC's (Ascend910B1-B3 64 GiB, 910B4 32 GiB, 910_93 64 GiB per
    die, 310P3 24 GiB, 310B 8 GiB; qwen2om/data/soc_memory.json names the sources), else (target ort)
    this machine's RAM.

    Exit codes: 0 = the plan fits; 2 = it cannot (the stage that does not fit is named with its bytes)
    or bad input."""
    from qwen2om.planner import WORKSPACE_HOW, dtype_summary, plan_model, totals_by_dtype
    from qwen2om.quant.schemes import SCHEMES, W4A16
    from qwen2om.recipe import parse_overrides, setting
    from qwen2om.stages import gib
    from qwen2om.targets import TARGETS

    settings = parse_overrides(set_ or [])
    if soc_version is not None and target is None:  # the target whose chips it names
        target = next(t.name for t in TARGETS if t.socs)
    for key, value in (("target", target), ("soc_version", soc_version), ("dtype", dtype),
                       ("max_seq_len", max_seq_len), ("batch_size", batch_size), ("prefill_chunk", prefill_chunk)):
        if value is not None:
            settings[key] = setting(key, value, f"--{key.replace('_', '-')} {value}")
    if group_size != W4A16.defaults["group_size"] and (scheme is None or SCHEMES.get(scheme) is not W4A16):
        raise Qwen2omError("--group-size goes with --scheme w4a16")
    p = plan_model(model, settings, recipe=recipe, devices=devices, device_memory=device_memory, scheme=scheme,
                   group=group_size)
    if as_json:
        print(json.dumps(p.to_dict(), indent=2))
        return
    r, dev = p.recipe, p.device
    out_console.print(f"{shown(p.model)}: {p.architecture}, {len(p.costs.layers)} layers · target {r.target}"
                      + (f" {r.soc_version}" if r.soc_version else "") + f" · {r.dtype} · capacity "
                      f"{r.max_seq_len} × batch {r.batch_size} · prefill chunk {r.prefill_chunk}"
                      + (f" · --scheme {p.scheme}" if p.scheme else ""), highlight=False)
    named = "" if dev.name == "device" else f"{shown(dev.name)}, "
    out_console.print(f"device: {named}{gib(dev.memory)} ({shown(dev.source)})", highlight=False, soft_wrap=True)
    dtypes = sorted(totals_by_dtype(p.stages), key=lambda k: -totals_by_dtype(p.stages)[k])
    table = Table(title=f"{len(p.stages)} stage(s), one per device; weights by dtype as converted")
    for col in ("stage", "layers", *dtypes, "KV cache", "lin. state", "workspace", "total", "of device"):
        table.add_column(col, justify="left" if col in ("stage", "layers") else "right")
    for st in p.stages:
        table.add_row(str(st.index), f"{st.start}–{st.stop - 1}", *(fmt_bytes(st.weights.get(k, 0)) for k in dtypes),
                      fmt_bytes(st.kv_cache), fmt_bytes(st.linear_state), fmt_bytes(st.workspace),
                      fmt_bytes(st.total), f"{st.total / dev.memory:.0%}")
    out_console.print(table)
    total = sum(st.total for st in p.stages)
    out_console.print(f"total {fmt_bytes(total)} on {len(p.stages)} device(s); weights "
                      f"{dtype_summary(totals_by_dtype(p.stages), fmt_bytes)}", highlight=False, soft_wrap=True)
    out_console.print(f"workspace per stage: {WORKSPACE_HOW}", highlight=False, soft_wrap=True)
    for message in p.notes:
        note(message)


HELP_ITEM = re.compile(r"\d+ = |- ")  # lines of a list ("1 = --diff: …", "- …") keep their own line


def unwrapped(doc: str) -> str:
    """A docstring with each paragraph on one line, list items kept apart: typer prints the lines of a
    command's help as they are, and rich then wraps a 100-column docstring line again at 80."""
    paragraphs = []
    for para in pyinspect.cleandoc(doc).split("\n\n"):
        lines: list[str] = []
        for line in para.splitlines():
            if lines and not HELP_ITEM.match(line):
                lines[-1] += " " + line.strip()
            else:
                lines.append(line.strip())
        paragraphs.append("\n".join(lines))
    return "\n\n".join(paragraphs)


for _typer in (app, eval_app):
    for _command in _typer.registered_commands:
        _command.cls = Command
        if _command.help is None and _command.callback is not None and _command.callback.__doc__:
            _command.help = unwrapped(_command.callback.__doc__)


def main() -> None:
    """Entry point: user errors print one line and exit non-zero; Ctrl-C exits cleanly."""
    from qwen2om.environment import torch_npu_without_cann

    if warning := torch_npu_without_cann():
        err.print(plain("warning", "yellow", warning), highlight=False, soft_wrap=True)
    try:
        app()
    except Qwen2omError as e:
        color = "yellow" if e.label == "interrupted" else "red"
        err.print(plain(e.label, color, str(e)), highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except RuntimeInputError as e:  # the standalone runtime's own error type (it cannot import qwen2om)
        err.print(plain("error", "red", str(e)), highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/]", highlight=False)
        sys.exit(130)
    except SystemExit as e:  # typer turns a Ctrl-C inside a command into a silent exit 130
        if e.code == 130 and caused_by_interrupt(e):
            err.print("[yellow]interrupted[/]", highlight=False)
        raise


if __name__ == "__main__":
    main()
