"""Strict recipes and the pass plan: typos fail before any work, with the valid names listed."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from qwen2om.errors import PlanError, RecipeError
from qwen2om.pipeline import PASSES, PassResult, check_plan
from qwen2om.recipe import apply_overrides, bundled_recipes, load_recipe, target_recipe
from qwen2om.targets import TARGETS


def test_bundled_recipes_load_and_resolve() -> None:
    names = bundled_recipes()
    assert {"ort", "ascend", "qwen2-fp32", "qwen2-fp16", "qwen3-fp32", "qwen3-fp16", "qwen3-ascend-fp32"} <= set(names)
    for name in names:
        r = load_recipe(name)
        assert r.family == ("" if name in TARGETS else name.split("-")[0]) and r.name == name
        if TARGETS.get(r.target).socs:  # the SoC is the user's to name
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
    for setting in ("precision=fp16", "compile=dry-run", "weight_storage=int8"):
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


def test_per_family_names_are_the_target_recipe_filled_in() -> None:
    """One bundled file per target: `qwen3-ascend-fp32` is recipes/ascend.yaml for qwen3 in fp32, named so."""
    for t in TARGETS:
        base = load_recipe(t.recipe)
        assert (base.family, base.name, base.target) == ("", t.recipe, t.name)
        for family, dtype in (("qwen2", "fp16"), ("qwen3", "fp32")):
            named = load_recipe(t.named(family, dtype))
            assert named == dataclasses.replace(base, family=family, dtype=dtype, name=t.named(family, dtype))
            assert target_recipe(t.name, family, dtype) == named
    assert load_recipe("qwen3-fp16").pipeline != load_recipe("qwen3-ascend-fp16").pipeline
    assert (load_recipe("ort").dtype, load_recipe("ascend").dtype) == ("fp32", "fp16")  # the NPU computes in fp16
    with pytest.raises(RecipeError, match=r"unknown recipe 'qwen9-fp32' \(bundled: ascend, ort, qwen2-fp32"):
        load_recipe("qwen9-fp32")
    with pytest.raises(RecipeError, match="target='npu' is not one of ort, ascend"):
        target_recipe("npu", "qwen3")


def test_family_comes_from_the_checkpoint(tmp_path) -> None:
    """Without --recipe, and with a recipe that names no family, the checkpoint's family (its `recipe`) is used;
    the resolved recipe is named as the per-family bundled one was."""
    from qwen2om.builtin import resolve_model
    from qwen2om.convert import choose_recipe, read_config

    moe = read_config(resolve_model("builtin:tiny-qwen3-moe"))
    r = choose_recipe(moe, None, {"target": "ascend", "soc_version": "Ascend910B3"})
    assert (r.family, r.name, r.dtype, r.target) == ("qwen3", "qwen3-ascend-fp16", "fp16", "ascend")
    assert r.pipeline == load_recipe("ascend").pipeline
    r = choose_recipe(read_config(resolve_model("builtin:tiny-qwen2")), None, {"dtype": "fp16"})
    assert (r.family, r.name) == ("qwen2", "qwen2-fp16")
    path = tmp_path / "mine.yaml"
    path.write_text((Path(__file__).parents[1] / "recipes" / "ort.yaml").read_text())  # a user's copy
    r = choose_recipe(moe, str(path), {})
    assert (r.family, r.name) == ("qwen3", "mine")
    path.write_text("family: qwen2\n" + path.read_text())  # stated: kept (load_checkpoint refuses a mismatch)
    assert choose_recipe(moe, str(path), {}).family == "qwen2"


def test_typed_settings_are_what_set_strings_parse_to(tmp_path) -> None:
    """Issue 24: conversion options are typed; `--set` strings are parsed once, into the same values code
    gives directly, and a setting that is no recipe field is refused by name."""
    from qwen2om.builtin import resolve_model
    from qwen2om.convert import ConvertOptions, choose_recipe, convert, read_config
    from qwen2om.recipe import parse_overrides

    strings = ["dtype=fp16", "max-seq-len=64", "prefill_chunk=16", "gears=8,16", "scale_range=1e-6,1e4"]
    typed = {"dtype": "fp16", "max_seq_len": 64, "prefill_chunk": 16, "gears": (8, 16), "scale_range": (1e-6, 1e4)}
    assert parse_overrides(strings) == typed
    assert ConvertOptions.from_overrides(strings).settings == ConvertOptions(settings=typed).settings == typed
    r = choose_recipe(read_config(resolve_model("builtin:tiny-qwen3")), None, typed)
    assert (r.name, r.max_seq_len, r.prefill_chunk, r.gears) == ("qwen3-fp16", 64, 16, (8, 16))
    with pytest.raises(RecipeError, match=r"unknown recipe setting 'max_seq' \(valid: family, dtype"):
        ConvertOptions(settings={"max_seq": 64})
    with pytest.raises(RecipeError, match="batch_size=1.5 must be an integer"):
        ConvertOptions(settings={"batch_size": 1.5})
    with pytest.raises(TypeError, match="not both"):
        convert("builtin:tiny-qwen3", tmp_path / "o", ConvertOptions(), force=True)


def test_config_is_read_once_and_the_checkpoint_opened_once(tmp_path, monkeypatch) -> None:
    """Issue 24: choose_recipe, preflight and load_checkpoint share one reading of config.json, and
    load_checkpoint takes on the checkpoint preflight opened."""
    import qwen2om.checkpoint as ck
    from qwen2om.builtin import resolve_model
    from qwen2om.convert import choose_recipe, preflight, read_config
    from qwen2om.pipeline import RunContext, run_pipeline
    from qwen2om.state import ConvertState

    source = resolve_model("builtin:tiny-qwen3")
    reads: list[str] = []
    real = ck.read_json
    monkeypatch.setattr(ck, "read_json", lambda path, what: reads.append(path.name) or real(path, what))
    config = read_config(source)
    r = choose_recipe(config, None, {"max_seq_len": 64})
    opened = preflight(config, r)
    assert opened is not None and opened.config is config.config
    state = ConvertState()
    run_pipeline([("load_checkpoint", {})], state, RunContext(recipe=r, stage_dir=tmp_path, source=source,
                                                             opened_checkpoint=opened))
    assert state.checkpoint is opened and reads.count("config.json") == 1, reads
