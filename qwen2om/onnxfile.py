"""Reading graph files for `inspect`: the protobuf only, never the weights unless asked.

A qwen2om graph keeps its weights in `model.onnx.data`; `inspect`, `--dump-graph` and `--diff`
need only the graph (kilobytes to a few MiB), so `load_graph` reads the protobuf without its
external data and checks, from the file sizes alone, that every data file it names is there and
long enough. A moved or truncated data file is then reported by name before anything else runs,
instead of surfacing as a confusing error deep inside ONNX Runtime. Only `--checksums` reads the
weight bytes (`initializer_sha256`), block by block.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from pathlib import Path

import onnx

from qwen2om.errors import Qwen2omError

BLOCK = 16 << 20  # bytes hashed per read: memory stays flat whatever the tensor size


def itemsize(data_type: int) -> float:
    """Bytes per element of an ONNX tensor type (0.5 for the 4-bit types)."""
    if data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        return 0.5
    if data_type == onnx.TensorProto.STRING:
        return 0
    return float(onnx.helper.tensor_dtype_to_np_dtype(data_type).itemsize)


def dtype_name(data_type: int) -> str:
    """Short name of an ONNX tensor type as the manifest writes dtypes (float32, int64, float8e4m3fn)."""
    if not data_type:
        return "?"
    name = onnx.TensorProto.DataType.Name(data_type).lower()
    return {"float": "float32", "double": "float64", "float16": "float16"}.get(name, name)


def external_location(init: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in init.external_data}


def external_spans(model: onnx.ModelProto) -> Iterator[tuple[onnx.TensorProto, str, int, int]]:
    """(initializer, data file, offset, length) of every externally stored initializer."""
    for init in model.graph.initializer:
        if init.data_location != onnx.TensorProto.EXTERNAL:
            continue
        loc = external_location(init)
        offset = int(loc.get("offset", 0))
        length = int(loc["length"]) if "length" in loc else math.ceil(itemsize(init.data_type) * math.prod(init.dims))
        yield init, loc.get("location", ""), offset, length


def check_external_data(model: onnx.ModelProto, path: Path) -> dict[str, int]:
    """Every data file the graph names exists next to it and is long enough; returns the bytes each
    holds for this graph. Reads file sizes only, never the data."""
    need: dict[str, tuple[int, str]] = {}
    used: dict[str, int] = {}
    count: dict[str, int] = {}
    for init, location, offset, length in external_spans(model):
        end = offset + length
        if location not in need or end > need[location][0]:
            need[location] = (end, init.name)
        used[location] = used.get(location, 0) + length
        count[location] = count.get(location, 0) + 1
    for location, (end, name) in sorted(need.items()):
        data = path.parent / location
        if not data.resolve().is_relative_to(path.parent.resolve()):  # absolute, ../ or a symlink out
            raise Qwen2omError(f"{path}: {count[location]} initializers (e.g. {name}) name external data "
                               f"outside its directory ({location!r}); refusing to read it")
        if not data.is_file():
            raise Qwen2omError(f"{path}: its weights are in {location}, which is missing (looked for {data}; "
                               f"{count[location]} initializers, e.g. {name}, are stored there)")
        size = data.stat().st_size
        if size < end:
            raise Qwen2omError(f"{path}: {location} is {size} bytes, but the graph reads up to byte {end} "
                               f"(initializer {name}): the data file is truncated or belongs to another graph")
    return used


def load_graph(path: Path, *, check_data: bool = True) -> onnx.ModelProto:
    """The graph of one .onnx file without its external data; a clear error for a file that is not
    ONNX, and (with `check_data`) for a data file that is missing or too short."""
    path = Path(path)
    if not path.is_file():
        raise Qwen2omError(f"{path}: no such file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # onnx raises DecodeError, OSError, ValueError… for a bad file
        raise Qwen2omError(f"{path}: not a readable ONNX model ({type(e).__name__}: {e})") from None
    if not model.graph.node and not model.graph.input and not model.graph.output:
        # protobuf parses many non-ONNX byte strings as an empty message
        raise Qwen2omError(f"{path}: not a readable ONNX model (no graph: no nodes, inputs or outputs)")
    if check_data:
        check_external_data(model, path)
    return model


def graph_files(path: Path, kind: str | None = None) -> dict[str, Path]:
    """The graph files of an output directory (by kind: decode, prefill) or of one .onnx file.

    `kind` picks one graph of an output directory; an unknown kind names the ones there are."""
    path = Path(path)
    if path.is_dir() and (path / "manifest.json").is_file():
        from qwen2om.output import read_manifest  # it refuses entries outside the directory

        files = {k: path / spec["file"] for k, spec in read_manifest(path)["graphs"].items()}
        if kind is not None:
            if kind not in files:
                raise Qwen2omError(f"--graph {kind!r}: {path} has the graphs {', '.join(files)}")
            files = {kind: files[kind]}
        return files
    if path.is_file() and path.suffix == ".onnx":
        if kind is not None:
            raise Qwen2omError(f"--graph {kind}: {path} is a single graph file (--graph picks a graph of an output "
                               "directory)")
        return {path.stem: path}
    raise Qwen2omError(f"{path}: not a qwen2om output directory (manifest.json) or an .onnx file")


def manifest_roles(path: Path) -> dict[str, dict[str, str]]:
    """Graph kind → {input/output name: role} from an output directory's manifest (empty for a file)."""
    manifest_path = Path(path) / "manifest.json"
    if not manifest_path.is_file():
        return {}
    from qwen2om.output import manifest_graphs

    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    return {kind: {io["name"]: io["role"] for side in ("inputs", "outputs") for io in spec[side]}
            for kind, (_, spec) in manifest_graphs(Path(path), manifest).items()}


def initializer_sha256(model: onnx.ModelProto, path: Path,
                       cache: dict[tuple[str, int, int], str] | None = None) -> dict[str, str]:
    """sha256 of each initializer's stored bytes (little-endian, as ONNX lays them out).

    External tensors are hashed straight from the data file in blocks; `cache` (keyed by file,
    offset, length) lets decode and prefill, which share one data file, hash each region once."""
    cache = {} if cache is None else cache
    sums: dict[str, str] = {}
    for init in model.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            loc = external_location(init)
            data = (path.parent / loc.get("location", "")).resolve()
            offset = int(loc.get("offset", 0))
            length = (int(loc["length"]) if "length" in loc
                      else math.ceil(itemsize(init.data_type) * math.prod(init.dims)))
            key = (str(data), offset, length)
            if key not in cache:
                cache[key] = file_span_sha256(data, offset, length)
            sums[init.name] = cache[key]
        elif init.raw_data:
            sums[init.name] = hashlib.sha256(init.raw_data).hexdigest()
        else:
            from onnx import numpy_helper

            sums[init.name] = hashlib.sha256(numpy_helper.to_array(init).tobytes()).hexdigest()
    return sums


def file_span_sha256(path: Path, offset: int, length: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = length
        while left > 0:
            chunk = f.read(min(BLOCK, left))
            if not chunk:
                raise Qwen2omError(f"{path}: ends before byte {offset + length}")
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()
