"""The ATC command for the Ascend target: generated from the manifest, every input exactly once."""

from __future__ import annotations

import json

import onnx
import pytest

from qwen2om.atc import AtcError, AtcOptions, atc_command, keep_dtype_nodes, modify_mixlist, parse_input_shape, script
from qwen2om.convert import convert

SMALL = ["max_seq_len=256", "prefill_chunk=32"]


def kv(layers: int, t: int, kind: str) -> str:
    return ";".join(f"{kind}_{w}.{i}:1,2,{t},32" for i in range(layers) for w in ("key", "value"))


def test_golden_decode_command(converted) -> None:
    out = converted("tiny-qwen3")
    graph = json.loads((out / "manifest.json").read_text())["graphs"]["decode"]
    cmd = atc_command("model.decode.onnx", "model_decode", graph, AtcOptions("Ascend910B3"))
    assert cmd == [
        "atc", "--framework=5", "--model=model.decode.onnx", "--output=model_decode", "--soc_version=Ascend910B3",
        "--input_format=ND",
        "--input_shape=input_ids:1,1;attention_mask:1,1,1,257;position_ids:1,1;" + kv(4, 256, "past"),
        "--out_nodes=logits;" + kv(4, 1, "present").replace(":1,2,1,32", ""),
        "--precision_mode_v2=origin", "--log=error"]
    mixed = atc_command("m.onnx", "m", graph, AtcOptions("Ascend310P3", "mixed_float16", "info"),
                        keep_dtype_file="keep.cfg", mixlist_file="mix.json")
    assert mixed[-4:] == ["--precision_mode_v2=mixed_float16", "--keep_dtype=keep.cfg", "--modify_mixlist=mix.json",
                          "--log=info"]
    assert modify_mixlist() == {"black-list": {"to-add": ["Pow", "ReduceMean", "Sqrt", "Div", "Reciprocal",
                                                          "Softmax", "Sin", "Cos"]}}
    text = script([cmd])
    assert text.startswith("#!/usr/bin/env bash") and "'--input_shape=input_ids:1,1;" in text


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_every_graph_input_once_with_its_real_shape(tmp_path, kind: str) -> None:
    """Parsed back, --input_shape names every input of the ONNX graph itself (not the manifest),
    scale inputs included, exactly once, with its real shape."""
    out = tmp_path / "out"
    convert("builtin:tiny-qwen3-fp8", out, overrides=SMALL)  # FP8: 28 scale inputs
    graph = json.loads((out / "manifest.json").read_text())["graphs"][kind]
    cmd = atc_command(f"model.{kind}.onnx", f"model_{kind}", graph, AtcOptions("Ascend910B1"))
    pairs = parse_input_shape(next(a for a in cmd if a.startswith("--input_shape=")).split("=", 1)[1])
    model = onnx.load(out / f"model.{kind}.onnx", load_external_data=False)
    real = {i.name: tuple(d.dim_value for d in i.type.tensor_type.shape.dim) for i in model.graph.input}
    names = [n for n, _ in pairs]
    assert len(names) == len(set(names)) == len(real)
    assert dict(pairs) == real
    assert sum(n.endswith(".weight.scale") for n in names) == 28
    keep = keep_dtype_nodes(n.name for n in model.graph.node)
    assert keep and all("norm" in n.lower() or "softmax" in n.lower() for n in keep)


@pytest.mark.parametrize("opts,needle", [(AtcOptions("Ascend999"), "Ascend999"),
                                         (AtcOptions("Ascend910B3", precision="int8"), "int8"),
                                         (AtcOptions("Ascend910B3", log="loud"), "loud")])
def test_bad_options(opts: AtcOptions, needle: str) -> None:
    with pytest.raises(AtcError, match=needle):
        atc_command("m.onnx", "m", {"inputs": [], "outputs": []}, opts)


def test_parse_rejects_malformed() -> None:
    with pytest.raises(AtcError, match="not name:d0"):
        parse_input_shape("input_ids")
    assert parse_input_shape("a:1,2;b:") == [("a", (1, 2)), ("b", ())]
