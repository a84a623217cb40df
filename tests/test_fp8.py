"""FP8 checkpoints (Hugging Face fine-grained and compressed-tensors) in, e4m3fn weights + scale inputs out."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from edits import convert_fails, edit_tensor
from safetensors.torch import load_file, save_file

from qwen2om.checkpoint import Checkpoint
from qwen2om.convert import convert
from qwen2om.errors import PlanError
from qwen2om.fixtures.fp8 import quantize_tiles, write_fp8_checkpoint
from qwen2om.quant import fp8
from qwen2om.verify import verify

SMALL = ["max_seq_len=256", "prefill_chunk=32"]
RAGGED = "model.layers.1.mlp.gate_proj.weight"  # [160, 64]: two row tiles, the second 32 rows deep


def tile_loop_dequant(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The format's definition, one tile at a time: w = q · scale, the last tiles partial."""
    out = torch.empty(q.shape)
    bn, bk = block
    for i in range(math.ceil(q.shape[0] / bn)):
        for j in range(math.ceil(q.shape[1] / bk)):
            out[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (
                q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float() * scale[i, j].float())
    return out


def test_quantizer_matches_the_fixture_generator() -> None:
    torch.manual_seed(0)
    w = torch.randn(200, 300) * 0.05
    w[:128, :128] = 0  # an all-zero tile: scale 1, never 0
    q, s = fp8.quantize(w)
    q2, s2 = quantize_tiles(w, (128, 128), torch.float32)
    assert s.shape == (2, 3) and torch.equal(s, s2) and float(s[0, 0]) == 1.0
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8))
    assert torch.equal(fp8.dequantize(q, s, (128, 128)), tile_loop_dequant(q, s, (128, 128)))
    err = (fp8.dequantize(q, s, (128, 128)) - w).abs() / fp8.expand(s, 200, 300, (128, 128))
    assert float(err.max()) <= 16  # e4m3's step at the top of the range is 32: half a step at most


def test_reads_hf_fp8_ragged(checkpoint) -> None:
    ckpt = Checkpoint(checkpoint("tiny-qwen3-fp8"))
    ckpt.validate_layout()
    assert len(ckpt.quantized) == 4 * 7
    q = ckpt.quantized[RAGGED]
    assert (q.n, q.k, q.block, q.scale_shape) == (160, 64, (128, 128), (2, 1))
    assert ckpt.info(q.scale_name).dtype == torch.bfloat16
    want = tile_loop_dequant(ckpt.raw(RAGGED), ckpt.raw(q.scale_name), (128, 128))
    assert torch.equal(ckpt.get(RAGGED), want)
    assert torch.equal(ckpt.get(RAGGED, rows=(100, 150)), want[100:150])  # rows across the tile edge
    float_ckpt = Checkpoint(checkpoint("tiny-qwen3"))
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.q_norm.weight"):
        assert name not in ckpt.quantized
        assert torch.equal(ckpt.get(name), float_ckpt.get(name))


