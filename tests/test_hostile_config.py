"""Hostile inputs, issue 21: config.json values and recipes.

A config value of the wrong type or range is refused naming the key (it was a TypeError, ValueError or
ZeroDivisionError traceback, or a failure in check_outputs minutes later); a field the static model does
not implement is refused by name (`hidden_act: gelu` was converted as SiLU); a recipe is parsed with its
aliases, nesting and size bounded, duplicate keys refused, and its values checked before any work."""

from __future__ import annotations

import json
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from edits import convert_fails

from qwen2om.arch import ModelDims, resolve_arch
from qwen2om.errors import CheckpointError, PlanError, RecipeError
from qwen2om.recipe import apply_overrides, load_recipe

INF, NAN = float("inf"), float("nan")


@pytest.fixture
def ckpt(checkpoint, tmp_path: Path) -> Path:
    """A private, mutable copy of tiny-qwen3 (sharded, with an index)."""
    dest = tmp_path / "ckpt"
    shutil.copytree(checkpoint("tiny-qwen3"), dest)
    return dest


def config_of(checkpoint: Callable[[str], Path], name: str) -> dict[str, Any]:
    return json.loads((checkpoint(name) / "config.json").read_text())


def dims_error(cfg: dict[str, Any]) -> str:
    """The CheckpointError message reading `cfg` gives (through JSON, as a config.json would be read)."""
    cfg = json.loads(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        resolve_arch(cfg)
        ModelDims.from_config(cfg)
    return str(e.value)


def edit_config(ckpt: Path, **changes: Any) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, **changes}))


