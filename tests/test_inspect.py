"""`qwen2om inspect` (issue 8): --dump-graph (text, DOT, SVG/PNG), --diff, --checksums,
`convert --dump-graph`, and the bad inputs: a path of no known kind, a corrupt ONNX file, a
missing or truncated external data file, graphviz absent.

Golden files live in tests/golden/inspect/ (regenerate with QWEN2OM_GOLDEN=1); they hold no
absolute paths, timings or hashes, so they only change when the graphs do.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import onnx
import pytest

from qwen2om.graphdump import EXIT_NO_GRAPHVIZ

GOLDEN = Path(__file__).parent / "golden" / "inspect"
SHA = re.compile(r"^[0-9a-f]{64}$")


def check_golden(name: str, got: str) -> None:
    golden = GOLDEN / name
    if os.environ.get("QWEN2OM_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(got, encoding="utf-8")
    assert got == golden.read_text(encoding="utf-8"), f"{name} differs (QWEN2OM_GOLDEN=1 regenerates it)"


def scrub(value: Any, top: bool = True) -> Any:
    """What a golden JSON may hold: no paths of this machine (`path`, and a diff's `a` and `b`), no sha256s."""
    if isinstance(value, dict):
        drop = ("path", "a", "b") if top else ("path",)
        return {k: scrub(v, False) for k, v in value.items() if k not in drop}
    if isinstance(value, list):
        return [scrub(v, False) for v in value]
    if isinstance(value, str) and SHA.match(value):
        return "<sha256>"
    return value


@pytest.fixture(scope="module")
def tiny(converted) -> Path:
    return converted("tiny-qwen3", "fp32")


@pytest.fixture(scope="module")
def fp8(converted) -> Path:
    """FP8 with its block scales as graph inputs (role scale)."""
    return converted("tiny-qwen3-fp8", "fp32")


def test_dump_graph_text_golden(cli, tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "decode.txt"
    code, stdout, err = cli("inspect", tiny, "--dump-graph", out)
    assert code == 0, err
    assert "layer 0 node by node, 3 other layers as one box each" in " ".join(stdout.split())
    text = out.read_text()
    check_golden("tiny-qwen3.decode.txt", text)
    assert str(tmp_path) not in text and str(tiny) not in text
    # one line per drawn node, model-named; the other layers one line each
    assert "/model/layers.0/self_attn/q_proj/MatMul  MatMul  " in text
    assert "/model/layers.1/" not in text
    assert [line.split()[0] for line in text.splitlines() if "(collapsed)" in line] == ["layers.1", "layers.2",
                                                                                        "layers.3"]
    assert "past_key.2 float32[1,2,256,32]" in text  # edges carry dtype and shape


def test_dump_graph_dot_golden(cli, tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "decode.dot"
    assert cli("inspect", tiny, "--dump-graph", out)[0] == 0
    text = out.read_text()
    check_golden("tiny-qwen3.decode.dot", text)
    assert text.startswith('digraph "decode (model.decode.onnx)"')
    assert 'subgraph "cluster_layer0"' in text and 'subgraph "cluster_layer0_self_attn"' in text
    assert "layers.3 · 39 nodes · 16 weights" in text  # the decode cache is shared, not sliced (fuse_attention)
    assert 'label="float32[1,1,64]"' in text  # the residual stream between layers
    past = re.search(r'"in:past_key.0" \[label="past_key.0\\nfloat32\[1,2,256,32\]", shape="ellipse", '
                     r'fillcolor="([^"]+)"', text)
    assert past and past.group(1) == "#fed7aa"


def test_layer_and_full_and_prefill(cli, tiny: Path, tmp_path: Path) -> None:
    code, _, err = cli("inspect", tiny, "--dump-graph", tmp_path / "l2.txt", "--layer", "2", "--graph", "prefill")
    assert code == 0, err
    text = (tmp_path / "l2.txt").read_text()
    assert text.startswith("# prefill (model.prefill.onnx)") and "/model/layers.2/mlp/down_proj/MatMul" in text
    assert "layers.0 (collapsed)" in text and "/model/layers.0/" not in text
    assert cli("inspect", tiny, "--dump-graph", tmp_path / "full.txt", "--full")[0] == 0
    full = (tmp_path / "full.txt").read_text()
    assert "(collapsed)" not in full and all(f"/model/layers.{i}/self_attn/o_proj/MatMul" in full for i in range(4))
    code, _, err = cli("inspect", tiny, "--dump-graph", tmp_path / "x.txt", "--layer", "9")
    assert code == 2 and "--layer 9: the graph has layers 0-3" in err
    code, _, err = cli("inspect", tiny, "--dump-graph", tmp_path / "x.txt", "--graph", "draft")
    assert code == 2 and "has the graphs decode, prefill" in err
    code, _, err = cli("inspect", tiny, "--dump-graph", tmp_path / "x.jpg")
    assert code == 2 and ".dot, .svg, .png, .txt" in err
    code, _, err = cli("inspect", tiny, "--layer", "2")
    assert code == 2 and "go with --dump-graph" in err
    # a single .onnx file works too (roles from the names: past_key.N, *.scale)
    code, _, err = cli("inspect", tiny / "model.decode.onnx", "--dump-graph", tmp_path / "one.txt")
    assert code == 0, err
    assert "input  past_key.0  float32[1,2,256,32]  past_key" in (tmp_path / "one.txt").read_text()


def test_scale_inputs_coloured_in_their_layer(cli, fp8: Path, tmp_path: Path) -> None:
    """Graph without value_info for the FP8 dequantisation: shapes come from ONNX shape inference."""
    out = tmp_path / "fp8.dot"
    assert cli("inspect", fp8, "--dump-graph", out, "--layer", "1")[0] == 0
    text = out.read_text()
    scale = re.search(r'"in:model.layers.1.mlp.gate_proj.weight.scale" \[label="[^"]*", shape="ellipse", '
                      r'fillcolor="([^"]+)"', text)
    assert scale and scale.group(1) == "#fde047"
    assert '"in:model.layers.0.mlp.gate_proj.weight.scale"' not in text  # folded into the layers.0 box
    assert "7 scale inputs" in text
    assert 'label="float32[?]"' not in text and "?[" not in text  # every edge typed


@pytest.mark.skipif(shutil.which("dot") is None and not os.environ.get("CI"),
                    reason="graphviz's dot is not installed (apt-get install graphviz); CI installs it")
def test_render_svg_and_png(cli, tiny: Path, tmp_path: Path) -> None:
    for fmt in ("svg", "png"):
        out = tmp_path / f"decode.{fmt}"
        code, stdout, err = cli("inspect", tiny, "--dump-graph", out)
        assert code == 0, err
        assert not out.with_suffix(".dot").exists()
    svg = (tmp_path / "decode.svg").read_text()
    assert "/model/layers.0/self_attn/q_proj/MatMul" in svg and "#fed7aa" in svg
    png = (tmp_path / "decode.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) < 1 << 20


def test_graphviz_absent(cli, tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # shutil.which("dot") finds nothing
    out = tmp_path / "decode.png"
    code, _, err = cli("inspect", tiny, "--dump-graph", out)
    err = " ".join(err.split())
    assert code == EXIT_NO_GRAPHVIZ == 3
    assert "graphviz's `dot` is not installed" in err and "apt-get install graphviz" in err
    assert str(out.with_suffix(".dot")) in err
    assert not out.exists() and out.with_suffix(".dot").read_text().startswith("digraph")
    assert "Traceback" not in err
    # .dot and .txt need no graphviz
    assert cli("inspect", tiny, "--dump-graph", tmp_path / "d.txt")[0] == 0


def test_help_documents_exit_codes(cli) -> None:
    code, stdout, _ = cli("inspect", "--help")
    text = " ".join(stdout.split())
    assert code == 0 and "3 = --dump-graph .svg/.png but graphviz" in text
    assert "1 = --diff: PATH and OTHER differ" in text and "2 = bad input" in text


def test_help_paragraphs_wrap_to_the_terminal(cli, monkeypatch) -> None:
    """typer prints a docstring's lines as they are: at 80 columns a 100-column line was cut in two
    ("Writes a" / "compressed-tensors checkpoint"); a wide terminal shows each paragraph on one line."""
    from qwen2om.cli import unwrapped

    monkeypatch.setenv("COLUMNS", "300")
    code, stdout, _ = cli("calibrate", "--help")
    assert code == 0
    assert any("Layer by layer" in line and "calibration_report.json" in line for line in stdout.splitlines())
    assert unwrapped("""First.

        Second paragraph, cut
        in two. Exit codes: 0 = fine;
        1 = not fine
        - an item""") == "First.\n\nSecond paragraph, cut in two. Exit codes: 0 = fine;\n1 = not fine\n- an item"


def test_top_level_help_names_real_builtins(cli) -> None:
    import re

    from qwen2om.builtin import builtin_names

    code, stdout, _ = cli("--help")
    named = set(re.findall(r"\btiny-[\w-]+", stdout))
    assert code == 0 and len(named) >= 5 and named <= set(builtin_names()), named - set(builtin_names())


def test_version_names_qwen2om_and_its_tools(cli) -> None:
    import importlib.metadata

    code, stdout, _ = cli("--version")
    first, tools = stdout.splitlines()[:2]
    assert code == 0 and first == f"qwen2om {importlib.metadata.version('qwen2om')}"
    assert f"onnxruntime {importlib.metadata.version('onnxruntime')}" in tools


def test_calibrate_takes_converts_dtype_spellings() -> None:
    from qwen2om.quant.calibrate import calibration_config

    assert [calibration_config(None, {"compute_dtype": d}).compute_dtype for d in ("fp16", "bf16", "fp32")] == [
        "float16", "bfloat16", "float32"]


def test_inspect_json_golden(cli, tiny: Path) -> None:
    code, stdout, err = cli("inspect", tiny, "--json")
    assert code == 0, err
    info = json.loads(stdout)
    assert info["graphs"]["decode"]["external_data"]["model.onnx.data"] > 30 << 20  # sizes, from the graph alone
    assert "checksums" not in info["graphs"]["decode"]  # weights are not read unless asked
    info["source"] = {"model": info["source"]["model"]}
    check_golden("tiny-qwen3.inspect.json", json.dumps(scrub(info), indent=2) + "\n")


def test_checksums(cli, tiny: Path) -> None:
    code, stdout, err = cli("inspect", tiny, "--json", "--checksums")
    assert code == 0, err
    decode = json.loads(stdout)["graphs"]["decode"]["checksums"]
    prefill = json.loads(stdout)["graphs"]["prefill"]["checksums"]
    model = onnx.load(tiny / "model.decode.onnx")  # with its weights: the reference hash
    from hashlib import sha256

    from onnx import numpy_helper

    for init in model.graph.initializer:
        assert decode[init.name] == sha256(numpy_helper.to_array(init).tobytes()).hexdigest(), init.name
    assert decode["model.layers.0.mlp.up_proj.weight"] == prefill["model.layers.0.mlp.up_proj.weight"]
    code, stdout, _ = cli("inspect", tiny, "--checksums")
    hashed = f"weights sha256: {len(model.graph.initializer)} initializers hashed"  # the decode graph's, every one
    assert code == 0 and hashed in " ".join(stdout.split())


def test_diff_identical_then_one_weight_changed(cli, tiny: Path, tmp_path: Path) -> None:
    code, stdout, _ = cli("inspect", tiny, tiny, "--diff", "--checksums")
    assert code == 0 and "no differences" in stdout
    copy = tmp_path / "copy"
    shutil.copytree(tiny, copy)
    model = onnx.load(copy / "model.decode.onnx", load_external_data=False)
    w = next(i for i in model.graph.initializer if i.name == "model.layers.2.mlp.down_proj.weight")
    offset = int({e.key: e.value for e in w.external_data}["offset"])
    with open(copy / "model.onnx.data", "r+b") as f:  # one byte of one weight, behind the manifest's back
        f.seek(offset + 100)
        byte = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert cli("inspect", tiny, copy, "--diff")[0] == 0  # without --checksums the weights are not read
    code, stdout, _ = cli("inspect", tiny, copy, "--diff", "--checksums", "--json")
    result = json.loads(stdout)
    assert code == 1 and not result["identical"]
    assert {(d["graph"], d["section"], d["name"]) for d in result["differences"]} == {
        ("decode", "checksums", "model.layers.2.mlp.down_proj.weight"),
        ("prefill", "checksums", "model.layers.2.mlp.down_proj.weight")}


def test_diff_golden_fp32_vs_fp16(cli, tiny: Path, converted) -> None:
    fp16 = converted("tiny-qwen3", "fp16")
    code, stdout, err = cli("inspect", tiny, fp16, "--diff", "--json")
    assert code == 1, err
    result = json.loads(stdout)
    sections = {d["section"] for d in result["differences"]}
    assert {"inputs", "outputs", "initializers", "recipe", "files"} <= sections
    row = next(d for d in result["differences"] if d["section"] == "inputs" and d["name"] == "past_key.0")
    assert (row["graph"], row["a"], row["b"]) == ("decode", "float32[1,2,256,32]", "float16[1,2,256,32]")
    check_golden("tiny-qwen3.fp32-vs-fp16.diff.json", json.dumps(scrub(result), indent=2) + "\n")
    code, stdout, _ = cli("inspect", tiny, fp16, "--diff")
    # 158: the decode graph's cache_key/value outputs (fuse_attention's shared cache) differ in dtype too
    assert code == 1 and "158 difference(s)" in stdout


def test_diff_two_onnx_files_and_wrong_pairs(cli, tiny: Path) -> None:
    code, stdout, _ = cli("inspect", tiny / "model.decode.onnx", tiny / "model.prefill.onnx", "--diff", "--json")
    rows = json.loads(stdout)["differences"]
    assert code == 1 and {"graph"} == {d["graph"] for d in rows}
    assert {"input_ids": ("int64[1,1]", "int64[1,32]")}.items() <= {
        d["name"]: (d["a"], d["b"]) for d in rows if d["section"] == "inputs"}.items()
    code, _, err = cli("inspect", tiny, tiny / "model.decode.onnx", "--diff")
    assert code == 2 and "compare two output directories or two .onnx files" in " ".join(err.split())
    code, _, err = cli("inspect", tiny, "--diff")
    assert code == 2 and "--diff needs two paths" in err
    code, _, err = cli("inspect", tiny, tiny)
    assert code == 2 and "only read with --diff" in err


def test_convert_dump_graph_after_each_pass(cli, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, _, err = cli("convert", "builtin:tiny-qwen3", "-o", out, "--max-seq-len", "256", "--prefill-chunk", "32",
                       "--dump-graph", "--json")
    assert code == 0, err
    graphs = out / "graphs"
    manifest = json.loads((out / "manifest.json").read_text())
    passes = manifest["recipe"]["pipeline"]
    export = passes.index("export_onnx") + 1
    for i, name in enumerate(passes[export - 1:], start=export):
        for kind in ("decode", "prefill"):
            assert (graphs / f"{i:02d}_{name}.{kind}.txt").is_file(), (i, name, kind)
    assert not list(graphs.glob(f"{export - 1:02d}_*"))  # no graph before the export
    assert (graphs / "summary.txt").is_file()  # package's summary is kept
    assert "graphs/05_export_onnx.decode.txt" in {f["name"] for f in manifest["files"]}
    # the files of a pass that changed nothing differ from the one before only in their title
    before = (graphs / f"{passes.index('lower_int4'):02d}_legalize_ort.decode.txt").read_text().splitlines()
    after = (graphs / f"{passes.index('lower_int4') + 1:02d}_lower_int4.decode.txt").read_text().splitlines()
    assert before[1:] == after[1:] and before[0] != after[0]
    last = (graphs / f"{len(passes):02d}_check_outputs.decode.txt").read_text()
    assert "/model/layers.3/mlp/down_proj/MatMul  MatMul" in last and "(collapsed)" not in last
    assert str(tmp_path) not in last


def test_path_of_no_known_kind(cli, tmp_path: Path) -> None:
    code, _, err = cli("inspect", tmp_path)
    assert code == 2 and "not a qwen2om output directory" in err and "a directory without any of them" in err
    code, _, err = cli("inspect", tmp_path / "nothing-here")
    assert code == 2 and "does not exist" in err
    (tmp_path / "notes.md").write_text("hello")
    code, _, err = cli("inspect", tmp_path / "notes.md")
    assert code == 2 and "it is a .md file" in err
    (tmp_path / "g.onnx").write_bytes(b"")
    code, _, err = cli("inspect", tmp_path)
    assert code == 2 and "g.onnx: inspect one of those files" in " ".join(err.split())
    for args in (("--dump-graph", tmp_path / "x.txt"), ("--check", "ascend")):
        code, _, err = cli("inspect", tmp_path / "notes.md", *args)
        assert code == 2 and "Traceback" not in err


@pytest.mark.parametrize("how", ["garbage", "empty", "truncated"])
def test_corrupt_onnx(cli, tiny: Path, tmp_path: Path, how: str) -> None:
    bad = tmp_path / "model.decode.onnx"
    shutil.copy(tiny / "model.onnx.data", tmp_path / "model.onnx.data")
    real = (tiny / "model.decode.onnx").read_bytes()
    bad.write_bytes({"garbage": b"\x08\x07not a model at all", "empty": b"", "truncated": real[:len(real) // 2]}[how])
    for args in ((), ("--json",), ("--dump-graph", tmp_path / "x.txt"), ("--check", "ascend"),
                 (bad, "--diff")):
        code, _, err = cli("inspect", bad, *args)
        assert code == 2, (how, args)
        assert "not a readable ONNX model" in err and "model.decode.onnx" in err and "Traceback" not in err


@pytest.mark.parametrize("how", ["missing", "truncated"])
def test_external_data_missing_or_short(cli, tiny: Path, tmp_path: Path, how: str) -> None:
    graph = tmp_path / "model.decode.onnx"
    shutil.copy(tiny / "model.decode.onnx", graph)
    if how == "truncated":
        with open(tmp_path / "model.onnx.data", "wb") as f:
            f.truncate((tiny / "model.onnx.data").stat().st_size - 4096)
    for args in ((), ("--dump-graph", tmp_path / "x.txt"), ("--check", "ascend"), (graph, "--diff")):
        code, _, err = cli("inspect", graph, *args)
        err = " ".join(err.split())
        assert code == 2, args
        assert "model.onnx.data" in err and "Traceback" not in err
        assert ("which is missing" in err) if how == "missing" else ("is truncated" in err)
    # a data file of the right length is not read (all zeros here): inspect succeeds
    with open(tmp_path / "model.onnx.data", "wb") as f:
        f.truncate((tiny / "model.onnx.data").stat().st_size)
    assert cli("inspect", graph)[0] == 0
