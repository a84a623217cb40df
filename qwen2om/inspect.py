"""`qwen2om inspect PATH`: what a conversion produced (or what a checkpoint holds), as data.

PATH is a qwen2om output directory (manifest.json), a single `.onnx` file, or a Hugging Face
checkpoint directory (config.json). The result is typed (OutputInfo, OnnxInfo, CheckpointInfo); the
CLI draws it as tables, and `--json` prints its `to_dict()`. What a manifest or scale_map.json
records (graph I/O entries, the recipe, scale inputs) is passed on as recorded. Graphs are read
without their external data, so inspecting a 30B conversion
reads a few MiB of protobuf, not the weights; the data files are only checked to exist and be long
enough. `checksums=True` is the one thing that reads the weights: the sha256 of every initializer.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
from pathlib import Path
from typing import Any, ClassVar

import onnx

from qwen2om.errors import Qwen2omError
from qwen2om.onnxfile import check_external_data, initializer_sha256, load_graph
from qwen2om.output import manifest_graphs, read_manifest

LAYERED = re.compile(r"^(.*?)\.(\d+)$")  # past_key.3 → (past_key, 3)


@dataclasses.dataclass(frozen=True)
class WeightTotal:
    """The initializers of one dtype: how many, and their bytes."""

    count: int
    bytes: int


@dataclasses.dataclass(frozen=True)
class GraphInfo:
    """One graph file: nodes, op histogram (most used first), opset per domain, IR version, initializers
    by dtype, bytes in each external data file; with checksums, each initializer's sha256. A graph of an
    output directory also has its file, token count and I/O as the manifest records them."""

    nodes: int
    ops: dict[str, int]
    opset: dict[str, int]
    ir_version: int
    initializers: dict[str, WeightTotal]
    external_data: dict[str, int]
    checksums: dict[str, str] | None = None  # only with checksums: the one time weights are read
    file: str | None = None
    tokens: int | None = None
    inputs: list[dict[str, Any]] | None = None
    outputs: list[dict[str, Any]] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        listed = {k: d.pop(k) for k in ("file", "tokens", "inputs", "outputs")}
        if self.checksums is None:
            del d["checksums"]
        return {**listed, **d} if self.file is not None else d


@dataclasses.dataclass(frozen=True)
class OutputInfo:
    """A qwen2om output directory: what its manifest records, and each of its graphs."""

    kind: ClassVar[str] = "output"
    path: str
    source: dict[str, Any] | None
    architecture: str | None
    recipe: dict[str, Any] | None
    runtime: dict[str, Any] | None
    graphs: dict[str, GraphInfo]
    scale_inputs: list[dict[str, Any]]  # scale_map.json's entries, each with its input `name`, by name
    scale_ranges: list[dict[str, Any]]  # check_scales' per-layer min/max

    def to_dict(self) -> dict[str, Any]:
        d = {"kind": self.kind, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}
        d["graphs"] = {kind: g.to_dict() for kind, g in self.graphs.items()}
        return d


@dataclasses.dataclass(frozen=True)
class OnnxInfo:
    """A single .onnx file."""

    kind: ClassVar[str] = "onnx"
    path: str
    graph: GraphInfo

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.path, **self.graph.to_dict()}


@dataclasses.dataclass(frozen=True)
class ScaleInfo:
    """One quantised weight of a checkpoint and its scale."""

    weight: str
    scale: str
    shape: list[int]
    scheme: str  # int4, fp8
    block: list[int]
    symmetric: bool | None = None  # only where the format has a zero point to omit (int4)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.symmetric is None:
            del d["symmetric"]
        return d


@dataclasses.dataclass(frozen=True)
class QuantizedModule:
    """Quantised weights of one module, layer and expert numbers folded (model.layers.N.mlp.up_proj)."""

    module: str
    scheme: str
    block: list[int]
    symmetric: bool | None
    count: int


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """A Hugging Face checkpoint directory: its architecture, size, quantisation and shards."""

    kind: ClassVar[str] = "checkpoint"
    path: str
    model_type: str | None
    architecture: str
    layers: int
    hidden: int
    quantization_config: dict[str, Any] | None
    quantized: dict[str, int]  # scheme → weights
    scales: list[ScaleInfo]
    quantized_modules: list[QuantizedModule]
    formats: list[str]
    shards: list[str]
    tensors: int
    checksums: dict[str, str] | None = None  # shard → sha256, only with checksums

    def to_dict(self) -> dict[str, Any]:
        d = {"kind": self.kind, **dataclasses.asdict(self)}
        d["scales"] = [s.to_dict() for s in self.scales]
        if self.checksums is None:
            del d["checksums"]
        return d


InspectResult = OutputInfo | OnnxInfo | CheckpointInfo


def onnx_summary(path: Path, checksums: bool = False,
                 cache: dict[tuple[str, int, int], str] | None = None) -> GraphInfo:
    """Nodes, op histogram, opset, IR version, initializers by dtype and external data bytes of one
    graph file; with `checksums`, each initializer's sha256 (the only time weights are read)."""
    model = load_graph(path, check_data=False)
    external = check_external_data(model, path)
    count: collections.Counter[str] = collections.Counter()
    nbytes: collections.Counter[str] = collections.Counter()
    for init in model.graph.initializer:
        name = onnx.helper.tensor_dtype_to_np_dtype(init.data_type).name if init.data_type != 17 else "float8e4m3fn"
        n = 1
        for d in init.dims:
            n *= d
        size = onnx.helper.tensor_dtype_to_np_dtype(init.data_type).itemsize if init.data_type != 17 else 1
        count[name] += 1
        nbytes[name] += n * size
    ops = collections.Counter(n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}"
                              for n in model.graph.node)
    return GraphInfo(nodes=len(model.graph.node), ops=dict(ops.most_common()),
                     opset={o.domain or "ai.onnx": o.version for o in model.opset_import},
                     ir_version=model.ir_version,
                     initializers={name: WeightTotal(count[name], nbytes[name]) for name in sorted(count)},
                     external_data=external,
                     checksums=initializer_sha256(model, path, cache) if checksums else None)


