"""Check every written graph against the declared signature, and run it when that is cheap.

The structural checks read only the graph files (kilobytes): the ONNX checker, the exact I/O
signature, and every external tensor's byte range inside model.onnx.data. A trial run in ONNX
Runtime loads all the weights, so it happens only when they fit under `run_limit_mb`:
conversion memory must not grow with the model, and `qwen2om verify` runs big models anyway.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import numpy as np
import onnx
import onnxruntime as ort

from qwen2om.errors import Qwen2omError
from qwen2om.kernels.ascend import cpu_runnable, decompose, has_ascend_ops
from qwen2om.pipeline import ConvertState, PassResult, RunContext, register
from qwen2om.signature import IOSpec, token_axes

ONNX_TYPES = {"int64": onnx.TensorProto.INT64, "float32": onnx.TensorProto.FLOAT,
              "float16": onnx.TensorProto.FLOAT16}


def signature_of(values: list[onnx.ValueInfoProto]) -> list[tuple[str, int, list[int | str]]]:
    """(name, elem type, dims) per value; a symbolic dim is its name (`T`, `T+256`)."""
    return [(v.name, v.type.tensor_type.elem_type,
             [d.dim_param if d.HasField("dim_param") else d.dim_value for d in v.type.tensor_type.shape.dim])
            for v in values]


def expected_dims(spec: IOSpec, tokens: int | None) -> list[int | str]:
    """The dims a value must have in the file: the signature's, or with `tokens` (a gears graph) its token
    axes symbolic, named as export_onnx names them."""
    dims: list[int | str] = list(spec.shape)
    if tokens is not None:
        for axis, off in token_axes(spec.role, spec.shape, tokens).items():
            dims[axis] = f"T+{off}" if off else "T"
    return dims


def at_tokens(spec: IOSpec, tokens: int, t: int) -> tuple[int, ...]:
    """`spec`'s shape in a call of `t` tokens (the graph's largest call is `tokens`)."""
    dims = list(spec.shape)
    for axis, off in token_axes(spec.role, spec.shape, tokens).items():
        dims[axis] = t + off
    return tuple(dims)


def check_structure(path: Path, inputs: list[IOSpec], outputs: list[IOSpec], gears: list[int] | None = None) -> int:
    """Checker, exact signature (with `gears`, token axes symbolic), external byte ranges; returns the bytes
    the graph references."""
    try:
        proto = onnx.load(path, load_external_data=False)
        if has_ascend_ops(proto):  # the ONNX checker knows no Ascend op: check what they decompose into
            cpu = onnx.ModelProto()
            cpu.CopyFrom(proto)
            decompose(cpu)
            tmp = path.with_name(f".{path.stem}.cpu.onnx")  # beside the data file, which it references
            try:
                onnx.save(cpu, tmp)
                onnx.checker.check_model(str(tmp))
            finally:
                tmp.unlink(missing_ok=True)
        else:
            onnx.checker.check_model(str(path))  # by path: external files resolved next to the graph, not loaded
    except Exception as e:  # onnx raises several unrelated types
        raise Qwen2omError(f"{path.name}: not a valid ONNX model ({str(e).strip().splitlines()[0]})") from None
    for what, got, want in (("input", proto.graph.input, inputs), ("output", proto.graph.output, outputs)):
        got_sig = signature_of(list(got))
        tokens = inputs[0].shape[1] if gears else None
        want_sig = [(s.name, ONNX_TYPES[s.dtype], expected_dims(s, tokens)) for s in want]
        if got_sig != want_sig:
            got_only = [g for g in got_sig if g not in want_sig]
            want_only = [w for w in want_sig if w not in got_sig]
            raise Qwen2omError(f"{path.name}: {what} signature differs from the contract: "
                               f"unexpected {got_only[:3]}, missing {want_only[:3]}")
    referenced = 0
    for t in proto.graph.initializer:
        ext = {e.key: e.value for e in t.external_data}
        if not ext:
            continue
        data = path.parent / ext["location"]
        end = int(ext.get("offset", 0)) + int(ext["length"])
        if not data.is_file() or data.stat().st_size < end:
            raise Qwen2omError(f"{path.name}: initializer {t.name!r} points at bytes up to {end} of {data.name}, "
                               "which is missing or shorter")
        referenced += int(ext["length"])
    return referenced


def trial_run(path: Path, inputs: list[IOSpec], gears: list[int] | None = None, head: str = "logits") -> None:
    """All-zero inputs give finite logits (a pipeline stage before the last: hidden states, `head`); with
    gears, at the smallest and the largest."""
    try:
        options = ort.SessionOptions()
        options.add_session_config_entry("session.disable_prepacking", "1")  # no second weight copy
        options.log_severity_level = 3  # errors only: constant folding's "no CPU kernel" notes are one per layer
        sess = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise Qwen2omError(f"{path.name}: ONNX Runtime cannot load the graph ({e})") from None
    tokens = inputs[0].shape[1]
    for t in sorted({min(gears), max(gears)}) if gears else [tokens]:
        feeds = {s.name: np.zeros(at_tokens(s, tokens, t), dtype=s.dtype) for s in inputs}
        logits = sess.run([head], feeds)[0]
        if not np.isfinite(logits).all():
            at = f" at gear {t}" if gears else ""
            raise Qwen2omError(f"{path.name}: {head} are not finite on an all-zero input{at}")


def check_scale_map(stage: Path, sigs: dict[str, tuple[list[IOSpec], list[IOSpec]]]) -> None:
    """Every scale input of every graph is in scale_map.json and scales.safetensors, and nothing else is."""
    from qwen2om.safetensors_io import Shard

    wanted = {s.name: s for inputs, _ in sigs.values() for s in inputs if s.role == "scale"}
    path = stage / "scale_map.json"
    listed = json.loads(path.read_text()) if path.is_file() else {}
    if set(wanted) != set(listed):
        only_graph, only_map = sorted(set(wanted) - set(listed)), sorted(set(listed) - set(wanted))
        raise Qwen2omError(f"scale inputs and scale_map.json disagree: in the graphs only {only_graph[:3]}, "
                           f"in scale_map.json only {only_map[:3]}")
    if wanted:
        stored = Shard(stage / "scales.safetensors").tensors
        for name, spec in wanted.items():
            if name not in stored or stored[name].shape != spec.shape:
                raise Qwen2omError(f"scales.safetensors lacks {name!r} with shape {list(spec.shape)}")


@register
class CheckOutputs:
    """Each graph passes the ONNX checker with exactly the signature's I/O; small ones also run in ONNX Runtime."""

    name: ClassVar[str] = "check_outputs"
    requires: ClassVar[tuple[str, ...]] = ("onnx_files", "signatures", "graph_gears")
    produces: ClassVar[tuple[str, ...]] = ("outputs_checked",)
    freezes: ClassVar[tuple[str, ...]] = ("signatures",)

    def __init__(self, run_limit_mb: int = 256) -> None:
        self.run_limit = run_limit_mb << 20

    def __call__(self, state: ConvertState, ctx: RunContext) -> PassResult:
        files, sigs, gears = state.onnx_files, state.signatures, (state.graph_gears or {})
        check_scale_map(ctx.stage_dir, sigs)
        ran = 0
        for kind, (inputs, outputs) in sigs.items():
            weights = check_structure(files[kind], inputs, outputs, gears.get(kind))
            if ctx.recipe.dtype == "fp16":
                weights *= 2  # ONNX Runtime's CPU kernels are fp32: it keeps upcast copies of fp16 weights
            if weights <= self.run_limit:
                with cpu_runnable(files[kind].parent) as view:  # Ascend ops run as their decompositions
                    trial_run(view / files[kind].name, inputs, gears.get(kind), outputs[0].name)
                ran += 1
            elif kind == next(iter(sigs)):
                ctx.log(f"check_outputs: {weights / 2**30:.2f} GiB of weights is above the {self.run_limit >> 20} MiB "
                        "limit for a trial run in ONNX Runtime (check_outputs run_limit_mb); structure checked "
                        "only, `qwen2om verify` runs the model")
        return PassResult(False, {"graphs_checked": len(sigs), "graphs_run": ran})