# -- values of the wrong type or range, each named ---------------------------------------------------
@pytest.mark.parametrize(("key", "value", "said"), [
    ("num_hidden_layers", "four", 'num_hidden_layers must be a positive integer, got "four"'),
    ("num_hidden_layers", None, "num_hidden_layers must be a positive integer, got null"),
    ("num_hidden_layers", INF, "num_hidden_layers must be a positive integer, got Infinity"),
    ("num_hidden_layers", 4.7, "num_hidden_layers must be a positive integer, got 4.7"),
    ("num_hidden_layers", 0, "num_hidden_layers must be a positive integer, got 0"),
    ("num_hidden_layers", -3, "num_hidden_layers must be a positive integer, got -3"),
    ("num_hidden_layers", True, "num_hidden_layers must be a positive integer, got true"),
    ("num_hidden_layers", 10**9, "num_hidden_layers must be at most 1,024"),  # was a hang
    ("hidden_size", "64", 'hidden_size must be a positive integer, got "64"'),
    ("vocab_size", 0, "vocab_size must be a positive integer, got 0"),
    ("vocab_size", 2**40, "vocab_size must be at most 2,147,483,647"),
    ("intermediate_size", -1, "intermediate_size must be a positive integer, got -1"),
    ("max_position_embeddings", NAN, "max_position_embeddings must be a positive integer, got NaN"),
    ("num_attention_heads", 0, "num_attention_heads must be a positive integer, got 0"),  # was ZeroDivisionError
    ("num_key_value_heads", 0, "num_key_value_heads must be a positive integer, got 0"),  # was silently = heads
    ("num_key_value_heads", 3, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ("head_dim", 0, "head_dim must be a positive integer, got 0"),
    ("head_dim", 33, "head_dim must be even"),
    ("rms_norm_eps", "x", 'rms_norm_eps must be a positive finite number, got "x"'),
    ("rms_norm_eps", 0, "rms_norm_eps must be a positive finite number, got 0"),
    ("rms_norm_eps", INF, "rms_norm_eps must be a positive finite number, got Infinity"),
    ("tie_word_embeddings", "yes", 'tie_word_embeddings must be true or false, got "yes"'),
    ("architectures", [{}], "architectures must be a list of class names"),
    ("layer_types", ["full_attention"], "layer_types must list 4 entries"),
])
def test_config_values_are_checked_and_named(checkpoint, key: str, value: Any, said: str) -> None:
    cfg = config_of(checkpoint, "tiny-qwen3")
    assert said in dims_error({**cfg, key: value})


def test_more_heads_than_channels_without_head_dim(checkpoint) -> None:
    cfg = {k: v for k, v in config_of(checkpoint, "tiny-qwen3").items() if k != "head_dim"}
    assert "num_attention_heads=128 exceeds hidden_size=64" in dims_error({**cfg, "num_attention_heads": 128,
                                                                         "num_key_value_heads": 128})


@pytest.mark.parametrize(("rope", "said"), [
    ({"rope_theta": "1e6"}, 'rope_parameters.rope_theta must be a positive finite number, got "1e6"'),
    ({"rope_theta": 0}, "rope_parameters.rope_theta must be a positive finite number, got 0"),
    ({"rope_theta": -1e6}, "rope_parameters.rope_theta must be a positive finite number, got -1000000.0"),
    ({"rope_theta": 1e6, "rope_type": "yarn", "factor": 0}, "rope_parameters.factor must be a positive finite number"),
    ({"rope_theta": 1e6, "rope_type": "yarn"}, "missing required key 'rope_parameters.factor'"),
    ({"rope_theta": 1e6, "rope_type": "linear", "factor": "2"}, "rope_parameters.factor must be a positive finite"),
    ({"rope_theta": 1e6, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}, "rope_parameters.high_freq_factor must exceed low_freq_factor=4.0"),
    ({"rope_theta": 1e6, "rope_type": "longrope", "factor": 2.0}, "rope_type 'longrope' has no static-shape"),
    ({"rope_theta": 1e6, "rope_type": "su"}, 'rope_parameters.rope_type="su" is not supported'),
    ({"rope_theta": 1e6, "partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not supported"),
])
def test_rope_parameters_are_checked(checkpoint, rope: dict[str, Any], said: str) -> None:
    """rope_theta <= 0 or a yarn factor of 0 failed only in check_outputs, naming no key; a string was a
    traceback from torch."""
    cfg = config_of(checkpoint, "tiny-qwen3")
    assert said in dims_error({**cfg, "rope_parameters": rope})


def test_legacy_rope_keys_are_read_as_transformers_reads_them(checkpoint) -> None:
    """transformers 4 configs: `rope_theta` at the top level, scaling under `rope_scaling` (which wins)."""
    cfg = {k: v for k, v in config_of(checkpoint, "tiny-qwen3").items() if k != "rope_parameters"}
    ModelDims.from_config({**cfg, "rope_theta": 1e6, "rope_scaling": None})
    ModelDims.from_config({**cfg, "rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                                      "original_max_position_embeddings": 1024}})
    assert "rope_theta must be a positive finite number, got -1" in dims_error({**cfg, "rope_theta": -1})
    said = dims_error({**cfg, "rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 0.0}})
    assert "rope_scaling.factor must be a positive finite number, got 0.0" in said


@pytest.mark.parametrize(("key", "value", "said"), [
    ("num_experts", "8", 'num_experts must be a non-negative integer, got "8"'),
    ("num_experts", 10**9, "num_experts must be at most 8,192"),  # the tensor table grew ~100 MB/s
    ("num_experts_per_tok", 0, "num_experts_per_tok must be a positive integer, got 0"),
    ("num_experts_per_tok", 9, "num_experts_per_tok=9 must be between 1 and num_experts=8"),
    ("moe_intermediate_size", None, "moe_intermediate_size must be a positive integer, got null"),
    ("decoder_sparse_step", 0, "decoder_sparse_step must be a positive integer, got 0"),
    ("mlp_only_layers", [0, "1"], "mlp_only_layers must be a list of layer indices from 0 to 3"),
    ("mlp_only_layers", [7], "mlp_only_layers must be a list of layer indices from 0 to 3"),
    ("mlp_only_layers", [0], "intermediate_size"),  # a dense layer needs the dense MLP's size
    ("norm_topk_prob", 1, "norm_topk_prob must be true or false, got 1"),
])
def test_moe_values_are_checked(checkpoint, key: str, value: Any, said: str) -> None:
    cfg = config_of(checkpoint, "tiny-qwen3-moe")
    if said == "intermediate_size":
        del cfg["intermediate_size"]
        assert "missing required key 'intermediate_size'" in dims_error({**cfg, key: value})
        return
    assert said in dims_error({**cfg, key: value})


def test_moe_expert_count_is_bounded_with_the_layers(checkpoint) -> None:
    cfg = config_of(checkpoint, "tiny-qwen3-moe")
    assert "more than 262,144" in dims_error({**cfg, "num_hidden_layers": 1024, "num_experts": 8192,
                                               "num_local_experts": 8192})


@pytest.mark.parametrize(("key", "value", "said"), [
    ("linear_num_value_heads", 0, "text_config.linear_num_value_heads must be a positive integer, got 0"),
    ("linear_num_key_heads", 3, "linear_num_value_heads=4 is not a multiple of linear_num_key_heads=3"),
    ("linear_key_head_dim", 16.5, "text_config.linear_key_head_dim must be a positive integer, got 16.5"),
    ("linear_conv_kernel_dim", "4", 'text_config.linear_conv_kernel_dim must be a positive integer, got "4"'),
    ("layer_types", [{}, "linear_attention", "linear_attention", "full_attention"],
     "text_config.layer_types[0] must be 'linear_attention' or 'full_attention', got {}"),  # was unhashable
    ("layer_types", "full_attention", "text_config.layer_types must list 4 entries"),
    ("rope_parameters", {"rope_theta": 1e6, "partial_rotary_factor": 0.0},
     "partial_rotary_factor must be a positive finite number, got 0.0"),
    ("rope_parameters", {"rope_theta": 1e6, "partial_rotary_factor": 0.1},
     "partial_rotary_factor=0.1 of head_dim=32 is 3 RoPE channels"),
    ("rope_parameters", {"rope_theta": 1e6, "partial_rotary_factor": 2},
     "partial_rotary_factor must be at most 1"),
    ("rope_parameters", {"rope_theta": 1e6, "rope_type": "yarn", "factor": 2.0},
     'rope_type="yarn" is not supported (qwen2om\'s static model for hybrids implements default)'),
    ("rope_parameters", {"rope_theta": None}, "rope_parameters.rope_theta must be a positive finite number, got null"),
])
def test_hybrid_values_are_checked(checkpoint, key: str, value: Any, said: str) -> None:
    """The published Qwen3.5 wrapper: keys are named where they are, under text_config."""
    cfg = config_of(checkpoint, "tiny-qwen3-5")
    assert said in dims_error({**cfg, "text_config": {**cfg["text_config"], key: value}})


def test_hybrid_must_give_its_linear_attention_sizes(checkpoint) -> None:
    """A hybrid without linear_num_value_heads was taken for all full attention (transformers would use
    its 9B defaults instead); the key is now required."""
    cfg = config_of(checkpoint, "tiny-qwen3-next")
    del cfg["linear_num_value_heads"]
    assert "missing required key 'linear_num_value_heads'" in dims_error(cfg)


# -- fields the static model does not implement, refused by name -------------------------------------
@pytest.mark.parametrize(("name", "key", "value", "said"), [
    ("tiny-qwen3", "hidden_act", "gelu", 'hidden_act="gelu" is not supported (qwen2om\'s static model implements '
                                        "silu)"),
    ("tiny-qwen3", "hidden_activation", "gelu_pytorch_tanh", 'hidden_activation="gelu_pytorch_tanh" is not'),
    ("tiny-qwen3", "attention_bias", True, "attention_bias=true is not supported"),
    ("tiny-qwen3", "attention_bias", "no", 'attention_bias must be true or false, got "no"'),
    ("tiny-qwen3", "mlp_bias", True, "mlp_bias=true is not supported"),
    ("tiny-qwen3", "use_qk_norm", False, "use_qk_norm=false is not supported"),
    ("tiny-qwen3", "attn_output_gate", True, "attn_output_gate=true is not supported"),
    ("tiny-qwen3", "use_sliding_window", True, "use_sliding_window=true is not supported"),
    ("tiny-qwen3", "layer_types", ["full_attention"] * 3 + ["sliding_attention"],
     'layer_types[3]="sliding_attention" is not supported'),
    ("tiny-qwen2", "use_qk_norm", True, "use_qk_norm=true is not supported"),
    ("tiny-qwen2-moe", "qkv_bias", False, "qkv_bias=false is not supported"),
    ("tiny-qwen3-next", "attn_output_gate", False, "attn_output_gate=false is not supported"),
    ("tiny-qwen3-next", "hidden_act", "relu", 'hidden_act="relu" is not supported'),
])
def test_unimplemented_fields_are_refused_by_name(checkpoint, name: str, key: str, value: Any, said: str) -> None:
    cfg = config_of(checkpoint, name)
    assert said in dims_error({**cfg, key: value})


def test_implemented_values_are_accepted(checkpoint) -> None:
    """What the builtin fixtures and the published configs write passes: swish is SiLU, the published
    Qwen3.5's attn_output_gate, an integer rope_theta, null sliding_window and transformers' defaults."""
    cfg = config_of(checkpoint, "tiny-qwen3")
    ModelDims.from_config({**cfg, "hidden_act": "swish", "attention_bias": False, "sliding_window": None,
                           "use_sliding_window": False, "rope_parameters": {"rope_type": "default",
                                                                            "rope_theta": 10_000_000}})
    wrapped = config_of(checkpoint, "tiny-qwen3-5")
    ModelDims.from_config({**wrapped, "text_config": {**wrapped["text_config"], "attn_output_gate": True}})


# -- end to end: exit 2, one line, nothing staged ----------------------------------------------------
@pytest.mark.parametrize(("changes", "said"), [
    ({"num_hidden_layers": "four"}, 'num_hidden_layers must be a positive integer, got "four"'),
    ({"hidden_act": "gelu"}, 'hidden_act="gelu" is not supported'),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, "rope_parameters.rope_theta must be a positive"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 0.0,
                          "original_max_position_embeddings": 1024}}, "rope_parameters.factor must be a positive"),
])
def test_convert_names_the_config_key(cli, ckpt, tmp_path, changes: dict[str, Any], said: str) -> None:
    edit_config(ckpt, **changes)
    err = convert_fails(cli, ckpt, tmp_path, "config.json", said)
    assert len(err.strip().splitlines()) <= 3, err  # one message, not a traceback


# -- recipes -----------------------------------------------------------------------------------------
@pytest.fixture
def within() -> Iterator[Callable[[int], None]]:
    """`within(seconds)`: fail the test, rather than hang the suite, if it runs longer."""
    def on_alarm(*_: object) -> None:
        raise TimeoutError("still running: the work is unbounded")

    old = signal.signal(signal.SIGALRM, on_alarm)
    yield lambda seconds: signal.alarm(seconds)
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def recipe_file(tmp_path: Path, text: str | bytes, name: str = "r.yaml") -> str:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


FULL_PIPELINE = ("[load_checkpoint, static_model, export_onnx, legalize_ort, lower_int4, lower_fp8, "
                 "{fuse_moe: {quantized: %s}}, write_onnx, package]")


def test_alias_bomb_fails_fast(tmp_path, within) -> None:
    """Nine lines of aliases expand to 10⁹ values: safe_load composes them in microseconds, then
    Recipe.to_dict's copy never finished. Refused before anything constructs or copies them."""
    lines = ["family: qwen3", "l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 10)]
    lines.append("pipeline: " + FULL_PIPELINE % "*l9")
    within(20)
    with pytest.raises(RecipeError, match=r"r\.yaml: line \d+: with its aliases followed, this holds more than 10,000"):
        load_recipe(recipe_file(tmp_path, "\n".join(lines)))


def test_self_referencing_alias(tmp_path, within) -> None:
    within(20)
    with pytest.raises(RecipeError, match="r.yaml: line 2: an alias refers to the collection that contains it"):
        load_recipe(recipe_file(tmp_path, "family: qwen3\npipeline: " + FULL_PIPELINE % "&a [*a]"))


def test_deep_recipe_is_an_error_not_a_recursion_error(tmp_path, within) -> None:
    within(20)
    deep = "[" * 50_000 + "]" * 50_000
    with pytest.raises(RecipeError, match="r.yaml: line 2: nested more than 32 levels deep"):
        load_recipe(recipe_file(tmp_path, f"family: qwen3\npipeline: {deep}\n"))


def test_duplicate_keys_are_refused(tmp_path) -> None:
    """PyYAML keeps the last of two equal keys: `dtype: fp16` further down silently won."""
    text = "family: qwen3\ndtype: fp32\npipeline: " + FULL_PIPELINE % "true" + "\ndtype: fp16\n"
    with pytest.raises(RecipeError, match="r.yaml: line 4: duplicate key 'dtype' \\(first on line 2\\)"):
        load_recipe(recipe_file(tmp_path, text))
    nested = "family: qwen3\npipeline: [load_checkpoint, {check_outputs: {run_limit_mb: 1,\n run_limit_mb: 2}}]\n"
    with pytest.raises(RecipeError, match="line 3: duplicate key 'run_limit_mb'"):
        load_recipe(recipe_file(tmp_path, nested))


def test_merge_keys_may_override(tmp_path) -> None:
    """`<<: *base` then a key of the merged mapping is YAML's override idiom, not a duplicate."""
    text = ("family: qwen3\npipeline: [load_checkpoint, static_model, export_onnx, legalize_ort, write_onnx, package,\n"
            "  {check_outputs: {<<: {run_limit_mb: 1}, run_limit_mb: 2}}]\n")
    r = load_recipe(recipe_file(tmp_path, text))
    assert r.pipeline[-1] == ("check_outputs", {"run_limit_mb": 2})


def test_non_utf8_and_oversized_recipes(tmp_path) -> None:
    with pytest.raises(RecipeError, match=r"r\.yaml: not UTF-8 text \(byte 0xff at offset 20\)"):
        load_recipe(recipe_file(tmp_path, b"family: qwen3\nname: \xff\xfe\npipeline: [load_checkpoint]\n"))
    with pytest.raises(RecipeError, match=r"big\.yaml: more than 1,048,576 bytes"):
        load_recipe(recipe_file(tmp_path, "#" * (2 << 20), "big.yaml"))
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(RecipeError, match=r"dir\.yaml: not a regular file"):
        load_recipe(str(tmp_path / "dir.yaml"))


@pytest.mark.parametrize(("step", "said"), [
    ("{lower_int4: {accuracy_level: 99}}", "pass 'lower_int4': accuracy_level must be 0-4, not 99"),
    ("{lower_int4: {accuracy_level: 2.5}}", "pass 'lower_int4': accuracy_level=2.5 must be a non-negative integer"),
    ("{fuse_moe: {quantized: 'no'}}", "pass 'fuse_moe': quantized='no' must be true or false"),  # bool('no') is True
    ("{lower_fp8: {storage: fp4}}", "pass 'lower_fp8': storage must be one of"),
])
def test_pass_arguments_are_checked_at_load(tmp_path, step: str, said: str) -> None:
    """accuracy_level 99 was a ValueError traceback from the pass's constructor, after staging."""
    text = ("family: qwen3\npipeline: [load_checkpoint, static_model, export_onnx, legalize_ort, lower_int4, "
            f"lower_fp8, {step}, write_onnx, package]\n").replace("lower_int4, lower_fp8, {lower_int4",
                                                                "lower_fp8, {lower_int4")
    text = text.replace("lower_fp8, {lower_fp8", "lower_int4, {lower_fp8")
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe_file(tmp_path, text))
    assert said in str(e.value) and "r.yaml" in str(e.value)


def test_run_limit_must_not_be_negative(tmp_path) -> None:
    text = "family: qwen3\npipeline: " + FULL_PIPELINE % "true" + "\n"
    text = text.replace("package]", "package, {check_outputs: {run_limit_mb: -1}}]")
    with pytest.raises(RecipeError, match="pass 'check_outputs': run_limit_mb=-1 must be a non-negative integer"):
        load_recipe(recipe_file(tmp_path, text))


def test_batch_size_is_bounded_before_the_export(cli, tmp_path, monkeypatch) -> None:
    with pytest.raises(RecipeError, match="batch_size=100000 is more than 256"):
        apply_overrides(load_recipe("qwen3-fp32"), ["batch_size=100000"])
    import qwen2om.convert

    def untouchable(*args: object, **kwargs: object) -> None:
        raise AssertionError("convert started work before refusing")

    monkeypatch.setattr(qwen2om.convert, "staged_output", untouchable)
    code, _, err = cli("convert", "builtin:tiny-qwen3", "-o", tmp_path / "o", "--batch-size", "100000")
    assert code == 2 and "batch_size=100000 is more than 256" in err, err


def test_a_pipeline_without_package_is_refused_by_the_plan_check(tmp_path) -> None:
    """The run finished, then OUT had no tokenizer and no run.py: `qwen2om run` could not load it."""
    text = "family: qwen3\npipeline: [load_checkpoint, static_model, export_onnx, legalize_ort, write_onnx]\n"
    with pytest.raises(PlanError, match="r.yaml: the pipeline has no 'package' pass: every output needs the tokenizer"):
        load_recipe(recipe_file(tmp_path, text))
    text = "family: qwen3\npipeline: [load_checkpoint, static_model, export_onnx, legalize_ort, package]\n"
    with pytest.raises(PlanError, match="package"):  # its own requires: onnx_files, which write_onnx produces
        load_recipe(recipe_file(tmp_path, text))


def test_capacity_beyond_memory_is_refused_before_allocation(cli, ckpt, tmp_path, monkeypatch) -> None:
    """--max-seq-len 1e8 on a model that claims that many positions tried to build 25.6 GB of RoPE tables,
    then failed with a traceback. Refused before anything is staged, naming the key and the bytes."""
    import qwen2om.convert
    import qwen2om.recipe

    def untouchable(*args: object, **kwargs: object) -> None:
        raise AssertionError("convert started work before refusing")

    monkeypatch.setattr(qwen2om.convert, "staged_output", untouchable)
    monkeypatch.setattr(qwen2om.recipe, "physical_memory", lambda: 16 << 30)
    edit_config(ckpt, max_position_embeddings=2**31 - 1)
    out = tmp_path / "out"
    code, _, err = cli("convert", ckpt, "-o", out, "--max-seq-len", "100000000")
    text = " ".join(err.split())
    assert code == 2 and "max_seq_len=100,000,000: the KV cache" in text, text
    assert "need 214.6 GiB (230,400,000,000 bytes), more than this machine's 16.0 GiB" in text, text
    code, _, err = cli("convert", ckpt, "-o", out, "--max-seq-len", str(2**31 - 1))
    text = " ".join(err.split())
    assert code == 2 and "max_seq_len=2,147,483,647: a call sees the cache and 128 new tokens" in text, text
    assert "Traceback" not in err and not out.exists()


@pytest.mark.parametrize(("file", "value"), [("generation_config.json", "x"), ("generation_config.json", [2, -1]),
                                             ("config.json", 10**9), ("generation_config.json", True)])
def test_stop_and_pad_ids_are_token_ids(cli, ckpt: Path, tmp_path: Path, file: str, value: object) -> None:
    """eos_token_id went through int() after the whole conversion (a traceback, OUT's work thrown away);
    it is a token id of the vocabulary, checked before any work, naming the file that set it."""
    path = ckpt / file
    data = json.loads(path.read_text())
    if file == "config.json":
        (ckpt / "generation_config.json").unlink()
    path.write_text(json.dumps({**data, "eos_token_id": value}))
    convert_fails(cli, ckpt, tmp_path, file, "eos_token_id must be a token id")
