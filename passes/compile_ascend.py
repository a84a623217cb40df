"""Write the ATC invocation into OUT/ascend/, and compile with it when CANN's `atc` is installed.

Per graph (decode, prefill) one `atc --framework=5` command, generated from the same I/O signature
that goes into manifest.json (qwen2om/atc.py: every input in `--input_shape`, scale inputs
included, never typed by hand; a graph exported for prefill gears gets -1 token axes and
`--dynamic_dims`), plus the files it names:

    OUT/ascend/compile.sh           reruns every command from its own directory
    OUT/ascend/atc_commands.json    the argv lists, for tools
    OUT/ascend/keep_dtype.cfg       norm, softmax and RoPE nodes kept in their dtype (mixed precision)
    OUT/ascend/modify_mixlist.json  the same ops black-listed from fp16
    OUT/ascend/model.<kind>.om      with atc on PATH: the offline models, their atc log
    OUT/ascend/model.<kind>.json    and `atc --mode=1` JSON dumps

`compile: dry-run` (the CLI's --dry-run), or no `atc` on PATH, writes the commands only and says
so. A failing atc stops the conversion with its log's error lines; OUT is not written.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import ClassVar

from qwen2om.atc import AtcOptions, atc_command, keep_dtype_nodes, mixlist_json, script
from qwen2om.errors import Qwen2omError
from qwen2om.output import graph_file
from qwen2om.pipeline import ConvertState, PassResult, RunContext, register

ASCEND_DIR = "ascend"
KEEP_DTYPE, MIXLIST, SCRIPT, COMMANDS = "keep_dtype.cfg", "modify_mixlist.json", "compile.sh", "atc_commands.json"
ERROR_LINE = re.compile(r"\b(E[0-9A-Z]{5}|ERROR|Error)\b")


def om_name(kind: str) -> str:
    return f"model.{kind}"


def commands(state: ConvertState, opts: AtcOptions) -> tuple[list[list[str]], list[list[str]]]:
    """(compile commands, `--mode=1` JSON dump commands), one of each per graph."""
    compile_cmds, dump_cmds = [], []
    gears = (state.graph_gears or {})
    for kind, (inputs, outputs) in state.signatures.items():
        graph = {"inputs": [s.to_dict() for s in inputs], "outputs": [s.to_dict() for s in outputs],
                 "tokens": inputs[0].shape[1], "gears": gears.get(kind, [])}
        compile_cmds.append(atc_command(f"../{graph_file(kind)}", om_name(kind), graph, opts,
                                        keep_dtype_file=KEEP_DTYPE, mixlist_file=MIXLIST))
        dump_cmds.append(["atc", "--mode=1", f"--om={om_name(kind)}.om", f"--json={om_name(kind)}.json"])
    return compile_cmds, dump_cmds


def run_atc(cmd: list[str], cwd: Path, log: Path) -> None:
    with log.open("w", encoding="utf-8") as f:
        proc = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, check=False)
    if proc.returncode:
        lines = [ln.strip() for ln in log.read_text(encoding="utf-8", errors="replace").splitlines()
                 if ERROR_LINE.search(ln)]
        shown = "\n  ".join(lines[:12]) or "(no error lines; see the log)"
        raise Qwen2omError(f"atc failed (exit {proc.returncode}) on `{' '.join(cmd[:4])} …`; OUT was not written. "
                           f"Error lines from its log:\n  {shown}")


@register
class CompileAscend:
    """OUT/ascend/: the ATC command per graph, its config files and a rerun script; the .om with CANN."""

    name: ClassVar[str] = "compile_ascend"
    requires: ClassVar[tuple[str, ...]] = ("onnx_files", "graphs", "signatures", "graph_gears", "ascend_checked")
    produces: ClassVar[tuple[str, ...]] = ("ascend_files",)
    freezes: ClassVar[tuple[str, ...]] = ("signatures",)

    def __call__(self, state: ConvertState, ctx: RunContext) -> PassResult:
        r = ctx.recipe
        opts = AtcOptions(r.soc_version, r.precision)
        opts.check()
        d = ctx.stage_dir / ASCEND_DIR
        d.mkdir(exist_ok=True)
        compile_cmds, dump_cmds = commands(state, opts)
        names = [node.name or "" for model in state.graphs.values() for node in model.graph]
        (d / KEEP_DTYPE).write_text("".join(f"{n}\n" for n in keep_dtype_nodes(names)))
        (d / MIXLIST).write_text(mixlist_json())
        (d / SCRIPT).write_text(script([*compile_cmds, *dump_cmds]))
        (d / SCRIPT).chmod(0o755)
        (d / COMMANDS).write_text(json.dumps({"compile": compile_cmds, "dump": dump_cmds}, indent=2) + "\n")
        atc = shutil.which("atc")
        stats: dict[str, int | float | str] = {"commands": len(compile_cmds), "soc_version": r.soc_version,
                                               "precision": r.precision}
        if r.gears:
            stats["gears"] = ",".join(map(str, r.gears))
        if r.compile == "dry-run" or atc is None:
            why = "--dry-run" if r.compile == "dry-run" else "CANN's `atc` was not found on PATH"
            ctx.log(f"{why}: wrote the ATC commands to {ASCEND_DIR}/{SCRIPT}; run it on a machine with CANN "
                    "(source set_env.sh first) to build the .om files")
            state.ascend_files = sorted(p.name for p in d.iterdir())
            return PassResult(True, stats | {"compiled": 0, "atc": "dry-run" if atc else "not found"})
        for cmd, dump in zip(compile_cmds, dump_cmds, strict=True):
            ctx.progress(f"atc: compiling {cmd[3].removeprefix('--output=')}.om", 0, 1)
            run_atc([atc, *cmd[1:]], d, d / f"atc.{cmd[3].removeprefix('--output=model.')}.log")
            run_atc([atc, *dump[1:]], d, d / f"atc.{cmd[3].removeprefix('--output=model.')}.json.log")
        state.ascend_files = sorted(p.name for p in d.iterdir())
        return PassResult(True, stats | {"compiled": len(compile_cmds), "atc": atc})
