"""`qwen2om inspect` (issue 8): --dump-graph (text, DOT, SVG/PNG), --diff, --checksums,
`convert --dump-graph`, and the bad inputs: a path of no known kind, a corrupt ONNX file, a
missing or truncated external data file, graphviz absent.

Golden files live in tests/golden/inspect/ (regenerate with QWEN2OM_GOLDEN=1); they hold no
absolute paths, timings or hashes, so they only change when the graphs do.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import struct
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import onnx
import pytest

from qwen2om.graphdump import EXIT_NO_GRAPHVIZ, PNG_MAX_PX

GOLDEN = Path(__file__).parent / "golden" / "inspect"
SHA = re.compile(r"^[0-9a-f]{64}$")
needs_dot = pytest.mark.skipif(shutil.which("dot") is None and not os.environ.get("CI"),
                               reason="graphviz's dot is not installed (apt-get install graphviz); CI installs it")


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
    assert "layers.3 · 39 nodes · 11 weights" in text  # the decode cache is shared, not sliced (fuse_attention)
    assert "past_key/value.3 → present_key/value.3, cache_key/value.3" in text  # its own KV, named in its box
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


@needs_dot
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


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the PNG's IHDR chunk."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def svg_boxes(svg: Path) -> dict[str, tuple[float, float, float, float]]:
    """(x0, y0, x1, y1) of each node and cluster of a graphviz SVG, by its DOT name (y grows downward)."""
    ns = {"s": "http://www.w3.org/2000/svg"}
    found = {}
    for g in ET.parse(svg).getroot().iterfind(".//s:g", ns):
        title, shape = g.find("s:title", ns), g.find(".//s:polygon", ns)
        shape = g.find(".//s:path", ns) if shape is None else shape  # rounded: a path, not a polygon
        if g.get("class") in ("node", "cluster") and title is not None and shape is not None:
            xy = [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", shape.get("points") or shape.get("d") or "")]
            found[title.text or ""] = (min(xy[0::2]), min(xy[1::2]), max(xy[0::2]), max(xy[1::2]))
    return found


@needs_dot
def test_png_fits_a_screen_svg_keeps_full_size(cli, tiny: Path, tmp_path: Path) -> None:
    """The default PNG is scaled down to PNG_MAX_PX (it was 2,903×3,623 px); the result says so and
    names the SVG, which is drawn at full size."""
    code, stdout, err = cli("inspect", tiny, "--dump-graph", tmp_path / "decode.png", "--json")
    assert code == 0, err
    result = json.loads(stdout)
    width, height = png_size(tmp_path / "decode.png")
    assert width <= PNG_MAX_PX[0] and height <= PNG_MAX_PX[1] == 1200
    assert max(width / PNG_MAX_PX[0], height / PNG_MAX_PX[1]) > 0.99  # scaled to fit, not smaller
    assert 0.4 < result["scale"] < 1 and "decode.svg draws every node and label at full size" in result["note"]
    code, stdout, err = cli("inspect", tiny, "--dump-graph", tmp_path / "decode.svg", "--json")
    assert code == 0 and json.loads(stdout)["scale"] == 1.0 and json.loads(stdout)["note"] == ""
    svg_height_pt = float(re.search(r'<svg width="[\d.]+pt" height="([\d.]+)pt"',
                                    (tmp_path / "decode.svg").read_text()).group(1))
    assert svg_height_pt * 96 / 72 > PNG_MAX_PX[1]  # the SVG is not scaled
    assert svg_height_pt * 96 / 72 * result["scale"] == pytest.approx(height, rel=0.01)  # the scale drawn at


def test_hybrid_state_io_coloured_and_in_the_legend(cli, converted, tmp_path: Path) -> None:
    """Qwen3.5's linear-attention layers: conv and recurrent state in and out, coloured by role like
    the KV cache, and named in the legend; a collapsed linear layer names its own states."""
    out = converted("tiny-qwen3-5", "fp32", "prefill_chunk=16")  # as test_hybrid_export converts it
    for source in (out, out / "model.decode.onnx"):  # roles from the manifest, or from the names
        dot = tmp_path / "hybrid.dot"
        code, _, err = cli("inspect", source, "--dump-graph", dot)
        assert code == 0, err
        text = dot.read_text()
        for node, colour in (("in:conv_state.0", "#e9d5ff"), ("in:recurrent_state.0", "#e9d5ff"),
                             ("out:present_conv_state.0", "#c084fc"), ("out:present_recurrent_state.0", "#c084fc")):
            fill = re.search(rf'"{re.escape(node)}" \[label="[^"]*", shape="ellipse", fillcolor="([^"]+)"', text)
            assert fill and fill.group(1) == colour, node
        assert '<td bgcolor="#e9d5ff">conv / recurrent state (in)</td>' in text
        assert '<td bgcolor="#c084fc">conv / recurrent state (out)</td>' in text
        assert "conv/recurrent_state.1 → present_conv/recurrent_state.1" in text  # in layers.1's box


def test_layer_boxes_in_order_in_one_column(cli, tiny: Path, tmp_path: Path) -> None:
    """Layers 0..3 are one column, in order, the drawn layer's place (L2) included and pointing at
    its cluster; what comes after the last layer hangs under the column."""
    out = tmp_path / "l2.dot"
    assert cli("inspect", tiny, "--dump-graph", out, "--layer", "2")[0] == 0
    text = out.read_text()
    assert re.search(r'\n  L2 \[label="layers.2 · 39 nodes\\ndrawn node by node"', text)
    assert '"L2" -> "n' in text and 'lhead="cluster_layer2"' in text
    chain = re.findall(r'^  "(L\d)" -> "(L\d)" \[style="invis"', text, re.M)
    assert chain == [("L0", "L1"), ("L1", "L2"), ("L2", "L3")]


@needs_dot
def test_layer_column_drawn_beside_the_cluster(cli, tiny: Path, tmp_path: Path) -> None:
    """As drawn: the four layers' boxes top to bottom, one above the other, beside the drawn layer's
    cluster (not under it, which made the picture as tall as both)."""
    for layer in (0, 2):
        svg = tmp_path / f"l{layer}.svg"
        assert cli("inspect", tiny, "--dump-graph", svg, "--layer", str(layer))[0] == 0
        boxes = svg_boxes(svg)
        column = [boxes[f"L{i}"] for i in range(4)]
        cluster = boxes[f"cluster_layer{layer}"]
        assert all(a[3] < b[1] for a, b in itertools.pairwise(column)), column  # in order, downward
        centres = [(x0 + x1) / 2 for x0, _, x1, _ in column]
        assert max(centres) - min(centres) < 2, centres  # one column
        assert all(x1 < cluster[0] or x0 > cluster[2] for x0, _, x1, _ in column)  # beside the cluster
        assert column[-1][3] < cluster[3]  # the last layer's box ends above the cluster's bottom


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


def test_help_shows_no_metavar_after_boolean_flags(cli, monkeypatch) -> None:
    """typer 0.29's rich help printed `--force <bool>`, as if the flag took a value: in every command's
    --help a flag is followed by its help text, any other option by its metavar (`<path>`, FILE)."""
    import re

    import typer.main
    from typer.core import TyperOption

    from qwen2om.cli import app

    def commands(cmd: object, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], object]]:
        subs = getattr(cmd, "commands", {})
        return [(path, cmd), *(c for name, sub in subs.items() for c in commands(sub, (*path, name)))]

    monkeypatch.setenv("COLUMNS", "200")
    found = commands(typer.main.get_command(app))
    assert {p for p, _ in found} >= {(), ("convert",), ("run",), ("eval",), ("eval", "ppl"), ("doctor",)}
    for path, cmd in found:
        code, stdout, _ = cli(*path, "--help")
        assert code == 0 and "<bool>" not in stdout, path
        options = [p for p in cmd.params if isinstance(p, TyperOption) and not p.hidden]  # type: ignore[attr-defined]
        for p in options:
            opt = next(o for o in p.opts if o.startswith("--"))
            row = re.search(rf"^│[\s*]*{re.escape(opt)}((?:\s+-[\w-]+)*)\s+(\S+)", stdout, re.M)
            assert row, (path, opt)
            if p.is_flag:
                assert not row[2].startswith("<"), (path, opt, row[0])
            else:
                assert row[2].startswith("<") or row[2] == p.metavar, (path, opt, row[0])
        assert re.search(r"^│\s+--help\s+Show this message", stdout, re.M), path


def test_fp8_checkpoint_title_says_the_format_once(cli) -> None:
    """The quantised-weights table of an FP8 checkpoint was titled "(fp8 · fp8)"."""
    code, stdout, _ = cli("inspect", "builtin:tiny-qwen3-fp8")
    text = " ".join(stdout.split())
    assert code == 0 and "quantised weights (fp8 · e4m3 · 128×128 blocks)" in text and "fp8 · fp8" not in text


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


@pytest.mark.slow
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
