"""Prefill gears (`convert --gears 8,16,32`): one prefill graph with a symbolic token count, compiled by
ATC with --dynamic_dims for Ascend, and run at the smallest gear that holds each chunk (ONNX Runtime)."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from qwen2om.ascend import problems
from qwen2om.atc import AtcError, dynamic_dims
from qwen2om.errors import RecipeError
from qwen2om.kernels.ascend import cpu_engine
from qwen2om.recipe import apply_overrides, load_recipe
from qwen2om.runtime import standalone
from qwen2om.runtime.standalone import RuntimeInputError, pick_gear
from qwen2om.verify import verify

GEARS = ("target=ascend", "soc_version=Ascend910B3", "gears=8,16,32")  # with conftest's P=256, prefill_chunk=32
GOLDEN = Path(__file__).parent / "golden" / "ascend" / "qwen3-fp16-gears"
# The command files; keep_dtype.cfg and modify_mixlist.json do not depend on gears (test_ascend's goldens).
FILES = ("compile.sh", "atc_commands.json")


@pytest.fixture(scope="module")
def out(converted) -> Path:
    return converted("tiny-qwen3", "fp16", *GEARS)


def test_golden_atc_files_with_gears(out: Path) -> None:
    """The command line with -1 token axes and --dynamic_dims, byte for byte (QWEN2OM_GOLDEN=1 regenerates)."""
    for f in FILES:
        got = (out / "ascend" / f).read_text()
        golden = GOLDEN / f
        if os.environ.get("QWEN2OM_GOLDEN"):
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_text(got)
        assert got == golden.read_text(), f


def test_gears_output_is_legal_and_verifies_at_every_gear(out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The legality checker passes, and `verify` (through ONNX Runtime, on CPU) matches transformers with
    the runtime picking the smallest gear per chunk: 5- and 13-token prompts, a 51-token one in two chunks."""
    manifest = json.loads((out / "manifest.json").read_text())
    stats = {s["pass"]: s["stats"] for s in manifest["stages"]}
    assert stats["check_ascend"]["problems"] == 0 and stats["compile_ascend"]["gears"] == "8,16,32"
    assert stats["check_outputs"]["graphs_run"] == 2  # the trial run: prefill at gears 8 and 32
    for spec in manifest["graphs"].values():
        assert not problems(ir.serde.deserialize_model(onnx.load(out / spec["file"], load_external_data=False)))
    used = counting_gears(monkeypatch)
    report = verify(out, "builtin:tiny-qwen3", tokens=16)
    assert report.passed and report.agreement == 1.0 and report.max_abs < 2e-2
    assert set(used) == {8, 16, 32}, used


def test_a_call_outside_the_gears_on_cpu(out: Path) -> None:
    engine = cpu_engine(out)
    g = engine.graphs["prefill"]
    assert g.gears == (8, 16, 32) and engine.graphs["decode"].gears == (1,)
    with pytest.raises(RuntimeInputError, match=r"outside the compiled range: the prefill model takes 8, 16, 32"):
        pick_gear(g.gears, 33, "prefill")
    with pytest.raises(RuntimeInputError, match=r"12 tokens is not a gear of this graph \(8, 16, 32\)"):
        g.run(12)
    ids = engine.encode("A prompt that is long enough for two chunks of prefill, or nearly so. " * 2)
    assert len(ids) > 32
    engine.reset()
    chunked = engine.prefill([ids])[0].copy()
    engine.reset()
    for tok in ids[:-1]:
        engine.step([tok])
    assert np.abs(chunked - engine.step([ids[-1]])[0]).max() < 2e-2


@pytest.mark.parametrize("overrides,message", [
    (["gears=0,16,32"], "gear 0 is not a positive token count"),
    (["gears=-8,32"], "gear -8 is not a positive token count"),
    (["gears=8,8,32"], "gear 8 is listed more than once"),
    (["gears=8,64"], r"gear 64 is outside 1..32 \(prefill_chunk"),
    (["gears=8,16"], "the largest gear is the prefill chunk, but prefill_chunk=32"),
    (["gears=32"], "one gear is a static prefill graph; use --prefill-chunk 32"),
    (["gears=8,x"], "'x' is not an integer token count"),
    ([f"gears={','.join(map(str, range(1, 102)))}", "prefill_chunk=101"], "at most 100"),
])
def test_bad_gears(overrides: list[str], message: str) -> None:
    base = load_recipe("qwen3-ascend-fp16")
    with pytest.raises(RecipeError, match=message):
        apply_overrides(base, ["max_seq_len=256", "prefill_chunk=32", "soc_version=Ascend910B3", *overrides]) \
            .resolved(4096)


def test_gears_resolve_the_prefill_chunk_and_stop_at_the_capacity() -> None:
    r = apply_overrides(load_recipe("qwen3-ascend-fp16"), ["soc_version=Ascend910B3", "gears=16,32,64,128"])
    assert r.resolved(40960).prefill_chunk == 128 and r.to_dict()["gears"] == [16, 32, 64, 128]
    with pytest.raises(RecipeError, match=r"gear 512 is outside 1..256 \(max_seq_len"):
        apply_overrides(load_recipe("qwen3-ascend-fp16"), ["soc_version=Ascend910B3", "gears=16,512",
                                                           "max_seq_len=256"])
    r = apply_overrides(load_recipe("qwen3-ascend-fp16"), ["soc_version=Ascend910B3", "gears=16,4096"])
    with pytest.raises(RecipeError, match=r"gear 4096 is outside 1..2048 \(max_seq_len"):  # auto: 2048
        r.resolved(40960)
    with pytest.raises(AtcError, match="gear 64 is outside 1..32"):
        dynamic_dims([{"name": "input_ids", "role": "ids", "shape": [1, 32]}], 32, [8, 64])