def inspect_output(root: Path, checksums: bool = False) -> OutputInfo:
    from qwen2om.runtime.standalone import check_files

    manifest = read_manifest(root)
    # OUT as the manifest recorded it: sizes always, and with --checksums each file's sha256 too (a
    # file changed in place at the same size is named, as `run --check-hashes` does)
    check_files(root, manifest, hashes=checksums)
    graphs = {}
    cache: dict[tuple[str, int, int], str] = {}  # decode and prefill share their weights: hash each once
    for kind, (path, spec) in manifest_graphs(root, manifest).items():
        graphs[kind] = dataclasses.replace(onnx_summary(path, checksums, cache), file=str(path.relative_to(root)),
                                           tokens=spec["tokens"], inputs=spec["inputs"], outputs=spec["outputs"])
    scale_map_path = root / "scale_map.json"
    scale_map = json.loads(scale_map_path.read_text(encoding="utf-8")) if scale_map_path.is_file() else {}
    checks = next((s["stats"] for s in manifest.get("stages", []) if s.get("pass") == "check_scales"), {})
    return OutputInfo(path=str(root), source=manifest.get("source"), architecture=manifest.get("architecture"),
                      recipe=manifest.get("recipe"), runtime=manifest.get("runtime"), graphs=graphs,
                      scale_inputs=[{"name": name, **entry} for name, entry in sorted(scale_map.items())],
                      scale_ranges=checks.get("layers", []))


NUMBERED = re.compile(r"\.\d+\.")  # model.layers.3.mlp.experts.7.up_proj → model.layers.N.mlp.experts.N.up_proj


def quantized_modules(scales: list[ScaleInfo]) -> list[QuantizedModule]:
    """The quantised weights grouped by module, layer and expert numbers folded: one row per
    (module, scheme, block, symmetric), in checkpoint order."""
    rows: dict[tuple[str, str, tuple[int, ...], bool | None], int] = {}
    for s in scales:
        module = NUMBERED.sub(".N.", s.weight).removesuffix(".weight")
        key = (module, s.scheme, tuple(s.block), s.symmetric)
        rows[key] = rows.get(key, 0) + 1
    return [QuantizedModule(m, k, list(b), sym, n) for (m, k, b, sym), n in rows.items()]


