"""`inspect A B --diff`: what differs between two output directories or two .onnx files.

For "what changed between yesterday's conversion and today's": per graph, the I/O signature
(names, order, dtypes, shapes), the op histogram, opset and IR version, and every initializer's
name, dtype and shape; for output directories also the recipe, the tool versions, the source
checkpoint's files and the files written (sha256s the manifests already hold, so nothing is
re-read). Only `checksums=True` reads the weights, to compare each initializer's sha256 as well.

Every difference is one row `{graph, section, name, a, b}` (`None` where one side lacks it), so
the CLI prints a table and `--json` prints the rows as they are. `identical` is what the exit code
says: 0 when nothing differs, 1 when something does.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path
from typing import Any

import onnx

from qwen2om.errors import Qwen2omError
from qwen2om.onnxfile import dtype_name, graph_files, initializer_sha256, load_graph

EXIT_SAME, EXIT_DIFFERENT = 0, 1


def type_text(t: onnx.TypeProto) -> str:
    tt = t.tensor_type
    dims = ",".join(str(d.dim_value) if d.HasField("dim_value") else d.dim_param or "?" for d in tt.shape.dim)
    return f"{dtype_name(tt.elem_type)}[{dims}]"


def graph_facts(path: Path, checksums: bool, cache: dict[tuple[str, int, int], str]) -> dict[str, Any]:
    """What is compared of one graph file (the protobuf; the weights only with `checksums`)."""
    model = load_graph(path)
    g = model.graph
    facts: dict[str, Any] = {
        "opset": {o.domain or "ai.onnx": o.version for o in model.opset_import},
        "ir_version": model.ir_version,
        "inputs": {v.name: type_text(v.type) for v in g.input},
        "outputs": {v.name: type_text(v.type) for v in g.output},
        "io_order": [v.name for v in g.input] + ["→"] + [v.name for v in g.output],
        "ops": dict(collections.Counter(n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}"
                                        for n in g.node)),
        "initializers": {i.name: f"{dtype_name(i.data_type)}[{','.join(map(str, i.dims))}]" for i in g.initializer},
    }
    if checksums:
        facts["checksums"] = initializer_sha256(model, path, cache)
    return facts


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} → {"a.b": 1}; lists stay values (a recipe's pipeline is compared whole)."""
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def compare(section: str, a: dict[str, Any], b: dict[str, Any], graph: str = "") -> list[dict[str, Any]]:
    """One row per key whose value differs (or that one side lacks), in a stable order."""
    rows = []
    for key in [*a, *(k for k in b if k not in a)]:
        va, vb = a.get(key), b.get(key)
        if va != vb:
            rows.append({"graph": graph, "section": section, "name": key, "a": va, "b": vb})
    return rows


@dataclasses.dataclass
class DiffResult:
    a: str
    b: str
    checksums: bool
    compared: list[str]  # graph kinds compared
    differences: list[dict[str, Any]]

    @property
    def identical(self) -> bool:
        return not self.differences

    @property
    def exit_code(self) -> int:
        return EXIT_SAME if self.identical else EXIT_DIFFERENT

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "identical": self.identical, "checksums": self.checksums,
                "graphs": self.compared, "differences": self.differences}


def kind_of(path: Path) -> str:
    if path.is_dir() and (path / "manifest.json").is_file():
        return "output"
    if path.is_file() and path.suffix == ".onnx":
        return "onnx"
    raise Qwen2omError(f"{path}: --diff compares two qwen2om output directories (manifest.json) or two .onnx files")


def manifest_facts(root: Path) -> dict[str, dict[str, Any]]:
    m = json.loads((root / "manifest.json").read_text(encoding="utf-8"))
    return {"recipe": flatten(m.get("recipe", {})), "tools": dict(m.get("tools", {})),
            "source": {f["name"]: f["sha256"] for f in m.get("source", {}).get("files", [])},
            "files": {f["name"]: f["sha256"] for f in m.get("files", [])}}


def diff(a: Path | str, b: Path | str, *, checksums: bool = False) -> DiffResult:
    """Every difference between A and B (two output directories, or two .onnx files)."""
    a, b = Path(a), Path(b)
    ka, kb = kind_of(a), kind_of(b)
    if ka != kb:
        raise Qwen2omError(f"--diff: {a} is {'an output directory' if ka == 'output' else 'an .onnx file'} and {b} "
                           f"is not; compare two output directories or two .onnx files")
    rows: list[dict[str, Any]] = []
    files_a, files_b = (graph_files(a), graph_files(b)) if ka == "output" else ({"graph": a}, {"graph": b})
    if ka == "output":  # a graph kind only one side has (two .onnx files are compared whatever their names)
        rows += compare("graphs", {k: p.name for k, p in files_a.items()}, {k: p.name for k, p in files_b.items()})
    both = [k for k in files_a if k in files_b]
    cache_a: dict[tuple[str, int, int], str] = {}
    cache_b: dict[tuple[str, int, int], str] = {}
    for kind in both:
        ga, gb = graph_facts(files_a[kind], checksums, cache_a), graph_facts(files_b[kind], checksums, cache_b)
        for section in ("opset", "inputs", "outputs", "ops", "initializers"):
            rows += compare(section, ga[section], gb[section], kind)
        if ga["ir_version"] != gb["ir_version"]:
            rows.append({"graph": kind, "section": "ir_version", "name": "", "a": ga["ir_version"],
                         "b": gb["ir_version"]})
        same_names = set(ga["inputs"]) == set(gb["inputs"]) and set(ga["outputs"]) == set(gb["outputs"])
        if same_names and ga["io_order"] != gb["io_order"]:  # the runtime binds by position on some backends
            rows.append({"graph": kind, "section": "io_order", "name": "", "a": ga["io_order"], "b": gb["io_order"]})
        if checksums:  # only where name, dtype and shape agree: other differences are already rows
            same = {n for n in ga["checksums"] if ga["initializers"].get(n) == gb["initializers"].get(n)}
            rows += compare("checksums", {n: s for n, s in ga["checksums"].items() if n in same},
                            {n: s for n, s in gb["checksums"].items() if n in same}, kind)
    if ka == "output":
        fa, fb = manifest_facts(a), manifest_facts(b)
        for section in ("recipe", "tools", "source", "files"):
            rows += compare(section, fa[section], fb[section])
    return DiffResult(str(a), str(b), checksums, both, rows)
