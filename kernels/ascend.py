"""Reference kernels for the Ascend-only ops qwen2om emits, and their decomposition for CPU runs.

The `ascend` target's graphs hold ops only CANN's ONNX parser knows. To check such a graph
numerically before it ever reaches an NPU, each op has here

- a NumPy reference that follows the op's documented formula (what the unit tests check), and
- a decomposition into standard ONNX ops (`decompose`), which is how an Ascend-bound graph runs
  on ONNX Runtime: `cpu_runnable(OUT)` gives a directory whose graphs are the same graphs with
  each Ascend op replaced by its decomposition, reading the same weights from the same data file.
  The decomposition is tested against the NumPy reference, so `verify` through it checks the
  graph qwen2om wrote, its packing and its wiring, not a re-derivation of it.

Ops (facts from CANN's ONNX parser plugins; shared/reference/ascend-atc.md):

`npu::WeightQuantBatchMatmulV2` (domain `npu`, version 1; the parser's origin type
"npu::1::WeightQuantBatchMatmulV2", GE op WeightQuantBatchMatmulV2, 910B/910_93/310P):
    inputs  x [.., M, K] (fp16), weight [K, N] int8 or int4 packed in int32 [K, N/8] (8 values per
            int32 along N, value j in bits 4j..4j+3, two's complement), antiquant_scale [⌈K/g⌉, N]
            (per group) or [N] (per channel), antiquant_offset (same shape, optional),
            quant_scale / quant_offset (unused here: fp16 output), bias [N] (optional)
    attrs   antiquant_group_size g (0 = per channel), dtype (-1: the output takes x's dtype)
    y = x @ ((weight + antiquant_offset) · antiquant_scale) + bias     (the offset is added: −zero point)

`AscendAntiQuant` (ai.onnx domain, as the parser registers it): no longer emitted (issue 23: scalar
    scale/offset only, and no ND int8 kernel but Ascend950's; 310B W8A16 now dequantises with Cast + Mul).
    Kept so outputs converted before still run on CPU:
    y = (x − offset) · scale (· scale again with sqrt_mode), x int8, scale/offset float attributes,
    dtype 0 = float32, 1 = float16. The parser negates the ONNX `offset` into GE's (x + offset) · scale,
    so in the ONNX file `offset` is the zero point.

`AscendQuant` (ai.onnx; not emitted by qwen2om, which never quantises activations; kept for
completeness): y = saturate_int8(round(x · scale + offset)), with sqrt_mode scale².
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import TensorProto

from qwen2om.kernels import npu_attention, npu_moe, npu_norm, npu_rope
from qwen2om.kernels.builder import Builder, Decomposition, attrs, dtype, shape
from qwen2om.runtime.standalone import RuntimeInputError

NPU_DOMAIN = "npu"
WQBMM = "WeightQuantBatchMatmulV2"
ANTIQUANT = "AscendAntiQuant"
QUANT = "AscendQuant"
# The fused ops' reference kernels (kernels/npu_*.py), each op's decomposition by its (domain, type)
FUSED: dict[tuple[str, str], Decomposition] = {**npu_attention.DECOMPOSE, **npu_moe.DECOMPOSE,
                                                **npu_norm.DECOMPOSE, **npu_rope.DECOMPOSE}
ASCEND_OPS = {(NPU_DOMAIN, WQBMM), ("", ANTIQUANT), ("", QUANT), *FUSED}
DTYPE_ATTR = {0: np.float32, 1: np.float16}  # AscendAntiQuant's `dtype`: GE DT_FLOAT, DT_FLOAT16


# -- int4 packing ------------------------------------------------------------------------------------
def pack_int4_int32(q: np.ndarray) -> np.ndarray:
    """int values in [-8, 7], [K, N] → int32 [K, ⌈N/8⌉], value j of each word in bits 4j..4j+3."""
    q = np.asarray(q)
    if q.ndim != 2:
        raise ValueError(f"pack_int4_int32 takes a 2-D [K, N] array, not shape {q.shape}")
    if q.size and (q.min() < -8 or q.max() > 7):
        raise ValueError(f"int4 values must be in [-8, 7], found [{q.min()}, {q.max()}]")
    k, n = q.shape
    pad = -n % 8
    nib = (np.pad(q.astype(np.int64), ((0, 0), (0, pad))) & 0xF).reshape(k, -1, 8)
    words = np.zeros(nib.shape[:2], dtype=np.uint64)
    for j in range(8):
        words |= nib[..., j].astype(np.uint64) << np.uint64(4 * j)
    return words.astype(np.uint32).view(np.int32)


def unpack_int4_int32(packed: np.ndarray, n: int) -> np.ndarray:
    """int32 [K, ⌈N/8⌉] → int8 [K, N] (the inverse of pack_int4_int32)."""
    words = np.asarray(packed).view(np.uint32).astype(np.uint64)
    nib = np.stack([(words >> np.uint64(4 * j)) & np.uint64(0xF) for j in range(8)], axis=-1).astype(np.int8)
    vals = np.where(nib >= 8, nib - 16, nib).astype(np.int8)
    return vals.reshape(words.shape[0], -1)[:, :n]


# -- NumPy references ------------------------------------------------------------------------------
def expand_groups(s: np.ndarray, k: int, group: int) -> np.ndarray:
    """Per-group [⌈K/g⌉, N] (or per-channel [N] / [1, N]) → [K, N]; the last group may be partial."""
    s = np.asarray(s)
    if group == 0 or s.ndim == 1 or s.shape[0] == 1:
        return np.broadcast_to(s.reshape(1, -1), (k, s.shape[-1]))
    if s.shape[0] != -(-k // group):
        raise ValueError(f"antiquant_scale has {s.shape[0]} groups; K={k} in groups of {group} needs {-(-k // group)}")
    return np.repeat(s, group, axis=0)[:k]


def weight_quant_batch_matmul_v2(x: np.ndarray, weight: np.ndarray, antiquant_scale: np.ndarray,
                                 antiquant_offset: np.ndarray | None = None, quant_scale: np.ndarray | None = None,
                                 quant_offset: np.ndarray | None = None, bias: np.ndarray | None = None, *,
                                 antiquant_group_size: int = 0, n: int | None = None,
                                 dtype: int = -1) -> np.ndarray:
    """y = x @ ((w + offset) · scale) + bias, computed in float32, returned in x's dtype.

    `weight` int8 [K, N], or int32 [K, N/8] packed int4 (then `n` = N, default 8 · words)."""
    if quant_scale is not None or quant_offset is not None:
        raise NotImplementedError("quant_scale / quant_offset (int8 output) are not used by qwen2om")
    if dtype not in (-1, 1, 0):
        raise ValueError(f"dtype {dtype} is not -1 (as x), 0 (float32) or 1 (float16)")
    if weight.dtype == np.int32:
        w = unpack_int4_int32(weight, n if n is not None else weight.shape[1] * 8)
    elif weight.dtype == np.int8:
        w = weight
    else:
        raise TypeError(f"weight must be int8 or int32 (packed int4), not {weight.dtype}")
    k = w.shape[0]
    wf = w.astype(np.float32)
    if antiquant_offset is not None:
        wf = wf + expand_groups(antiquant_offset, k, antiquant_group_size).astype(np.float32)
    wf = wf * expand_groups(antiquant_scale, k, antiquant_group_size).astype(np.float32)
    y = np.matmul(x.astype(np.float32), wf)
    if bias is not None:
        y = y + bias.astype(np.float32)
    out = x.dtype if dtype == -1 else DTYPE_ATTR[dtype]
    return y.astype(out)


def ascend_anti_quant(x: np.ndarray, *, scale: float, offset: float = 0.0, dtype: int = 1,
                      sqrt_mode: bool = False) -> np.ndarray:
    """ONNX AscendAntiQuant: (x − offset) · scale (scale² with sqrt_mode), int8 in."""
    if x.dtype != np.int8:
        raise TypeError(f"AscendAntiQuant takes int8, not {x.dtype}")
    s = np.float32(scale) * (np.float32(scale) if sqrt_mode else np.float32(1))
    return ((x.astype(np.float32) - np.float32(offset)) * s).astype(DTYPE_ATTR[dtype])


def ascend_quant(x: np.ndarray, *, scale: float, offset: float = 0.0, sqrt_mode: bool = False) -> np.ndarray:
    """AscendQuant: saturate_int8(round_half_even(x · scale + offset)) (scale² with sqrt_mode)."""
    s = np.float32(scale) * (np.float32(scale) if sqrt_mode else np.float32(1))
    return np.clip(np.rint(x.astype(np.float32) * s + np.float32(offset)), -128, 127).astype(np.int8)


# -- decomposition into standard ONNX ops ---------------------------------------------------------
def _wqbmm(b: Builder, node: onnx.NodeProto, float_type: int) -> None:
    a = attrs(node)
    group = int(a.get("antiquant_group_size", 0))  # type: ignore[call-overload]
    x, weight, scale, offset, *rest = [*node.input, "", "", "", "", ""][:7]
    bias = rest[2] if len(rest) > 2 else ""
    wshape = shape(b.graph, weight)
    sshape = shape(b.graph, scale)
    if wshape is None or sshape is None:
        raise ValueError(f"{node.name}: weight and antiquant_scale need static shapes")
    k, n = wshape[0], sshape[-1]
    if dtype(b.graph, weight) == TensorProto.INT32:  # packed int4: 8 nibbles per word along N
        words = b.op("Cast", weight, to=TensorProto.UINT32)
        shifted = b.op("BitShift", b.op("Unsqueeze", words, b.const(np.array([2]))),
                       b.const(np.arange(0, 32, 4, dtype=np.uint32)), direction="RIGHT")
        nib = b.op("Cast", b.op("BitwiseAnd", shifted, b.const(np.array(15, np.uint32))), to=TensorProto.FLOAT)
        nib = b.op("Reshape", nib, b.const(np.array([k, wshape[1] * 8])))
        nib = b.op("Slice", nib, b.const(np.array([0])), b.const(np.array([n])), b.const(np.array([1])))
        w = b.op("Where", b.op("GreaterOrEqual", nib, b.const(np.array(8, np.float32))),
                 b.op("Sub", nib, b.const(np.array(16, np.float32))), nib)
    else:
        w = b.op("Cast", weight, to=TensorProto.FLOAT)

    def per_row(v: str) -> str:  # [⌈K/g⌉, N] → [K, N] (float32); per channel broadcasts as is
        v = b.op("Cast", v, to=TensorProto.FLOAT)
        if group == 0 or len(sshape) == 1 or sshape[0] == 1:
            return v
        groups = sshape[0]
        v = b.op("Expand", b.op("Unsqueeze", v, b.const(np.array([1]))), b.const(np.array([groups, group, n])))
        v = b.op("Reshape", v, b.const(np.array([groups * group, n])))
        return b.op("Slice", v, b.const(np.array([0])), b.const(np.array([k])), b.const(np.array([0])))

    if offset:
        w = b.op("Add", w, per_row(offset))
    w = b.op("Mul", w, per_row(scale))
    y = b.op("MatMul", b.op("Cast", x, to=TensorProto.FLOAT), w)
    if bias:
        y = b.op("Add", y, b.op("Cast", bias, to=TensorProto.FLOAT))
    b.op("Cast", y, out=node.output[0], to=float_type)


def _antiquant(b: Builder, node: onnx.NodeProto) -> None:
    a = attrs(node)
    scale = float(a.get("scale", 1.0))  # type: ignore[arg-type]
    if a.get("sqrt_mode"):
        scale *= scale
    x = b.op("Sub", b.op("Cast", node.input[0], to=TensorProto.FLOAT),
             b.const(np.array(float(a.get("offset", 0.0)), np.float32)))  # type: ignore[arg-type]
    y = b.op("Mul", x, b.const(np.array(scale, np.float32)))
    to = TensorProto.FLOAT16 if int(a.get("dtype", 0)) == 1 else TensorProto.FLOAT  # type: ignore[call-overload]
    b.op("Cast", y, out=node.output[0], to=to)


def decompose(model: onnx.ModelProto) -> int:
    """Replace every Ascend op in `model` (in place) by standard ONNX ops; return how many."""
    if has_ascend_ops(model):  # shapes of the ops' computed inputs (a transposed scale), where not recorded
        inferred = onnx.shape_inference.infer_shapes(model)
        known = {vi.name for vi in model.graph.value_info}
        model.graph.value_info.extend(vi for vi in inferred.graph.value_info if vi.name not in known)
    graph = model.graph
    types = {**{i.name: i.data_type for i in graph.initializer},
             **{vi.name: vi.type.tensor_type.elem_type for vi in (*graph.input, *graph.value_info, *graph.output)}}
    new_nodes: list[onnx.NodeProto] = []
    count = 0
    for node in graph.node:
        key = (node.domain if node.domain != "ai.onnx" else "", node.op_type)
        if key not in ASCEND_OPS:
            new_nodes.append(node)
            continue
        b = Builder(graph, node.name or f"ascend{count}")
        if key[1] == WQBMM:
            x_type = types.get(node.input[0]) or types.get(node.output[0]) or TensorProto.FLOAT16
            _wqbmm(b, node, types.get(node.output[0]) or x_type)
        elif key in FUSED:
            FUSED[key](b, node, types)
        elif key[1] == ANTIQUANT:
            _antiquant(b, node)
        else:
            raise NotImplementedError(f"{node.name}: {QUANT} has no decomposition (qwen2om never emits it)")
        new_nodes.extend(b.nodes)
        count += 1
    del graph.node[:]
    graph.node.extend(new_nodes)
    opsets = {o.domain: o for o in model.opset_import}
    if NPU_DOMAIN in opsets:
        model.opset_import.remove(opsets[NPU_DOMAIN])
    return count


def cpu_engine(out: Path, *, check_hashes: bool = False, **kwargs: object) -> object:
    """The runtime's Engine for `out`, its Ascend ops (if any) run as their decompositions. The
    sessions hold the graphs and the mapped data once built, so the temporary view can go."""
    from qwen2om.runtime.standalone import Engine

    with cpu_runnable(out, check_hashes=check_hashes) as view:
        engine = Engine(view, **kwargs)  # type: ignore[arg-type]
    engine.dir = Path(out)
    return engine


def has_ascend_ops(model: onnx.ModelProto) -> bool:
    return any((n.domain if n.domain != "ai.onnx" else "", n.op_type) in ASCEND_OPS for n in model.graph.node)


def load_graph(path: Path) -> onnx.ModelProto:
    """An ONNX graph without its weights; a file that is not one is named, not a protobuf traceback."""
    try:
        return onnx.load(path, load_external_data=False)
    except (OSError, DecodeError) as e:
        why = getattr(e, "strerror", None) or "damaged or truncated"
        raise RuntimeInputError(f"{path}: not a readable ONNX graph ({why}): convert again") from None


@contextlib.contextmanager
def cpu_runnable(out: Path, *, check_hashes: bool = False) -> Iterator[Path]:
    """`out` itself when its graphs are standard ONNX; else a temporary view of it whose graphs are
    decomposed, every other file hard-linked (ONNX Runtime refuses external data reached through a
    symlink out of the model's directory). The view lives inside `out`, so the links are on the same
    file system; where `out` is not writable, files are copied to the system's temporary directory.
    A staged OUT (convert --stages) gets a view of each stage folder, at the same place in the view."""
    out = Path(out)
    manifest = None  # none yet while convert checks its staging directory
    folders = [Path()]
    if (out / "manifest.json").is_file():
        # OUT's own files, checked before any is parsed (the view's decomposed graphs have other hashes)
        from qwen2om.runtime.standalone import check_files, load_manifest

        manifest = load_manifest(out)
        check_files(out, manifest, hashes=check_hashes)
        folders += [Path(s["dir"]) for s in manifest.get("split", {}).get("stages", [])]
    models = {f: {p.name: load_graph(p) for p in sorted((out / f).glob("model.*.onnx"))} for f in folders}
    if not any(has_ascend_ops(m) for graphs in models.values() for m in graphs.values()):
        yield out
        return
    try:
        tmp = tempfile.TemporaryDirectory(prefix=".cpu-view-", dir=out)
        link = os.link
    except OSError:
        tmp, link = tempfile.TemporaryDirectory(prefix="qwen2om-cpu-"), shutil.copyfile  # type: ignore[assignment]
    with tmp as name:
        for folder, graphs in models.items():
            view = Path(name) / folder
            view.mkdir(parents=True, exist_ok=True)
            src = out / folder
            for item in src.iterdir():
                if item.is_file() and item.name not in graphs:
                    link(item, view / item.name)
            for name_, model in graphs.items():
                decompose(model)
                onnx.save(model, view / name_)
            if (src / "manifest.json").is_file():
                # The view's manifest lists the decomposed graphs as they are (the runtime checks sizes against
                # it); a new file, not a write through the link into `out`'s own manifest.
                listed = json.loads((src / "manifest.json").read_text(encoding="utf-8"))
                for entry in listed.get("files", []):
                    if entry["name"] in graphs:
                        entry["bytes"] = (view / entry["name"]).stat().st_size
                        entry.pop("sha256", None)
                (view / "manifest.json").unlink()
                (view / "manifest.json").write_text(json.dumps(listed, indent=2) + "\n", encoding="utf-8")
        yield Path(name)
