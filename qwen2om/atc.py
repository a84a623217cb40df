"""The ATC command line for the Ascend target, generated from a conversion's manifest (issue 7).

ATC (`atc --framework=5`, CANN) compiles an ONNX graph into an offline model. What breaks
deployments is the command, not the graph: an input missing from `--input_shape` (a scale input,
typically) compiles and then fails at run time with an input-count error. So the input_shape
string is never written by hand here: it is the manifest's I/O signature, every graph input in
order, scale inputs included. The reference for every flag is shared/reference/ascend-atc.md.

Prefill gears (`convert --gears 16,32,64,128`): the prefill graph's token axes are symbolic, so they
are -1 in `--input_shape` and `--dynamic_dims` lists, per gear, the value of every -1 in input order
(input_ids [1,-1], attention_mask [1,1,-1,-1], position_ids [1,-1] give `16,16,P+16,16;32,...`).
Which axes those are is signature.token_axes, the rule run.py's `shape_at` also applies.

This module builds the command and its side files (`--keep_dtype`, `--modify_mixlist`, a rerun
script); it runs nothing: the `compile_ascend` pass writes them into OUT/ascend/ and runs `atc`
when CANN is installed. `parse_input_shape` lets tests and users check a command against a graph.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from collections.abc import Iterable, Sequence
from typing import Any

from qwen2om.ascend import SocError, soc_info
from qwen2om.signature import token_axes
from qwen2om.targets import MAX_GEARS, PRECISIONS

LOG_LEVELS = ("error", "info", "debug")
# Ops kept out of fp16 under mixed precision: RMSNorm's statistics, softmax, and the RoPE tables'
# trigonometry (ATC's mixlist names are ONNX op types here).
FP32_OPS = ("Pow", "ReduceMean", "Sqrt", "Div", "Reciprocal", "Softmax", "Sin", "Cos")
# Node names (qwen2om names nodes after modules) that must keep their dtype: the norms, softmax, RoPE.
KEEP_NODES = re.compile(r"(norm|softmax|Softmax|rope|rotary)", re.IGNORECASE)


class AtcError(ValueError):
    """An ATC option that cannot work (named, with the accepted values)."""


@dataclasses.dataclass(frozen=True)
class AtcOptions:
    soc_version: str
    precision: str = "origin"  # keep the graph's dtypes (the norms' fp32 statistics included)
    log: str = "error"

    def check(self) -> None:
        try:
            soc_info(self.soc_version)
        except SocError as e:
            raise AtcError(str(e)) from None
        if self.precision not in PRECISIONS:
            raise AtcError(f"--precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.log not in LOG_LEVELS:
            raise AtcError(f"ATC log level {self.log!r} is not one of {', '.join(LOG_LEVELS)}")


def input_shape(inputs: Sequence[dict[str, Any]], tokens: int | None = None) -> str:
    """`name:d0,d1;...` for every input, in signature order (a scalar is `name:`). With `tokens` (the
    signature's T, a graph compiled with gears), the axes that grow with T are -1."""
    parts = []
    for io in inputs:
        if ";" in io["name"] or ":" in io["name"]:
            raise AtcError(f"input name {io['name']!r} contains ':' or ';', which --input_shape cannot carry")
        dims = [int(d) for d in io["shape"]]
        if tokens is not None:
            for axis in token_axes(io["role"], dims, tokens):
                dims[axis] = -1
        parts.append(f"{io['name']}:{','.join(map(str, dims))}")
    return ";".join(parts)


def dynamic_dims(inputs: Sequence[dict[str, Any]], tokens: int, gears: Sequence[int]) -> str:
    """`--dynamic_dims`: per gear, the values of the -1 dims of `input_shape(inputs, tokens)`, in order."""
    if not 2 <= len(gears) <= MAX_GEARS:
        raise AtcError(f"--dynamic_dims takes 2..{MAX_GEARS} gears, got {len(gears)}")
    if bad := [g for g in gears if not 1 <= g <= tokens]:
        raise AtcError(f"gear {bad[0]} is outside 1..{tokens}, the graph's largest call")
    axes = [off for io in inputs for off in token_axes(io["role"], io["shape"], tokens).values()]
    if not axes:
        raise AtcError("gears were asked for, but no graph input grows with the token count")
    return ";".join(",".join(str(g + off) for off in axes) for g in gears)


def parse_input_shape(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """The (name, shape) pairs of an `--input_shape` value, in order (repeats kept, to be caught)."""
    out = []
    for item in text.split(";"):
        name, sep, dims = item.rpartition(":")
        if not sep or not name:
            raise AtcError(f"--input_shape item {item!r} is not name:d0,d1,...")
        out.append((name, tuple(int(d) for d in dims.split(",")) if dims else ()))
    return out


def out_nodes(outputs: Sequence[dict[str, Any]]) -> str:
    return ";".join(io["name"] for io in outputs)


def keep_dtype_nodes(node_names: Iterable[str]) -> list[str]:
    """The graph's norm, softmax and RoPE nodes, for `--keep_dtype` (one name per line)."""
    return sorted({n for n in node_names if n and KEEP_NODES.search(n)})


def modify_mixlist() -> dict[str, Any]:
    return {"black-list": {"to-add": list(FP32_OPS)}}


def atc_command(model: str, output: str, graph: dict[str, Any], opts: AtcOptions, *,
                keep_dtype_file: str | None = None, mixlist_file: str | None = None) -> list[str]:
    """The argv of one ATC compile of `model` (a manifest graph entry gives its I/O, and with `gears`
    its `tokens`: those gears are compiled with --dynamic_dims)."""
    opts.check()
    gears = graph.get("gears") or []
    tokens = int(graph["tokens"]) if gears else None
    cmd = ["atc", "--framework=5", f"--model={model}", f"--output={output}", f"--soc_version={opts.soc_version}",
           "--input_format=ND", f"--input_shape={input_shape(graph['inputs'], tokens)}"]
    if tokens is not None:  # --dynamic_dims needs --input_format=ND, which every command has
        cmd.append(f"--dynamic_dims={dynamic_dims(graph['inputs'], tokens, gears)}")
    cmd += [f"--out_nodes={out_nodes(graph['outputs'])}", f"--precision_mode_v2={opts.precision}"]
    if opts.precision != "origin":  # ATC ignores both under origin: the graph's dtypes are kept anyway
        if keep_dtype_file:
            cmd.append(f"--keep_dtype={keep_dtype_file}")
        if mixlist_file:
            cmd.append(f"--modify_mixlist={mixlist_file}")
    cmd.append(f"--log={opts.log}")
    return cmd


def script(commands: Sequence[Sequence[str]]) -> str:
    """A shell script that reruns the commands from the directory it lives in."""
    lines = ["#!/usr/bin/env bash", "# Generated by qwen2om from manifest.json: rerun to compile with CANN's atc.",
             "set -euo pipefail", 'cd "$(dirname "$0")"']
    lines += [" ".join(shlex.quote(a) for a in cmd) for cmd in commands]
    return "\n".join(lines) + "\n"


def mixlist_json() -> str:
    return json.dumps(modify_mixlist(), indent=2) + "\n"
