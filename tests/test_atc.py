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
    # The signature of an ort-target output, minus the decode graph's ONNX Runtime-only shared-cache outputs
    # (fuse_attention), is the static contract an Ascend graph has.
    graph["outputs"] = [o for o in graph["outputs"] if o["role"] not in ("cache_key", "cache_value")]
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


@pytest.mark.slow
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
    assert keep and all(any(k in n.lower() for k in ("norm", "softmax", "rotary")) for n in keep)
    assert any("/rotary/" in n for n in keep)  # RoPE stays fp32 under mixed precision too


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


# -- prefill gears (`convert --gears`): -1 token axes and --dynamic_dims --------------------------------
GEARS = ("target=ascend", "soc_version=Ascend910B3", "gears=8,16,32")  # conftest: P=256, prefill_chunk=32


def flag(cmd: list[str], name: str) -> str | None:
    return next((a.split("=", 1)[1] for a in cmd if a.startswith(f"--{name}=")), None)


def test_gears_every_input_once_and_each_gear_fills_every_dynamic_dim(converted) -> None:
    """Parsed back against the ONNX files themselves: every input once, symbolic axes as -1 and static ones
    with their real size; each --dynamic_dims gear gives one value per -1, and those values are what the
    graph's own dim expressions (`T`, `T+256`) evaluate to at that gear."""
    out = converted("tiny-qwen3", "fp16", *GEARS)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["graphs"]["prefill"]["gears"] == [8, 16, 32] and manifest["graphs"]["prefill"]["tokens"] == 32
    assert "gears" not in manifest["graphs"]["decode"]
    commands = json.loads((out / "ascend" / "atc_commands.json").read_text())["compile"]
    for cmd, (kind, spec) in zip(commands, manifest["graphs"].items(), strict=True):
        model = onnx.load(out / spec["file"], load_external_data=False)
        real = [(i.name, tuple(-1 if d.dim_param else d.dim_value for d in i.type.tensor_type.shape.dim))
                for i in model.graph.input]
        pairs = parse_input_shape(flag(cmd, "input_shape") or "")
        assert pairs == real and len({n for n, _ in pairs}) == len(pairs), kind
        gears = flag(cmd, "dynamic_dims")
        if kind == "decode":
            assert gears is None and all(-1 not in s for _, s in pairs)
            continue
        assert gears is not None and "--input_format=ND" in cmd
        exprs = [d.dim_param for i in model.graph.input for d in i.type.tensor_type.shape.dim if d.dim_param]
        assert exprs == ["T", "T", "T+256", "T"]  # input_ids [1,T], attention_mask [1,1,T,T+P], position_ids [1,T]
        listed = [[int(v) for v in g.split(",")] for g in gears.split(";")]
        minus_ones = sum(d == -1 for _, s in pairs for d in s)
        assert len(listed) == 3
        for t, values in zip([8, 16, 32], listed, strict=True):
            assert len(values) == minus_ones
            assert values == [eval(e, {}, {"T": t}) for e in exprs]  # noqa: S307 (the graph's own "T+256")
        # outputs: the new K/V follow T; logits (the last position only) stay static
        outs = {o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in model.graph.output}
        assert outs["present_key.0"] == [1, 2, "T", 32] and outs["logits"][1] == 1


def test_gears_command_from_roles() -> None:
    """atc_command alone (the library call): the -1 axes follow the roles; gear counts ATC refuses are refused."""
    graph = {"tokens": 4, "gears": [2, 4],
             "inputs": [{"name": "input_ids", "role": "ids", "shape": [1, 4]},
                        {"name": "attention_mask", "role": "mask", "shape": [1, 1, 4, 12]},
                        {"name": "position_ids", "role": "positions", "shape": [1, 4]},
                        {"name": "past_key.0", "role": "past_key", "shape": [1, 2, 8, 16]}],
             "outputs": [{"name": "logits", "role": "logits", "shape": [1, 1, 10]}]}
    cmd = atc_command("m.onnx", "m", graph, AtcOptions("Ascend910B3"))
    assert flag(cmd, "input_shape") == "input_ids:1,-1;attention_mask:1,1,-1,-1;position_ids:1,-1;past_key.0:1,2,8,16"
    assert flag(cmd, "dynamic_dims") == "2,2,10,2;4,4,12,4"
    assert cmd.index("--input_format=ND") < cmd.index("--dynamic_dims=2,2,10,2;4,4,12,4")
    assert parse_input_shape(flag(cmd, "input_shape") or "")[1] == ("attention_mask", (1, 1, -1, -1))
    for gears, message in (([4], "2..100 gears"), ([2, 8], "gear 8 is outside 1..4")):
        with pytest.raises(AtcError, match=message):
            atc_command("m.onnx", "m", {**graph, "gears": gears}, AtcOptions("Ascend910B3"))


def test_atc_does_not_import_the_recipe_module() -> None:
    """recipe → passes → compile_ascend → atc must not lead back to recipe: the limits both read live in targets.py."""
    import subprocess
    import sys

    code = ("import sys, qwen2om.atc, qwen2om.targets; "
            "assert 'qwen2om.recipe' not in sys.modules, 'qwen2om.atc imports qwen2om.recipe'")
    subprocess.run([sys.executable, "-c", code], check=True)