@pytest.fixture(scope="module")
def fp8_out(checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fp8") / "out"
    convert("builtin:tiny-qwen3-fp8", out, overrides=SMALL)
    return out


def test_export_keeps_fp8_and_scale_inputs(fp8_out: Path, checkpoint) -> None:
    manifest = json.loads((fp8_out / "manifest.json").read_text())
    scale_map = json.loads((fp8_out / "scale_map.json").read_text())
    ckpt = Checkpoint(checkpoint("tiny-qwen3-fp8"))
    assert len(scale_map) == 28
    for kind in ("decode", "prefill"):
        model = onnx.load(fp8_out / f"model.{kind}.onnx", load_external_data=False)
        assert model.ir_version >= 9 and {o.domain: o.version for o in model.opset_import}[""] == 19
        fp8_inits = {i.name for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT8E4M3FN}
        assert len(fp8_inits) == 28
        scale_inputs = {i.name: i for i in model.graph.input if i.name.endswith(".weight.scale")}
        assert set(scale_inputs) == set(scale_map)
        for value in scale_inputs.values():
            assert value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
        roles = {io["name"]: io["role"] for io in manifest["graphs"][kind]["inputs"]}
        assert {n for n, r in roles.items() if r == "scale"} == set(scale_map)
    e = scale_map["model.layers.1.mlp.gate_proj.weight.scale"]
    assert e == {"source": "model.layers.1.mlp.gate_proj.weight_scale_inv", "layer": 1,
                 "module": "model.layers.1.mlp.gate_proj", "weight": RAGGED, "shape": [2, 1], "dtype": "float32",
                 "scheme": "fp8", "format": "fp8", "block_size": [128, 128]}
    stored = load_file(fp8_out / "scales.safetensors")
    assert stored["model.layers.1.mlp.gate_proj.weight.scale"].dtype == torch.float32
    assert torch.equal(stored["model.layers.1.mlp.gate_proj.weight.scale"],
                       ckpt.raw(e["source"]).float())
    checks = next(s for s in manifest["stages"] if s["pass"] == "check_scales")["stats"]
    assert [x["layer"] for x in checks["layers"]] == [0, 1, 2, 3]
    assert 0 < checks["min"] <= checks["max"]


@pytest.mark.numerics
def test_verify_fp8_against_exact_dequantisation(fp8_out: Path) -> None:
    report = verify(fp8_out, "builtin:tiny-qwen3-fp8", tokens=32)
    assert len(report.prompts) == 3 and max(p.prompt_tokens for p in report.prompts) > 32  # spans two chunks
    assert report.passed and report.max_abs <= 1e-4 and report.agreement == 1.0


def test_verify_against_the_float_original_reports_the_error(fp8_out: Path) -> None:
    report = verify(fp8_out, "builtin:tiny-qwen3", tokens=8)
    assert report.max_abs > 1e-3  # FP8 rounding is visible, and verify says so instead of hiding it
    assert not report.passed


@pytest.mark.parametrize("fmt,scale_dtype", [("hf", torch.float32), ("hf", torch.float16),
                                             ("ct-block", torch.bfloat16), ("ct-channel", torch.float32)])
@pytest.mark.slow
def test_layouts_and_scale_dtypes(checkpoint, tmp_path: Path, fmt: str, scale_dtype: torch.dtype) -> None:
    src = write_fp8_checkpoint(checkpoint("tiny-qwen3"), tmp_path / "ckpt", fmt=fmt, scale_dtype=scale_dtype)
    ckpt = Checkpoint(src)
    q = ckpt.quantized[RAGGED]
    assert q.block == ((1, 64) if fmt == "ct-channel" else (128, 128))
    assert torch.equal(ckpt.get(RAGGED), tile_loop_dequant(ckpt.raw(RAGGED), ckpt.raw(q.scale_name).reshape(
        q.scale_shape), q.block))
    out = tmp_path / "out"
    convert(src, out, overrides=SMALL)
    report = verify(out, src, tokens=8, prompts=["The quick brown fox"])
    assert report.passed and report.max_abs <= 1e-4


def write_recipe(tmp_path: Path, fp8_line: str) -> Path:
    import importlib.resources

    text = (importlib.resources.files("qwen2om.recipes") / "ort.yaml").read_text()
    lines = [fp8_line if line.strip().startswith("- lower_fp8") else line for line in text.splitlines()]
    path = tmp_path / "recipe.yaml"
    path.write_text("\n".join(line for line in lines if line is not None) + "\n")
    return path


@pytest.mark.slow
def test_bytes_storage_for_targets_without_fp8(tmp_path: Path) -> None:
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path, "  - lower_fp8: {storage: bytes}")
    convert("builtin:tiny-qwen3-fp8", out, recipe=str(recipe), overrides=SMALL)
    model = onnx.load(out / "model.decode.onnx", load_external_data=False)
    assert model.ir_version == 8 and {o.domain: o.version for o in model.opset_import}[""] == 18
    types = {i.data_type for i in model.graph.initializer}
    assert onnx.TensorProto.FLOAT8E4M3FN not in types
    assert sum(n.op_type == "Gather" and "fp8" in n.name for n in model.graph.node) == 28
    report = verify(out, "builtin:tiny-qwen3-fp8", tokens=8, prompts=["The quick brown fox"])
    assert report.passed and report.max_abs <= 1e-4


