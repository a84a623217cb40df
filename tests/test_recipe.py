"""Strict recipes and the pass plan: typos fail before any work, with the valid names listed."""

from __future__ import annotations

import dataclasses

import pytest

from qwen2om.errors import PlanError, RecipeError
from qwen2om.pipeline import PASSES, PassResult, check_plan
from qwen2om.recipe import apply_overrides, bundled_recipes, load_recipe


def test_bundled_recipes_load_and_resolve() -> None:
    names = bundled_recipes()
    assert {"qwen2-fp32", "qwen2-fp16", "qwen3-fp32", "qwen3-fp16"} <= set(names)
    for name in names:
        r = load_recipe(name)
        assert r.family in ("qwen2", "qwen3")
        if r.target == "ascend":  # the SoC is the user's to name
            with pytest.raises(RecipeError, match="needs --soc-version"):
                r.resolved(max_positions=4096)
            r = apply_overrides(r, ["soc_version=Ascend910B3"])
        resolved = r.resolved(max_positions=4096)
        assert resolved.max_seq_len == 2048 and resolved.prefill_chunk == 128


def test_ascend_recipe_fields() -> None:
    r = load_recipe("qwen3-ascend-fp16")
    assert (r.target, r.dtype, r.precision, r.compile, r.weight_storage) == ("ascend", "fp16", "origin", "auto", "auto")
    with pytest.raises(RecipeError, match="Ascend910B1..B4"):
        apply_overrides(r, ["soc_version=Ascend999"])
    with pytest.raises(RecipeError, match="precision='bf16' is not one of origin, mixed_float16, fp16"):
        apply_overrides(r, ["soc_version=Ascend310P3", "precision=bf16"])
    with pytest.raises(RecipeError, match="for target=ascend"):
        apply_overrides(load_recipe("qwen3-fp16"), ["soc_version=Ascend910B3"])
    # ATC's settings on an ONNX Runtime conversion were accepted and recorded in the manifest
    for setting in ("precision=fp16", "compile=dry-run"):
        with pytest.raises(RecipeError, match=f"{setting.replace('=', '=.')}. is for target=ascend"):
            apply_overrides(load_recipe("qwen3-fp32"), [setting])


def test_auto_respects_model_limit() -> None:
    r = load_recipe("qwen3-fp32").resolved(max_positions=100)
    assert r.max_seq_len == 100 and r.prefill_chunk == 100


def test_explicit_capacity_above_limit_fails() -> None:
    r = apply_overrides(load_recipe("qwen3-fp32"), ["max_seq_len=8192"])
    with pytest.raises(RecipeError, match="max_position_embeddings=4096"):
        r.resolved(max_positions=4096)


def test_unknown_key_lists_valid_ones(tmp_path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text("family: qwen3\npipeline: [load_checkpoint]\nmax_seq: 12\n")
    with pytest.raises(RecipeError, match=r"unknown key\(s\) max_seq.*valid: .*max_seq_len"):
        load_recipe(str(path))


def test_unknown_pass_lists_known(tmp_path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text("family: qwen3\npipeline: [load_checkpoint, export_onx]\n")
    with pytest.raises(Exception, match=r"export_onx.*known: .*export_onnx"):
        load_recipe(str(path))


def test_plan_order_checked_before_work(tmp_path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text("family: qwen3\npipeline: [load_checkpoint, export_onnx, static_model]\n")
    with pytest.raises(PlanError, match=r"export_onnx.*static_model.*before it: load_checkpoint"):
        load_recipe(str(path))


def test_set_overrides_are_typed_and_strict() -> None:
    r = apply_overrides(load_recipe("qwen3-fp32"), ["max_seq_len=512", "dtype=fp16", "logits=all"])
    assert (r.max_seq_len, r.dtype, r.logits) == (512, "fp16", "all")
    with pytest.raises(RecipeError, match="must be an integer"):
        apply_overrides(r, ["batch_size=two"])
    with pytest.raises(RecipeError, match="dtype='bf16' is not one of fp32, fp16"):
        apply_overrides(r, ["dtype=bf16"])
    with pytest.raises(RecipeError, match="expected key=value"):
        apply_overrides(r, ["dtype"])


def test_recipe_round_trips_through_manifest_form(tmp_path) -> None:
    import yaml

    r = apply_overrides(load_recipe("qwen2-fp32"), ["max_seq_len=300"])
    data = r.to_dict()
    path = tmp_path / "again.yaml"
    path.write_text(yaml.safe_dump(data))
    again = load_recipe(str(path))
    assert dataclasses.replace(again, name=r.name) == r


def test_check_plan_accepts_filled_slots() -> None:
    check_plan(["static_model"], filled={"checkpoint"})
    with pytest.raises(PlanError, match="needs \\['checkpoint'\\]"):
        check_plan(["static_model"])


def test_every_pass_documents_itself() -> None:
    for entry in PASSES:
        assert entry.doc, entry.name
        assert isinstance(entry.produces, tuple) and entry.produces


def test_pass_result_defaults() -> None:
    assert PassResult(False).stats == {}


def test_a_recipe_on_a_builtin_names_the_builtin(cli, tmp_path) -> None:
    """`--recipe` on a builtin named its cache directory (…/builtin/tiny-qwen3-v2), not what was typed."""
    code, stdout, err = cli("convert", "builtin:tiny-qwen3", "-o", tmp_path / "o", "--recipe", "qwen2-fp32")
    text = " ".join(err.split())
    assert code == 2 and "recipe qwen2-fp32 is for family 'qwen2', but builtin:tiny-qwen3 is 'qwen3'" in text, text
    assert "builtin/tiny-qwen3" not in stdout + text and not (tmp_path / "o").exists()