def inspect_checkpoint(root: Path, checksums: bool = False) -> CheckpointInfo:
    from qwen2om.checkpoint import Checkpoint
    from qwen2om.output import sha256_file

    ckpt = Checkpoint(root)
    try:
        kinds = collections.Counter(q.kind for q in ckpt.quantized.values())
        # `symmetric` only where the format has a zero point to omit (int4); FP8 scales are symmetric by design
        scales = [ScaleInfo(q.name, q.scale_name, list(q.scale_shape), q.kind, list(q.block),
                            getattr(q, "symmetric", None))
                  for q in ckpt.quantized.values()]
        formats = sorted({q.fmt for q in ckpt.quantized.values() if hasattr(q, "fmt")})
        return CheckpointInfo(
            path=str(root), model_type=ckpt.config.get("model_type"), architecture=ckpt.arch.name,
            layers=ckpt.dims.layers, hidden=ckpt.dims.hidden,
            quantization_config=ckpt.config.get("quantization_config"), quantized=dict(kinds),
            scales=scales, quantized_modules=quantized_modules(scales), formats=formats,
            shards=[str(p.relative_to(root)) for p in ckpt.shards], tensors=len(ckpt.names()),
            checksums={str(p.relative_to(root)): sha256_file(p) for p in ckpt.shards} if checksums else None)
    finally:
        ckpt.close()


def inspect(path: Path | str, checksums: bool = False) -> InspectResult:
    """Everything `inspect PATH` shows, typed; `checksums` adds each weight's sha256 (reads them)."""
    from qwen2om.builtin import resolve_model

    path = resolve_model(str(path))
    if path.is_dir() and (path / "manifest.json").is_file():
        return inspect_output(path, checksums)
    if path.is_file() and path.suffix == ".onnx":
        return OnnxInfo(str(path), onnx_summary(path, checksums))
    if path.is_dir() and (path / "config.json").is_file():
        return inspect_checkpoint(path, checksums)
    raise Qwen2omError(f"{path}: not a qwen2om output directory (manifest.json), an .onnx file, or a checkpoint "
                       f"directory (config.json){what_it_is(path)}")


def what_it_is(path: Path) -> str:
    """Why PATH is none of the three kinds, in a few words (the start of an error message)."""
    if not path.exists():
        return ": it does not exist"
    if path.is_file():
        return f": it is a {path.suffix} file" if path.suffix else ": it is a file without a suffix"
    onnx_files = sorted(p.name for p in path.glob("*.onnx"))
    if onnx_files:
        return f"; it holds {', '.join(onnx_files[:3])}: inspect one of those files"
    return "; it is a directory without any of them"


def grouped_io(ios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-layer I/O (past_key.0 … past_key.27, scale inputs) folded into one row per name pattern."""
    rows: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    for io in ios:
        m = LAYERED.match(io["name"])
        if io.get("role") == "scale":
            key = ("<weight>.scale", io["dtype"], "per weight", "scale")
        elif m and io.get("layer") is not None:
            key = (f"{m.group(1)}.{{layer}}", io["dtype"], str(io["shape"]), io["role"])
        else:
            key = (io["name"], io["dtype"], str(io["shape"]), io.get("role", ""))
        rows.setdefault(key, {"name": key[0], "dtype": key[1], "shape": key[2], "role": key[3], "count": 0})
        rows[key]["count"] += 1
    return list(rows.values())


CHECKS = ("ascend",)


def check_graphs(path: Path | str, target: str, soc_version: str | None = None, cann_table: str | None = None,
                 cann_version: str | None = None) -> dict[str, list[dict[str, str]]]:
    """`--check ascend`: graph → every construct ATC would reject, with the reason and its source
    (qwen2om/ascend.py over the table of CANN's registrations, qwen2om/cann.py).

    PATH is an output directory (each graph of its manifest) or one .onnx file; graphs are read
    without their external data. `cann_table` replaces the shipped table (a newer one from
    tools/cann_table.py); `cann_version` picks the rules where the table and older releases disagree."""
    import onnx_ir as ir

    from qwen2om.ascend import cann_release, problems, soc_info
    from qwen2om.cann import load_table

    if target not in CHECKS:
        raise Qwen2omError(f"--check {target!r}: the checks are {', '.join(CHECKS)}")
    soc = soc_info(soc_version) if soc_version else None
    table, release = load_table(cann_table), cann_release(cann_version)
    path = Path(path)
    if path.is_dir() and (path / "manifest.json").is_file():
        manifest = read_manifest(path)
        files = {kind: f for kind, (f, _) in manifest_graphs(path, manifest).items()}
    elif path.is_file() and path.suffix == ".onnx":
        files = {path.name: path}
    else:
        raise Qwen2omError(f"{path}: --check needs a qwen2om output directory or an .onnx file")
    found = {}
    for kind, f in files.items():
        model = ir.serde.deserialize_model(load_graph(f))
        found[kind] = [dataclasses.asdict(p) for p in problems(model, soc, table, release)]
    return found