@pytest.mark.slow
def test_upcast_at_conversion(tmp_path: Path) -> None:
    """Without lower_fp8 the weights are dequantised once, at conversion: plain float MatMuls. The passes
    that work on lowered scales go too: left in, scale_inputs would lift none (the plan refuses it)."""
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path, "")
    with pytest.raises(PlanError, match=r"'scale_inputs' needs \['fp8_lowered'\]"):
        convert("builtin:tiny-qwen3-fp8", out, recipe=str(recipe), overrides=[*SMALL, "scales=constants"])
    kept = [line for line in recipe.read_text().splitlines() if not line.strip().startswith("- scale_inputs")]
    recipe.write_text("\n".join(kept) + "\n")
    convert("builtin:tiny-qwen3-fp8", out, recipe=str(recipe), overrides=[*SMALL, "scales=constants"])
    model = onnx.load(out / "model.decode.onnx", load_external_data=False)
    assert not [i for i in model.graph.input if i.name.endswith(".scale")]
    assert not (out / "scale_map.json").exists()
    report = verify(out, "builtin:tiny-qwen3-fp8", tokens=8, prompts=["The quick brown fox"])
    assert report.passed and report.max_abs <= 1e-4


@pytest.mark.slow
def test_scales_as_constants(tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert("builtin:tiny-qwen3-fp8", out, overrides=[*SMALL, "scales=constants"])
    model = onnx.load(out / "model.decode.onnx", load_external_data=False)
    assert not [i for i in model.graph.input if i.name.endswith(".scale")]
    assert sum(i.name.endswith(".weight_fp8_scale") for i in model.graph.initializer) == 28
    report = verify(out, "builtin:tiny-qwen3-fp8", tokens=8, prompts=["The quick brown fox"])
    assert report.passed and report.max_abs <= 1e-4


def test_transformers_loads_aligned_fp8_exactly(checkpoint) -> None:
    """Where every dimension is a multiple of 128, transformers' own CPU load (which dequantises)
    holds exactly the weights qwen2om's exact dequantisation gives."""
    import transformers

    path = checkpoint("tiny-qwen3-trained-fp8")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ckpt = Checkpoint(path)
    state = model.state_dict()
    assert len(ckpt.quantized) == 28
    for name in ckpt.quantized:
        assert torch.equal(state[name], ckpt.get(name)), name


def test_transformers_mis_sizes_ragged_tiles(checkpoint) -> None:
    """transformers 5.24 derives the tile from the scale grid: a 160-row weight with 2 scale rows is
    dequantised in 80-row tiles, not 128 + 32. qwen2om follows weight_block_size."""
    import transformers

    path = checkpoint("tiny-qwen3-fp8")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ckpt = Checkpoint(path)
    theirs, ours = model.state_dict()[RAGGED], ckpt.get(RAGGED)
    scale = ckpt.raw(ckpt.quantized[RAGGED].scale_name)
    assert torch.equal(ours, tile_loop_dequant(ckpt.raw(RAGGED), scale, (128, 128)))
    assert torch.equal(theirs, tile_loop_dequant(ckpt.raw(RAGGED), scale, (80, 64)))
    assert not torch.equal(theirs, ours)


# -- bad input ------------------------------------------------------------------------------------

@pytest.fixture
def fp8_ckpt(checkpoint, tmp_path: Path) -> Path:
    dest = tmp_path / "ckpt"
    shutil.copytree(checkpoint("tiny-qwen3-fp8"), dest)
    return dest


def edit_config(ckpt: Path, change) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    change(config["quantization_config"])
    (ckpt / "config.json").write_text(json.dumps(config))


SCALE = "model.layers.1.mlp.gate_proj.weight_scale_inv"


def test_integer_scale(cli, fp8_ckpt: Path, tmp_path: Path) -> None:
    edit_tensor(fp8_ckpt, SCALE, lambda s: s.float().ceil().to(torch.int32))
    convert_fails(cli, fp8_ckpt, tmp_path, SCALE, "not a float")


def test_missing_scale(cli, fp8_ckpt: Path, tmp_path: Path) -> None:
    edit_tensor(fp8_ckpt, SCALE, lambda s: None, unindex=True)
    convert_fails(cli, fp8_ckpt, tmp_path, RAGGED, "has no scale", SCALE)


def test_scale_shape_inconsistent(cli, fp8_ckpt: Path, tmp_path: Path) -> None:
    edit_tensor(fp8_ckpt, SCALE, lambda s: s[:1])
    convert_fails(cli, fp8_ckpt, tmp_path, SCALE, "[1, 1]", "needs [2, 1]")


@pytest.mark.parametrize("value,needle", [(float("nan"), "non-finite"), (float("inf"), "non-finite"),
                                          (0.0, "zero or negative"), (-1e-3, "zero or negative")])
def test_bad_scale_values(cli, fp8_ckpt: Path, tmp_path: Path, value: float, needle: str) -> None:
    def poison(s: torch.Tensor) -> torch.Tensor:
        s = s.clone()
        s[1, 0] = value
        return s

    edit_tensor(fp8_ckpt, SCALE, poison)
    convert_fails(cli, fp8_ckpt, tmp_path, SCALE, needle)


def test_scale_out_of_target_range(cli, fp8_ckpt: Path, tmp_path: Path) -> None:
    code, _, err = cli("convert", fp8_ckpt, "-o", tmp_path / "out", "--max-seq-len", "64", "--prefill-chunk", "16",
                       "--set", "scale_range=1e-2,1")
    assert code != 0 and "scale_range" in err and "outside [0.01, 1]" in " ".join(err.split())
    assert not (tmp_path / "out").exists()


def test_weight_not_e4m3(cli, fp8_ckpt: Path, tmp_path: Path) -> None:
    edit_tensor(fp8_ckpt, RAGGED, lambda w: w.float().to(torch.float8_e5m2))
    convert_fails(cli, fp8_ckpt, tmp_path, RAGGED, "float8_e5m2", "float8_e4m3fn")


@pytest.mark.parametrize("block", [None, [128], [128, 128, 1], "128x128", [0, 128]])
def test_bad_weight_block_size(cli, fp8_ckpt: Path, tmp_path: Path, block: object) -> None:
    def change(qc: dict) -> None:
        if block is None:
            del qc["weight_block_size"]
        else:
            qc["weight_block_size"] = block

    edit_config(fp8_ckpt, change)
    convert_fails(cli, fp8_ckpt, tmp_path, "weight_block_size")


def test_runtime_scales_file_lacks_an_input(fp8_out: Path, tmp_path: Path, cli) -> None:
    from qwen2om.runtime.standalone import Engine, RuntimeInputError

    out = tmp_path / "copy"
    shutil.copytree(fp8_out, out)
    scales = load_file(out / "scales.safetensors")
    gone = "model.layers.2.self_attn.v_proj.weight.scale"
    del scales[gone]
    save_file(scales, out / "scales.safetensors")
    with pytest.raises(RuntimeInputError, match=gone):
        Engine(out)
    code, _, err = cli("run", out, "--prompt", "Hello", "--max-new-tokens", "2")
    assert code != 0 and gone in err and "Traceback" not in err


def test_scale_values_match_checkpoint_dtype_variants(checkpoint, tmp_path: Path) -> None:
    """bf16, fp16 and fp32 scale grids all read as the same float32 values they hold."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        src = write_fp8_checkpoint(checkpoint("tiny-qwen3"), tmp_path / str(dtype), scale_dtype=dtype)
        ckpt = Checkpoint(src)
        q = ckpt.quantized[RAGGED]
        raw = ckpt.raw(q.scale_name)
        assert raw.dtype == dtype
        assert np.array_equal(q.scale(ckpt).numpy(), raw.float().numpy())


# -- calibrate --scheme fp8-block ----------------------------------------------------------------

@pytest.mark.slow
def test_calibrate_fp8_block_writes_the_hf_format(cli, checkpoint, tmp_path: Path) -> None:
    import transformers

    out = tmp_path / "fp8"
    code, stdout, err = cli("calibrate", "builtin:tiny-qwen3-trained", "-o", out, "--scheme", "fp8-block")
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
    ckpt, src = Checkpoint(out), Checkpoint(checkpoint("tiny-qwen3-trained"))
    assert sorted(ckpt.quantized) == sorted(n for n in src.names() if n.endswith("_proj.weight"))
    for name in src.names():  # norms, embeddings stay exactly as they were
        if name not in ckpt.quantized:
            assert ckpt.info(name).dtype == src.info(name).dtype and torch.equal(ckpt.get(name), src.get(name)), name
    q = ckpt.quantized["model.layers.0.mlp.down_proj.weight"]
    assert (q.scale_shape, ckpt.info(q.name).dtype, ckpt.info(q.scale_name).dtype) == (
        (2, 6), torch.float8_e4m3fn, torch.float32)
    w, w_hat = src.get(q.name, torch.float32), ckpt.get(q.name)
    assert float((w_hat - w).norm() / w.norm()) < 0.04  # e4m3: 3 mantissa bits
    report = json.loads((out / "calibration_report.json").read_text())
    assert report["scheme"] == "fp8-block" and report["quantized"] == 28 and len(report["layers"]) == 4
    # transformers reads it back (dequantising on CPU) to exactly the weights qwen2om holds
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    state = model.state_dict()
    assert all(torch.equal(state[n], ckpt.get(n)) for n in ckpt.quantized)
    # and the round trip converts and verifies against its own dequantisation
    onnx_out = tmp_path / "onnx"
    convert(out, onnx_out, overrides=SMALL)
    report = verify(onnx_out, out, tokens=8, prompts=["def f(x):"])
    assert report.passed and report.max_abs <= 1e-4


def test_calibrate_fp8_block_lists_every_linear_left_float(tmp_path: Path) -> None:
    """Qwen3.5's in_proj_a / in_proj_b stay float: unlisted, transformers made them FP8 modules and
    initialised them at random (no weight_scale_inv in the checkpoint)."""
    import transformers

    from qwen2om.quant.calibrate import CalibrationConfig, calibrate

    out = tmp_path / "fp8"
    calibrate("builtin:tiny-qwen3-5", out, CalibrationConfig(scheme="fp8-block"))
    left = json.loads((out / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    # the wrapper's layout kept: the text model under model.language_model.*, as its config says
    assert {"lm_head", "model.language_model.layers.0.linear_attn.in_proj_a",
            "model.language_model.layers.0.linear_attn.in_proj_b"} <= set(left)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not info["missing_keys"], info
    ckpt, state = Checkpoint(out), model.state_dict()
    name = "model.layers.0.linear_attn.in_proj_a.weight"
    assert torch.equal(state[name], ckpt.get(name, torch.float32))


def test_calibrate_fp8_block_ragged_and_lm_head(cli, tmp_path: Path) -> None:
    out = tmp_path / "fp8"
    code, _, err = cli("calibrate", "builtin:tiny-qwen3", "-o", out, "--scheme", "fp8-block", "--quantize-lm-head",
                       "--ignore", r"layers\.0\.mlp\.down_proj")
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert config["quantization_config"]["modules_to_not_convert"] == ["model.layers.0.mlp.down_proj"]
    ckpt = Checkpoint(out)
    assert "lm_head.weight" in ckpt.quantized and "model.embed_tokens.weight" not in ckpt.quantized
    assert "model.layers.0.mlp.down_proj.weight" not in ckpt.quantized
    assert ckpt.quantized[RAGGED].scale_shape == (2, 1)
    assert ckpt.quantized["lm_head.weight"].scale_shape == (1187, 1)  # 151,936 rows, 64 columns


@pytest.mark.parametrize("flags,needle", [(["--method", "gptq"], "--method"), (["--group-size", "64"], "--group-size"),
                                          (["--format", "ascendv1"], "fine-grained")])
def test_calibrate_fp8_block_rejects_w4a16_flags(cli, tmp_path: Path, flags: list[str], needle: str) -> None:
    code, _, err = cli("calibrate", "builtin:tiny-qwen3", "-o", tmp_path / "x", "--scheme", "fp8-block", *flags)
    assert code != 0 and needle in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()


def test_calibrate_refuses_an_fp8_checkpoint(cli, tmp_path: Path) -> None:
    code, _, err = cli("calibrate", "builtin:tiny-qwen3-fp8", "-o", tmp_path / "x", "--scheme", "fp8-block")
    assert code != 0 and "already quantised (fp8)" in err


def test_inspect_lists_scale_inputs(cli, fp8_out: Path) -> None:
    code, stdout, err = cli("inspect", fp8_out, "--json")
    assert code == 0, err
    info = json.loads(stdout)
    scales = {e["name"]: e for e in info["scale_inputs"]}
    assert len(scales) == 28
    e = scales["model.layers.1.mlp.gate_proj.weight.scale"]
    assert (e["layer"], e["module"], e["shape"], e["block_size"]) == (1, "model.layers.1.mlp.gate_proj", [2, 1],
                                                                      [128, 128])
    decode = info["graphs"]["decode"]
    assert decode["initializers"]["float8e4m3fn"]["count"] == 28
    assert sum(io["role"] == "scale" for io in decode["inputs"]) == 28
    assert [r["layer"] for r in info["scale_ranges"]] == [0, 1, 2, 3]
    code, stdout, err = cli("inspect", fp8_out)
    assert code == 0 and "scale inputs: 28" in stdout and "<weight>.scale" in stdout


def test_inspect_checkpoint_and_bad_paths(cli, tmp_path: Path) -> None:
    code, stdout, _ = cli("inspect", "builtin:tiny-qwen3-fp8", "--json")
    info = json.loads(stdout)
    assert code == 0 and info["kind"] == "checkpoint" and info["quantized"] == {"fp8": 28}
    code, _, err = cli("inspect", tmp_path)
    assert code != 0 and "not a qwen2om output directory" in err
    (tmp_path / "bad.onnx").write_bytes(b"not a model")
    code, _, err = cli("inspect", tmp_path / "bad.onnx")
    assert code != 0 and "bad.onnx" in err and "Traceback" not in err


def test_scale_map_must_match_the_graphs(fp8_out: Path, tmp_path: Path) -> None:
    """check_outputs' rule: every scale input of the graphs is in scale_map.json, and nothing else."""
    from qwen2om.errors import Qwen2omError
    from qwen2om.passes.check_outputs import check_scale_map
    from qwen2om.signature import IOSpec

    manifest = json.loads((fp8_out / "manifest.json").read_text())
    sigs = {kind: ([IOSpec(io["name"], io["dtype"], tuple(io["shape"]), io["role"], io.get("layer"))
                    for io in g["inputs"]], []) for kind, g in manifest["graphs"].items()}
    stage = tmp_path / "stage"
    shutil.copytree(fp8_out, stage)
    check_scale_map(stage, sigs)
    original = json.loads((stage / "scale_map.json").read_text())
    gone = "model.layers.3.mlp.up_proj.weight.scale"
    (stage / "scale_map.json").write_text(json.dumps({k: v for k, v in original.items() if k != gone}))
    with pytest.raises(Qwen2omError, match=gone):
        check_scale_map(stage, sigs)
    (stage / "scale_map.json").write_text(json.dumps({**original, "model.extra.weight.scale": {}}))
    with pytest.raises(Qwen2omError, match="model.extra.weight.scale"):
        check_scale_map(stage, sigs)


@pytest.mark.slow
def test_verify_aligned_fp8_against_transformers_own_load(cli, tmp_path: Path) -> None:
    """Every dimension a multiple of 128: transformers' own CPU load of the FP8 checkpoint is the
    reference, as it is, and the FP8 graph (scale inputs) matches it over 32 greedy steps."""
    out = tmp_path / "out"
    convert("builtin:tiny-qwen3-trained-fp8", out, overrides=SMALL)
    report = verify(out, "builtin:tiny-qwen3-trained-fp8", tokens=32, loader="transformers")
    assert report.passed and report.max_abs <= 1e-4 and report.agreement == 1.0
    code, stdout, _ = cli("verify", out, "--reference", "builtin:tiny-qwen3-trained-fp8", "--reference-loader",
                          "transformers", "--tokens", "4")
    assert code == 0 and "PASS" in stdout
