"""Schemes, methods and formats are registry entries (qwen2om/quant/schemes.py, formats.py): no code
outside them compares against their names, each entry's checks refuse what it ignores, and the
library's `calibrate()` refuses what the CLI refuses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from qwen2om.quant.calibrate import CalibrationConfig, CalibrationError, calibrate, calibration_config
from qwen2om.quant.formats import FORMATS
from qwen2om.quant.schemes import METHODS, SCHEMES
from qwen2om.quantized import Int4Weight
from qwen2om.registry import UnknownNameError

ROOT = Path(__file__).resolve().parents[1]
REGISTRIES = {"qwen2om/quant/schemes.py", "qwen2om/quant/formats.py"}
NAMES = "rtn|gptq|awq|w4a16|fp8-block|compressed-tensors|ascendv1"
LITERAL = rf"""["'](?:{NAMES})["']"""
# `x == "awq"`, `"awq" != x`, `x in ("rtn", ...)`, `x not in ["ascendv1"]`
COMPARISON = re.compile(rf"""(?:==|!=)\s*{LITERAL}|{LITERAL}\s*(?:==|!=)|\bin\s*[(\[{{][^)\]}}]*{LITERAL}""")
FP8_FLAGS = "not used by --scheme fp8-block"


def test_no_name_comparisons_outside_the_registries() -> None:
    found = []
    for path in sorted([*ROOT.glob("qwen2om/**/*.py"), *ROOT.glob("passes/**/*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        if rel in REGISTRIES:
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if COMPARISON.search(line.split("#")[0]):
                found.append(f"{rel}:{i}: {line.strip()}")
    assert not found, "ask the registry entry instead:\n" + "\n".join(found)


def test_the_comparison_pattern_catches_what_it_should() -> None:
    for line in ('if cfg.method == "awq":', "if 'ascendv1' != fmt:", 'm not in (None, "rtn")', 'f in ["fp8-block"]'):
        assert COMPARISON.search(line), line
    for line in ('method: str = "gptq"', 'fmt=ASCENDV1.name', 'Method("rtn", "round to nearest")'):
        assert not COMPARISON.search(line), line


def test_methods_know_their_schemes_and_data() -> None:
    assert METHODS.names() == ["rtn", "gptq", "awq"]
    assert [m.needs_data for m in METHODS] == [False, True, True]
    assert SCHEMES.get("w4a16").methods == ("rtn", "gptq", "awq")
    assert SCHEMES.get("fp8-block").methods == ("rtn",)
    assert METHODS.get("awq").searches_scales and not METHODS.get("gptq").searches_scales
    assert METHODS.get("gptq").orders_columns and "damp" in METHODS.get("gptq").reads
    with pytest.raises(UnknownNameError, match=r"unknown method 'hqq' \(known: rtn, gptq, awq\)"):
        METHODS.get("hqq")


def test_formats_carry_their_layout() -> None:
    ct, ascend, fp8 = (FORMATS.get(n) for n in ("compressed-tensors", "ascendv1", "fp8"))
    assert ct.packs_int32 and not ct.always_zero_point and ct.quant_method == "compressed-tensors"
    assert not ascend.packs_int32 and ascend.always_zero_point and ascend.zero_point == "offset"
    assert ascend.marker == "quant_model_description.json" and ascend.quant_method is None
    assert fp8.write is None and fp8.quant_method == "fp8"
    w = Int4Weight("x.weight", 16, 64, 32, symmetric=True, fmt="ascendv1")
    assert w.layout is ascend and w.has_zero_point
    assert not Int4Weight("x.weight", 16, 64, 32, symmetric=True).has_zero_point


@pytest.mark.parametrize("settings,message", [
    ({"scheme": "fp8-block", "method": "gptq"}, f"--method: {FP8_FLAGS}"),
    ({"scheme": "fp8-block", "group_size": 64, "symmetric": False},
     f"--group-size, --sym/--asym: {FP8_FLAGS} (data-free: each 128×128 tile's largest |w| maps to e4m3fn's 448)"),
    ({"scheme": "fp8-block", "dataset": "builtin:prose"}, f"--dataset: {FP8_FLAGS}"),
    ({"scheme": "fp8-block", "fmt": "ascendv1"}, "--format ascendv1: fp8-block writes Hugging Face's fine-grained "
                                                 "FP8 format only"),
    ({"scheme": "w4a16", "fmt": "fp8"}, "--format 'fp8' is not one of compressed-tensors, ascendv1"),
    ({"method": "hqq"}, "--method 'hqq' is not one of rtn, gptq, awq"),
    ({"scheme": "int3"}, "--scheme 'int3' is not one of w4a16, fp8-block"),
    ({"group_size": 0}, "group_size must be a positive integer"),
    ({"compute_dtype": "fp64"}, "compute_dtype 'fp64' is not one of"),
])
def test_each_scheme_refuses_what_it_does_not_take(settings: dict, message: str) -> None:
    with pytest.raises(CalibrationError, match=re.escape(message)):
        CalibrationConfig(**settings)


def test_scheme_defaults_fill_what_is_not_given() -> None:
    w4 = CalibrationConfig()
    assert (w4.method, w4.group_size, w4.symmetric, w4.fmt) == ("gptq", 128, True, "compressed-tensors")
    fp8 = CalibrationConfig(scheme="fp8-block", method="rtn", num_samples=8)
    assert (fp8.method, fp8.group_size, fp8.symmetric, fp8.dataset, fp8.fmt) == ("rtn", None, None, None, "fp8")


def test_library_calibrate_refuses_what_the_cli_refuses(tmp_path: Path, cli) -> None:
    code, _, err = cli("calibrate", "builtin:tiny-qwen3", "-o", tmp_path / "c", "--scheme", "fp8-block",
                       "--method", "gptq")
    assert code == 2 and f"--method: {FP8_FLAGS}" in err
    cfg = CalibrationConfig(scheme="fp8-block")
    cfg.method = "gptq"  # changed after it was checked: calibrate checks again
    with pytest.raises(CalibrationError, match=f"--method: {FP8_FLAGS}"):
        calibrate("builtin:tiny-qwen3", tmp_path / "l", cfg)
    assert not (tmp_path / "c").exists() and not (tmp_path / "l").exists()


def test_calibration_recipe_is_read_as_recipes_are(tmp_path: Path) -> None:
    recipe = tmp_path / "cal.yaml"
    recipe.write_text("method: awq\ngroup_size: 32\nsymmetric: false\ndamp: 0.05\nformat: ascendv1\n"
                      "ignore: ['lm_head']\nseq_len: null\n")
    cfg = calibration_config(recipe, {"num_samples": 4}, ("q_proj",))
    assert (cfg.method, cfg.group_size, cfg.symmetric, cfg.damp, cfg.fmt) == ("awq", 32, False, 0.05, "ascendv1")
    assert cfg.ignore == ("lm_head", "q_proj") and cfg.num_samples == 4 and cfg.seq_len is None
    for text, message in (("group_size: 3.5\n", "group_size=3.5 must be an integer"),
                          ("symmetric: 1\n", "symmetric=1 must be true or false"),
                          ("ignore: lm_head\n", "ignore='lm_head' must be a list of strings"),
                          ("methd: gptq\n", "unknown setting(s) methd (known: activation_budget, actorder, "),
                          ("method: [gptq\n", "invalid YAML"),
                          ("- gptq\n", "a calibration recipe is a mapping of settings"),
                          ("scheme: fp8-block\ngroup_size: 32\n", f"--group-size: {FP8_FLAGS}")):
        recipe.write_text(text)
        with pytest.raises(Exception, match=re.escape(message)):
            calibration_config(recipe, {})