def test_gears_on_the_command_line(tmp_path: Path, cli) -> None:
    """Bad --gears stop before any work, in one line, and leave no OUT behind."""
    for args, message in (
        (["--gears", "16,16"], "gear 16 is listed more than once"),  # the ort target
        (["--soc-version", "Ascend910B3", "--gears", "16,16"], "gear 16 is listed more than once"),
        (["--soc-version", "Ascend910B3", "--gears", "16,64", "--prefill-chunk", "32"], "outside 1..32"),
    ):
        code, _, err = cli("convert", "builtin:tiny-qwen3", "-o", tmp_path / "o", "--max-seq-len", "256", *args)
        assert code != 0 and message in err and "Traceback" not in err, err
        assert not (tmp_path / "o").exists()
    code, _, err = cli("convert", "builtin:tiny-qwen3-5", "-o", tmp_path / "h", "--soc-version", "Ascend910B3",
                       "--gears", "16,32")
    assert code != 0 and "prefill gears are not supported for qwen3_5" in err and "Traceback" not in err
    assert not (tmp_path / "h").exists()


def counting_gears(monkeypatch: pytest.MonkeyPatch) -> Counter[int]:
    """Which gears the runtime's multi-gear graphs run at, from now on."""
    used: Counter[int] = Counter()
    run = standalone._Graph.run

    def counting(self: standalone._Graph, t: int) -> np.ndarray:
        if len(self.gears) > 1:
            used[t] += 1
        return run(self, t)

    monkeypatch.setattr(standalone._Graph, "run", counting)
    return used


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_ort_gears(converted, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """`--gears` on the ort target: one symbolic-T prefill graph whose attention (and experts) are still
    ONNX Runtime's kernels in every layer, exact against transformers in fp32 at every gear."""
    out = converted(name, "fp32", "gears=8,16,32")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["graphs"]["prefill"]["gears"] == [8, 16, 32] and manifest["recipe"]["target"] == "ort"
    stats = {s["pass"]: s["stats"] for s in manifest["stages"]}
    layers = manifest["dims"]["layers"]
    assert stats["fuse_attention"] == {
        "decode_fused_layers": layers, "decode_kept_layers": 0, "decode_rotary_layers": layers,
        "decode_shared_cache_layers": layers,
        "prefill_fused_layers": layers, "prefill_kept_layers": 0, "prefill_rotary_layers": layers}
    if name.endswith("-moe"):  # the exporter's T-sized routing zeros, shared between layers, do not stop it
        assert stats["fuse_moe"] == {"decode_fused_layers": layers, "decode_kept_layers": 0,
                                     "prefill_fused_layers": layers, "prefill_kept_layers": 0}
    prefill = onnx.load(out / "model.prefill.onnx", load_external_data=False).graph
    ids = next(i for i in prefill.input if i.name == "input_ids")
    assert [d.dim_param or d.dim_value for d in ids.type.tensor_type.shape.dim] == [1, "T"]
    assert sum(n.op_type == "GroupQueryAttention" for n in prefill.node) == layers
    assert not any(n.op_type == "Softmax" for n in prefill.node)
    used = counting_gears(monkeypatch)
    report = verify(out, f"builtin:{name}", tokens=16)
    assert report.passed and report.agreement == 1.0 and report.max_abs <= 1e-4
    assert set(used) == {8, 16, 32}, used


@pytest.mark.slow
def test_w4a16_with_gears(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """int4 linears (npu::WeightQuantBatchMatmulV2 between two Reshapes) on a symbolic-T graph: the
    Reshape back keeps T as its one -1; the output is legal and verifies at more than one gear."""
    from qwen2om.convert import convert
    from qwen2om.quant.calibrate import CalibrationConfig, calibrate

    ckpt, out = tmp_path / "w4", tmp_path / "out"
    calibrate("builtin:tiny-qwen3", ckpt, CalibrationConfig(num_samples=8, seq_len=64, method="rtn", group_size=32))
    convert(ckpt, out, overrides=["max_seq_len=256", "prefill_chunk=32", *GEARS])
    model = onnx.load(out / "model.prefill.onnx", load_external_data=False)
    assert "WeightQuantBatchMatmulV2" in {n.op_type for n in model.graph.node}
    assert not problems(ir.serde.deserialize_model(model))
    used: Counter[int] = Counter()
    run = standalone._Graph.run
    monkeypatch.setattr(standalone._Graph, "run", lambda self, t: (used.update([t]), run(self, t))[1])
    report = verify(out, ckpt, tokens=8, prompts=["The tiny model", "A prompt long enough for two chunks of the "
                                                  "prefill graph, which takes thirty-two tokens at most per call."])
    assert report.passed and report.agreement == 1.0 and report.max_abs < 2e-2
    assert len({t for t in used if t > 1}) >= 2, used
