"""The Ascend target: ATC-legal graphs, the exact atc invocation in OUT/ascend/, CPU runs through
the reference kernels (kernels/ascend.py), and the bad inputs of issue 7."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from qwen2om.ascend import problems
from qwen2om.atc import parse_input_shape
from qwen2om.convert import convert
from qwen2om.verify import verify

SMALL = ["max_seq_len=256", "prefill_chunk=32"]
GOLDEN = Path(__file__).parent / "golden" / "ascend"
FILES = ("compile.sh", "atc_commands.json", "keep_dtype.cfg", "modify_mixlist.json")


def calibrated(tmp_path_factory, model: str, **cfg: object) -> Path:
    from qwen2om.quant.calibrate import CalibrationConfig, calibrate

    out = tmp_path_factory.mktemp("ckpt") / "ckpt"
    calibrate(f"builtin:{model}", out, CalibrationConfig(num_samples=8, seq_len=64, **cfg))  # type: ignore[arg-type]
    return out


@pytest.fixture(scope="module")
def w4(tmp_path_factory) -> Path:
    """tiny-qwen3 calibrated W4A16 (RTN, group 32, symmetric), as compressed-tensors."""
    return calibrated(tmp_path_factory, "tiny-qwen3", method="rtn", group_size=32)


@pytest.fixture(scope="module")
def qwen2_quantized(tmp_path_factory) -> dict[str, Path]:
    """tiny-qwen2 (q/k/v biases) as W4A16 (RTN, group 32) and as FP8 (`--scheme fp8-block`)."""
    return {"w4a16": calibrated(tmp_path_factory, "tiny-qwen2", method="rtn", group_size=32),
            "fp8": calibrated(tmp_path_factory, "tiny-qwen2", scheme="fp8-block")}


@pytest.fixture(scope="module")
def ascend_out(tmp_path_factory, w4, qwen2_quantized) -> dict[str, Path]:
    """Ascend conversions (no CANN here: dry-run semantics): tiny qwen2/qwen3 in fp16, W4A16, FP8."""
    outs = {}
    for name, model, soc in (("qwen3-fp16", "builtin:tiny-qwen3", "Ascend910B3"),
                             ("qwen2-fp16", "builtin:tiny-qwen2", "Ascend910B3"),
                             ("qwen3-w4a16", str(w4), "Ascend910B3"),
                             ("qwen2-w4a16", str(qwen2_quantized["w4a16"]), "Ascend910_9392"),
                             ("qwen3-fp8", "builtin:tiny-qwen3-fp8", "Ascend310P3"),
                             ("qwen2-fp8", str(qwen2_quantized["fp8"]), "Ascend910B3")):
        outs[name] = tmp_path_factory.mktemp("ascend") / name
        convert(model, outs[name], overrides=[*SMALL, "target=ascend", f"soc_version={soc}"])
    return outs


@pytest.mark.parametrize("name", ["qwen3-fp16", "qwen2-fp16", "qwen3-w4a16", "qwen2-w4a16", "qwen3-fp8", "qwen2-fp8"])
def test_ascend_outputs_are_legal_and_list_every_input(ascend_out, name: str) -> None:
    out = ascend_out[name]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["recipe"]["target"] == "ascend" and manifest["recipe"]["dtype"] == "fp16"
    stats = {s["pass"]: s["stats"] for s in manifest["stages"]}
    assert stats["check_ascend"]["problems"] == 0 and stats["compile_ascend"]["atc"] == "not found"
    commands = json.loads((out / "ascend" / "atc_commands.json").read_text())["compile"]
    assert len(commands) == len(manifest["graphs"]) == 2
    for cmd, (kind, spec) in zip(commands, manifest["graphs"].items(), strict=True):
        model = onnx.load(out / spec["file"], load_external_data=False)
        assert not problems(ir.serde.deserialize_model(model))
        assert model.ir_version == 8 and {o.domain: o.version for o in model.opset_import}[""] <= 18
        # parsed back, --input_shape names every graph input exactly once, with its real shape
        shapes = parse_input_shape(next(a for a in cmd if a.startswith("--input_shape=")).split("=", 1)[1])
        real = [(i.name, tuple(d.dim_value for d in i.type.tensor_type.shape.dim)) for i in model.graph.input]
        assert shapes == real, kind
        assert f"--model=../{spec['file']}" in cmd and f"--output=model.{kind}" in cmd
        assert next(a for a in cmd if a.startswith("--out_nodes=")) == "--out_nodes=" + ";".join(
            o.name for o in model.graph.output)
    ops = {n.op_type for n in onnx.load(out / "model.decode.onnx", load_external_data=False).graph.node}
    if name.endswith("w4a16"):
        assert "WeightQuantBatchMatmulV2" in ops and "MatMulNBits" not in ops
    if name == "qwen3-fp8":  # e4m3 bytes decoded by a table Gather: no float8 tensor for the parser
        assert len([i for i in manifest["graphs"]["decode"]["inputs"] if i["role"] == "scale"]) == 4 * 7


@pytest.mark.parametrize("name", ["qwen3-fp16", "qwen3-w4a16", "qwen3-fp8"])
def test_golden_atc_files(ascend_out, name: str) -> None:
    """The command line and the files it names, byte for byte (regenerate with QWEN2OM_GOLDEN=1)."""
    for f in FILES:
        got = (ascend_out[name] / "ascend" / f).read_text()
        golden = GOLDEN / name / f
        if os.environ.get("QWEN2OM_GOLDEN"):
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_text(got)
        assert got == golden.read_text(), f"{name}/{f}"


@pytest.mark.parametrize(("name", "reference"), [
    ("qwen3-fp16", "builtin:tiny-qwen3"), ("qwen2-fp16", "builtin:tiny-qwen2"), ("qwen3-w4a16", "w4"),
    ("qwen2-w4a16", "w4a16"), ("qwen3-fp8", "builtin:tiny-qwen3-fp8"), ("qwen2-fp8", "fp8")])
def test_verify_through_reference_kernels(ascend_out, w4, qwen2_quantized, name: str, reference: str) -> None:
    """The Ascend-bound graphs run on CPU with each Ascend op decomposed, and match the reference
    (quantised: their own exact dequantisation; fp16 graphs: all greedy tokens, as for the ort target)."""
    ref = w4 if reference == "w4" else qwen2_quantized.get(reference, reference)
    report = verify(ascend_out[name], ref, tokens=16)
    assert report.passed and report.agreement == 1.0 and report.max_abs < 2e-2


def test_310b_needs_consent_for_w8a16(w4, tmp_path: Path, cli) -> None:
    code, _, err = cli("convert", w4, "-o", tmp_path / "out", "--soc-version", "Ascend310B1", "--max-seq-len", "256")
    assert code != 0 and "weight_storage=int8" in err and "W8A16" in err
    assert not (tmp_path / "out").exists()
    out = tmp_path / "w8"
    convert(w4, out, overrides=[*SMALL, "target=ascend", "soc_version=Ascend310B1", "weight_storage=int8"])
    decode = onnx.load(out / "model.decode.onnx", load_external_data=False)
    ops = [n.op_type for n in decode.graph.node]
    assert "AscendAntiQuant" not in ops and "WeightQuantBatchMatmulV2" not in ops  # issue 23: standard ops only
    int8 = {i.name for i in decode.graph.initializer if i.data_type == TensorProto.INT8}
    casts = [n for n in decode.graph.node if n.op_type == "Cast" and n.input[0] in int8]
    assert len(casts) == 4 * 7 and all(helper.get_attribute_value(n.attribute[0]) == TensorProto.FLOAT16 for n in casts)
    assert {i.name: i.data_type for i in decode.graph.initializer}[
        "model.layers.0.mlp.down_proj.weight_int8"] == TensorProto.INT8
    report = verify(out, w4, tokens=8, prompts=["The tiny model"])
    assert report.passed and report.agreement == 1.0
    code, stdout, _ = cli("inspect", out, "--check", "ascend", "--soc-version", "Ascend310B1", "--json")
    assert code == 0 and json.loads(stdout)["problems"] == {"decode": [], "prefill": []}


def test_unknown_soc_and_int4_in_fp32(w4, tmp_path: Path, cli) -> None:
    code, _, err = cli("convert", "builtin:tiny-qwen3", "-o", tmp_path / "a", "--soc-version", "Ascend999")
    assert code != 0 and "Ascend910B1..B4" in err and "Ascend310B1..B4" in err
    code, _, err = cli("convert", "builtin:tiny-qwen3", "-o", tmp_path / "a", "--target", "ascend")
    assert code != 0 and "needs --soc-version" in err
    code, _, err = cli("convert", w4, "-o", tmp_path / "b", "--soc-version", "Ascend910B3", "--dtype", "fp32",
                       "--max-seq-len", "256")
    assert code != 0 and "--dtype fp16" in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_int4_refusals_come_before_any_work(w4, tmp_path: Path, cli, monkeypatch) -> None:
    """310B without weight_storage=int8, and int4 in fp32, are lower_int4_ascend's refusals, and that
    pass runs after the ONNX export (minutes on a large model): convert asks the tensor table the same
    question first, so nothing is staged, exported or left behind."""
    import qwen2om.convert as conv
    from qwen2om.builtin import resolve_model
    from qwen2om.recipe import parse_overrides

    def untouchable(*args: object, **kwargs: object) -> None:
        raise AssertionError("convert started work before refusing")

    monkeypatch.setattr(conv, "staged_output", untouchable)
    for args, named in ((["--soc-version", "Ascend310B1"], "Rerun with --set weight_storage=int8"),
                        (["--soc-version", "Ascend910B3", "--dtype", "fp32"], "convert with --dtype fp16")):
        code, _, err = cli("convert", w4, "-o", tmp_path / "out", *args, "--max-seq-len", "256")
        assert code != 0 and named in err and "completed" not in err, err
        assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()
    for model, extra in ((resolve_model("builtin:tiny-qwen3"), []), (w4, ["weight_storage=int8"])):
        config = conv.read_config(model)
        r = conv.choose_recipe(config, None, parse_overrides(["target=ascend", "soc_version=Ascend310B1", *extra]))
        conv.preflight(config, r)  # float weights, or int4 stored as int8: nothing to refuse


def test_checker_lists_every_problem(tmp_path: Path, cli, converted, monkeypatch) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])
    nodes = [helper.make_node("Trilu", ["x"], ["t"], name="mask/Trilu"),
             helper.make_node("Cast", ["t"], ["q"], to=TensorProto.INT8, name="q/Cast"),
             helper.make_node("Cast", ["t"], ["b"], to=TensorProto.BFLOAT16, name="b/Cast"),
             helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", name="mm")]
    graph = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])],
                              [numpy_helper.from_array(np.zeros((4, 1, 2), np.uint8), "w"),
                               numpy_helper.from_array(np.ones(4, np.float32), "s"),
                               helper.make_tensor("bf", TensorProto.BFLOAT16, [2], [1.0, 2.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19),
                                                    helper.make_opsetid("com.microsoft", 1)])
    path = tmp_path / "bad.onnx"
    onnx.save(model, path)
    code, stdout, _ = cli("inspect", path, "--check", "ascend", "--json")
    found = json.loads(stdout)["problems"]["bad.onnx"]
    assert code == 1
    assert {(p["where"], p["what"]) for p in found} >= {
        ("model", "opset 19"), ("model", "domain com.microsoft"), ("mask/Trilu", "Trilu"),
        ("q/Cast", "Cast to int8"), ("b/Cast", "Cast to BFLOAT16"), ("bf", "BFLOAT16"),
        ("mm", "com.microsoft::MatMulNBits")}
    # An ONNX Runtime output is float ONNX except for the kernels `fuse_attention` and `fuse_norm`
    # put in: those, and only those, are listed.
    ort_out = converted("tiny-qwen3", "fp32")
    code, stdout, _ = cli("inspect", ort_out, "--check", "ascend", "--json")
    problems = [p for ps in json.loads(stdout)["problems"].values() for p in ps]
    assert code == 1 and problems
    assert {p["what"] for p in problems} == {
        "domain com.microsoft", "com.microsoft::GroupQueryAttention", "com.microsoft::RotaryEmbedding",
        "com.microsoft::SkipSimplifiedLayerNormalization"}
    # The table folds the repeats: one row per graph and kind of problem, with its count (was a row a node).
    monkeypatch.setenv("COLUMNS", "400")
    code, stdout, _ = cli("inspect", ort_out, "--check", "ascend")
    rows = [line for line in stdout.splitlines() if "com.microsoft::GroupQueryAttention" in line]
    layers = sum(p["what"] == "com.microsoft::GroupQueryAttention" for p in json.loads(
        cli("inspect", ort_out, "--check", "ascend", "--json")[1])["problems"]["decode"])
    assert code == 1 and len(rows) == 2  # decode and prefill
    assert re.search(rf"│\s+{layers} │", rows[0]) and f"({layers - 1} more)" in rows[0]


def fake_atc(bin_dir: Path, body: str) -> None:
    bin_dir.mkdir()
    atc = bin_dir / "atc"
    atc.write_text("#!/usr/bin/env bash\n" + body)
    atc.chmod(atc.stat().st_mode | stat.S_IXUSR)


@pytest.mark.slow
def test_atc_runs_when_installed(tmp_path: Path, monkeypatch) -> None:
    """With `atc` on PATH the compile runs from OUT/ascend/, its logs are kept, each .om and its
    --mode=1 JSON are written; --dry-run leaves atc alone."""
    fake_atc(tmp_path / "bin", 'echo "atc $*" >> calls.txt\n'
                               'for a in "$@"; do case $a in --output=*) touch "${a#--output=}.om";; '
                               '--json=*) echo "{}" > "${a#--json=}";; esac; done\n')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    out = tmp_path / "out"
    convert("builtin:tiny-qwen3", out, overrides=[*SMALL, "target=ascend", "soc_version=Ascend910B3"])
    d = out / "ascend"
    assert (d / "model.decode.om").is_file() and (d / "model.prefill.om").is_file()
    assert json.loads((d / "model.decode.json").read_text()) == {}
    assert (d / "atc.decode.log").is_file()
    calls = (d / "calls.txt").read_text().splitlines()
    assert len(calls) == 4 and "--soc_version=Ascend910B3" in calls[0] and "--mode=1 --om=model.decode.om" in calls[1]
    stats = next(s["stats"] for s in json.loads((out / "manifest.json").read_text())["stages"]
                 if s["pass"] == "compile_ascend")
    assert stats["compiled"] == 2
    dry = tmp_path / "dry"
    convert("builtin:tiny-qwen3", dry, overrides=[*SMALL, "target=ascend", "soc_version=Ascend910B3",
                                                  "compile=dry-run"])
    assert not list((dry / "ascend").glob("*.om")) and not (dry / "ascend" / "calls.txt").exists()


@pytest.mark.slow
def test_atc_failure_surfaces_its_errors(tmp_path: Path, monkeypatch, cli) -> None:
    fake_atc(tmp_path / "bin", 'echo "ATC start working now"\n'
                               'echo "E19010: No parser is registered for Op [/m/Foo, optype [ai.onnx::18::Foo]]."\n'
                               "exit 1\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    code, _, err = cli("convert", "builtin:tiny-qwen3", "-o", tmp_path / "out", "--soc-version", "Ascend910B3",
                       "--max-seq-len", "256")
    assert code != 0 and "E19010: No parser is registered" in err and "OUT was not written" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_next_hints_after_an_ascend_conversion_work_as_typed(cli, tmp_path: Path, monkeypatch) -> None:
    """The `next:` line after `convert --target ascend` named `python OUT/run.py`, which refuses Ascend
    ops; every command it names now runs as printed (run and verify on CPU, through the reference kernels)."""
    import shlex

    monkeypatch.chdir(tmp_path)
    code, stdout, err = cli("convert", "builtin:tiny-qwen3", "-o", "out", "--soc-version", "Ascend910B3", "--dry-run",
                            "--max-seq-len", "256", "--prefill-chunk", "32")
    assert code == 0, err
    commands = next(ln for ln in stdout.splitlines() if ln.startswith("next: ")).removeprefix("next: ").split("   |   ")
    assert "qwen2om inspect out --check ascend" in commands and "qwen2om verify out" in commands, commands
    assert not any("run.py" in c for c in commands)  # no .om compiled: nothing run.py can run here
    for command in commands:
        program, *args = shlex.split(command)
        code, _, err = cli(*args)
        assert program == "qwen2om" and code == 0, (command, err)


def test_run_ascend_output_on_cpu(ascend_out, cli, capsys) -> None:
    """`qwen2om run` runs an Ascend-target output through the reference kernels; the standalone
    run.py (no qwen2om installed) says why it cannot, instead of ONNX Runtime's load error."""
    from qwen2om.runtime import standalone

    out = ascend_out["qwen3-w4a16"]
    code, stdout, err = cli("run", out, "--prompt", "Hello", "--max-new-tokens", "4", "--greedy", "--json")
    assert code == 0, err
    assert len(json.loads(stdout)["tokens"]) == 4
    assert not [p for p in out.iterdir() if p.name.startswith(".cpu-view")]  # the temporary view is gone
    capsys.readouterr()
    assert standalone.main(["--prompt", "Hello", "--max-new-tokens", "2"], model_dir=out) == 2
    assert "holds Ascend ops" in capsys.readouterr().err
