"""W4A16 calibration: formats other tools read, what stays float, GPTQ quality, int4 graphs in ORT."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from qwen2om.builtin import resolve_model
from qwen2om.checkpoint import Checkpoint
from qwen2om.quant.calibrate import CalibrationConfig, calibrate
from qwen2om.quant.gptq import gptq, output_error
from qwen2om.quant.int4 import Int4Spec, dequantize, pack_int4, rtn, unpack_int4

SMALL = dict(group_size=32, num_samples=8, seq_len=64)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for method in ("gptq", "rtn", "awq"):
        path = tmp_path_factory.mktemp("cal") / method
        calibrate("builtin:tiny-qwen3", path, CalibrationConfig(method=method, **SMALL))
        out[method] = path
    return out


def test_packing_is_byte_identical_to_compressed_tensors() -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q = torch.randint(-8, 8, (24, 200), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(pack_int4(q), pack_to_int32(q, 4))
    assert torch.equal(pack_int4(q, dim=0), pack_to_int32(q, 4, packed_dim=0))
    assert torch.equal(unpack_int4(pack_int4(q), 200), q)
    assert torch.equal(unpack_int4(pack_int4(q, dim=0), 24, dim=0), q)


def test_shard_writer_streams_tensors_to_readable_shards(tmp_path) -> None:
    """Each tensor goes to disk as it is added (the writer kept up to a 1 GiB shard in memory, and
    safetensors' save_file a second copy: calibrate's peak grew with the model until then), and the
    shards read back through safetensors and qwen2om's own reader, every dtype calibrate writes."""
    import gc
    import weakref

    from safetensors.torch import load_file

    from qwen2om.quant.writer import INDEX, ShardWriter
    from qwen2om.safetensors_io import Shard

    tensors = {"a": torch.randn(3, dtype=torch.bfloat16), "b": torch.arange(300, dtype=torch.int32),
               "c": torch.tensor(2.5), "d": torch.randn(4, 4).to(torch.float8_e4m3fn),
               "e": torch.tensor([True, False]), "f": torch.empty(0, 3), "g": torch.randn(5, 7).T}
    writer = ShardWriter(tmp_path, shard_bytes=1000, header_bytes=4096)
    big = torch.randn(64, 64)
    gone = weakref.ref(big)
    writer.add("big", big)
    del big
    gc.collect()
    assert gone() is None  # written, not held
    for name, t in tensors.items():
        writer.add(name, t)
    with pytest.raises(ValueError, match="written twice"):
        writer.add("a", tensors["a"])
    writer.close()
    weight_map = json.loads((tmp_path / INDEX).read_text())["weight_map"]
    # at most 1,000 bytes of data a shard unless one tensor is larger: 16 KiB alone, 6 + 1,200 > 1,000, the rest
    assert writer.shards == [["big"], ["a"], ["b"], ["c", "d", "e", "f", "g"]] and len(set(weight_map.values())) == 4
    loaded = {k: v for f in set(weight_map.values()) for k, v in load_file(tmp_path / f).items()}
    for name, t in tensors.items():
        for got in (loaded[name], Shard(tmp_path / weight_map[name]).read(name)):
            assert got.dtype == t.dtype and torch.equal(got.reshape(-1).view(torch.uint8),
                                                        t.reshape(-1).view(torch.uint8)), name


def test_shard_writer_survives_a_failed_tensor(tmp_path) -> None:
    """A tensor whose chunks fail half-way leaves the shard as it was: later tensors still make a valid file."""
    from safetensors.torch import load_file

    from qwen2om.quant.writer import INDEX, ShardWriter

    writer = ShardWriter(tmp_path, header_bytes=4096)
    writer.add("a", torch.arange(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="chunk"):
        writer.add_chunks("b", torch.float32, (2, 3), [torch.zeros(1, 3), torch.zeros(1, 3, dtype=torch.int32)])
    writer.add("c", torch.ones(2))
    writer.close()
    shard = json.loads((tmp_path / INDEX).read_text())["weight_map"]["a"]
    assert {k: v.tolist() for k, v in load_file(tmp_path / shard).items()} == {"a": [0, 1, 2, 3], "c": [1.0, 1.0]}


def test_non_finite_activations_name_their_sample_batched_or_flattened() -> None:
    """A shared expert sees its batch flattened to [B·T, H]: the sample was looked up per token row
    (a NaN in the second sample raised StopIteration, a traceback)."""
    from qwen2om.quant.calibrate import CalibrationError, _finite_or_raise

    y = torch.zeros(2, 3, 4)
    y[1, 2, 0] = float("nan")
    for x in (y, y.reshape(6, 4)):
        with pytest.raises(CalibrationError, match="layer 7: its input on calibration sample 12 is not finite"):
            _finite_or_raise(x, 7, [11, 12], "its input")
    _finite_or_raise(torch.zeros(6, 4), 7, [11, 12], "its input")


@pytest.mark.numerics
def test_gptq_beats_round_to_nearest_on_correlated_inputs() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 256, generator=g) @ (torch.randn(256, 256, generator=g) * 0.1 + torch.eye(256))
    x[:, :4] *= 20  # a few outlier channels, as real activations have
    w = torch.randn(64, 256, generator=g) * 0.05
    h = 2 * x.T @ x / x.shape[0]
    spec = Int4Spec(64, True)
    q, s, z = rtn(w, spec)
    r = gptq(w, h, spec)
    rtn_err = output_error(w, dequantize(q, s, z, 64), h)
    gptq_err = output_error(w, dequantize(r.q, r.scale, None, 64), h)
    assert r.method == "gptq" and gptq_err < rtn_err / 2


def test_singular_hessian_falls_back_to_rtn_with_a_reason() -> None:
    w = torch.randn(8, 64)
    h = -torch.eye(64)  # not positive definite whatever the dampening
    r = gptq(w, h, Int4Spec(32, True))
    assert r.method == "rtn" and "not positive definite" in r.note


def test_norms_embeddings_and_head_stay_float(calibrated) -> None:
    ckpt = Checkpoint(calibrated["gptq"])
    names = set(ckpt.names())
    for keep in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight",
                 "model.layers.0.post_attention_layernorm.weight", "model.layers.0.self_attn.q_norm.weight",
                 "model.layers.0.self_attn.k_norm.weight"):
        assert keep in names and ckpt.info(keep).dtype == torch.bfloat16, keep
    assert len(ckpt.quantized) == 4 * 7  # every decoder linear, nothing else
    assert all(".layers." in n and n.endswith("_proj.weight") for n in ckpt.quantized)
    cfg = json.loads((calibrated["gptq"] / "config.json").read_text())["quantization_config"]
    assert cfg["ignore"] == ["lm_head"] and cfg["config_groups"]["group_0"]["weights"]["group_size"] == 32


def test_transformers_decompresses_to_our_dequantisation(calibrated) -> None:
    """compressed-tensors (what transformers and vLLM use) reads the checkpoint as we wrote it; its
    decompression multiplies in the scale's dtype (bf16), ours in float32: equal after that rounding."""
    import transformers
    from transformers import CompressedTensorsConfig

    model = transformers.AutoModelForCausalLM.from_pretrained(
        calibrated["gptq"], dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False))
    ckpt = Checkpoint(calibrated["gptq"])
    sd = model.state_dict()
    for name in ckpt.quantized:
        assert torch.equal(sd[name].to(torch.bfloat16), ckpt.get(name).to(torch.bfloat16)), name


@pytest.mark.parametrize(("model", "group", "loader", "left_float"), [
    # Qwen3.5 as published: the text model inside model.language_model.*, kept so (its config names
    # the wrapper class); in_proj_a/b are the hybrids' decay / write-strength projections
    ("tiny-qwen3-5", 32, "AutoModelForImageTextToText", "model.language_model.layers.0.linear_attn.in_proj_a"),
    ("tiny-qwen3-5", 32, "AutoModelForCausalLM", "model.language_model.layers.0.linear_attn.in_proj_b"),
    ("tiny-qwen2-moe", 16, "AutoModelForCausalLM", "model.layers.0.mlp.shared_expert_gate"),  # and the router
])
def test_transformers_loads_the_linears_left_float(model, group, loader, left_float, tmp_path) -> None:
    """Every 2-D weight left float is in the config's `ignore`: a Linear not listed was quantised by the
    loader, which then found no packed weight and initialised it at random (Qwen3.5's in_proj_a/b); and
    a wrapper's text model is written where its config says (it was written under text names, which
    the wrapper class did not find)."""
    import transformers
    from transformers import CompressedTensorsConfig

    out = tmp_path / "q"
    calibrate(f"builtin:{model}", out, CalibrationConfig(method="rtn", group_size=group))
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert left_float in ignore and "lm_head" in ignore
    model_, info = getattr(transformers, loader).from_pretrained(
        out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False),
        output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["unexpected_keys"], info
    sd, ckpt = model_.state_dict(), Checkpoint(out)
    compared = 0
    for module in ignore:
        for key in {f"{module}.weight", f"{module}.weight".replace(".language_model.", ".")}:
            if key in sd and module != "lm_head":
                text_name = f"{module}.weight".replace(".language_model.", ".")
                assert torch.equal(sd[key], ckpt.get(text_name, torch.float32)), key
                compared += 1
    assert compared >= 2 and any(n.endswith("_proj.weight") for n in ckpt.quantized)


def test_clip_search_never_raises_an_error_and_is_recorded(calibrated, tmp_path) -> None:
    """--clip-search: each output row keeps the clipping ratio whose GPTQ result has the least output error;
    ratio 1 (the default run's) is one of the candidates, so on the same inputs no linear does worse."""
    from qwen2om.quant.schemes import CalibrationError

    out = tmp_path / "clip"
    calibrate("builtin:tiny-qwen3", out, CalibrationConfig(method="gptq", clip_search=True, **SMALL))
    clip = json.loads((out / "calibration_report.json").read_text())
    plain = json.loads((calibrated["gptq"] / "calibration_report.json").read_text())
    # layer 0 sees the same inputs in both runs (nothing is quantised before it); later layers do not
    first, first_plain = clip["layers"][0]["linears"], plain["layers"][0]["linears"]
    for a, b in zip(first, first_plain, strict=True):
        # 1 %: the search's ratio-1 rows run stacked with the others, a product another CPU's BLAS may block
        # differently from the plain run's, so a code on a rounding boundary may fall the other way
        assert a["name"] == b["name"] and a["error"] <= b["error"] * 1.01, (a, b)
    assert sum(x["error"] for x in first) < sum(x["error"] for x in first_plain)

    def recorded(path: Path) -> list[float]:
        return json.loads((path / "config.json").read_text())["quantization_config"]["qwen2om"]["clip_ratios"]
    assert recorded(out) == [1.0, 0.95, 0.9, 0.85] and recorded(calibrated["gptq"]) == [1.0]
    for method in ("awq", "rtn"):
        with pytest.raises(CalibrationError, match="--clip-search searches GPTQ's clipping"):
            CalibrationConfig(method=method, clip_search=True)


def test_gptq_report_shows_lower_error_than_rtn(calibrated) -> None:
    report = json.loads((calibrated["gptq"] / "calibration_report.json").read_text())
    assert report["method"] == "gptq" and report["quantized"] == 28 and not report["fell_back_to_rtn"]
    assert report["mean_error"] < report["mean_rtn_error"]
    assert report["dataset"]["samples"] == 8 and report["dataset"]["seq_len"] == 64
    assert len(report["layers"]) == 4


def test_bf16_forwards_calibrate_nearly_as_well_as_float32(calibrated, tmp_path) -> None:
    """--compute-dtype bfloat16 runs the layers in bf16 (Hessians and quantisation stay float32): the
    same samples give a GPTQ result still far better than RTN and close to the float32 one."""
    from qwen2om.quant.calibrate import compute_dtype

    out = tmp_path / "bf16"
    calibrate("builtin:tiny-qwen3", out, CalibrationConfig(method="gptq", compute_dtype="bfloat16", **SMALL))
    bf16 = json.loads((out / "calibration_report.json").read_text())
    fp32 = json.loads((calibrated["gptq"] / "calibration_report.json").read_text())
    assert bf16["compute_dtype"] == "bfloat16" and fp32["compute_dtype"] == "float32"
    assert bf16["mean_error"] < bf16["mean_rtn_error"] / 2
    assert bf16["mean_error"] < 1.5 * fp32["mean_error"]
    a, b = Checkpoint(out), Checkpoint(calibrated["gptq"])
    name = "model.layers.3.mlp.down_proj.weight"  # the last layer's inputs went through three bf16 layers
    assert not torch.equal(a.get(name), b.get(name))
    assert compute_dtype(CalibrationConfig(compute_dtype="auto"), b) == torch.bfloat16  # tiny-qwen3 is bf16


def test_a_bad_compute_dtype_is_refused(cli, tmp_path) -> None:
    code, _, err = cli("calibrate", "builtin:tiny-qwen3", "-o", tmp_path / "q", "--compute-dtype", "int8")
    assert code == 2 and "compute_dtype 'int8' is not one of float32, bfloat16, float16, auto" in err


@pytest.mark.parametrize("k", [700, 2048, 2500])
def test_blocked_gram_is_the_full_product(k: int) -> None:
    """The Hessian's xᵀx multiplies only the blocks on and above the diagonal of wide inputs."""
    from qwen2om.quant.gptq import GRAM_BLOCK, gram

    x = torch.randn(96, k, generator=torch.Generator().manual_seed(k))
    g = gram(x)
    torch.testing.assert_close(g, x.T @ x, rtol=1e-5, atol=1e-4)
    assert torch.equal(g, g.T) and (k > GRAM_BLOCK) == (k >= 2048)


@pytest.mark.numerics
def test_awq_scales_protect_outlier_channels() -> None:
    """AWQ's scaled-and-clipped rounding beats plain rounding when a few input channels dominate."""
    from qwen2om.quant.awq import clip_quantize, search_scale

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 256, generator=g) * 0.5
    x[:, :8] *= 30
    w = torch.randn(64, 256, generator=g) * 0.05
    h = 2 * x.T @ x / x.shape[0]
    spec = Int4Spec(64, True)
    q, s, _ = rtn(w, spec)
    scale, base, best = search_scale([w], [h], x.abs().mean(0), spec)
    assert best < base
    q2, s2, _ = clip_quantize(w * scale, h / (scale[:, None] * scale[None, :]), spec)
    awq_err = output_error(w, dequantize(q2, s2, None, 64) / scale, h)
    assert awq_err < output_error(w, dequantize(q, s, None, 64), h) / 1.5


def test_awq_folds_its_scales_into_float_norms(calibrated) -> None:
    """The 1/s of AWQ lives in the (still float) norm weights; the report shows the error it saved."""
    report = json.loads((calibrated["awq"] / "calibration_report.json").read_text())
    assert report["method"] == "awq" and report["mean_error"] < report["mean_rtn_error"]
    awq, gptq_ = Checkpoint(calibrated["awq"]), Checkpoint(calibrated["gptq"])
    name = "model.layers.0.input_layernorm.weight"
    assert awq.info(name).dtype == torch.bfloat16 and not torch.equal(awq.get(name), gptq_.get(name))


def test_force_replaces_an_earlier_calibration(calibrated, cli) -> None:
    code, _, err = cli("calibrate", "builtin:tiny-qwen3", "-o", calibrated["rtn"], "--method", "rtn",
                       "--group-size", "32", "--force")
    assert code == 0, err


@pytest.mark.parametrize("method", ["gptq", "rtn", "awq"])
def test_int4_graph_matches_its_dequantised_weights(calibrated, tmp_path, method: str) -> None:
    """MatMulNBits (accuracy level 0) against transformers running the exact dequantised weights."""
    from qwen2om.convert import convert
    from qwen2om.verify import verify

    out = tmp_path / "out"
    result = convert(calibrated[method], out, overrides=["max_seq_len=128", "prefill_chunk=16"])
    lowered = next(s for s in result.manifest["stages"] if s["pass"] == "lower_int4")
    assert lowered["stats"]["lowered"] == 2 * 28  # both graphs
    assert result.manifest["runtime"]["prepack_weights"]  # MatMulNBits is fast only prepacked
    summary = (out / "graphs" / "summary.txt").read_text()
    assert "op     MatMulNBits 16" in summary  # fuse_int4: per layer qkv, o, gate_up, down
    report = verify(out, str(calibrated[method]), tokens=8, prompts=["The quick brown fox"])
    assert report.passed and report.max_abs <= 1e-3


@pytest.mark.slow
def test_asymmetric_zero_points_reach_matmulnbits(tmp_path) -> None:
    from qwen2om.convert import convert
    from qwen2om.verify import verify

    ckpt = tmp_path / "asym"
    calibrate("builtin:tiny-qwen3", ckpt, CalibrationConfig(method="rtn", symmetric=False, **SMALL))
    assert "model.layers.0.mlp.up_proj.weight_zero_point" in set(Checkpoint(ckpt).names())
    out = tmp_path / "out"
    convert(ckpt, out, overrides=["max_seq_len=128", "prefill_chunk=16"])
    report = verify(out, str(ckpt), tokens=8, prompts=["Hello there"])
    assert report.passed and report.max_abs <= 1e-3


def test_calibrate_cli_bad_inputs(tmp_path, cli, calibrated) -> None:
    code, _, err = cli("calibrate", "builtin:tiny-qwen3", "-o", tmp_path / "a", "--num-samples", "2",
                       "--seq-len", "32")
    assert code == 2 and "input width 160 is not a multiple of --group-size 128" in err and "down_proj" in err
    assert "group sizes that fit every layer: 16, 32" in err
    assert not (tmp_path / "a").exists()
    code, _, err = cli("calibrate", calibrated["rtn"], "-o", tmp_path / "b")
    assert code == 2 and "already quantised" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken}\n')
    code, _, err = cli("calibrate", "builtin:tiny-qwen3", "-o", tmp_path / "c", "--group-size", "32",
                       "--dataset", bad)
    assert code == 2 and f"{bad}:2: not valid JSON" in err
    bad.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    code, _, err = cli("calibrate", "builtin:tiny-qwen3", "-o", tmp_path / "c", "--group-size", "32",
                       "--dataset", bad)
    assert code == 2 and f"{bad}:2: not UTF-8" in err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    code, _, err = cli("calibrate", "builtin:tiny-qwen3", "-o", tmp_path / "c", "--group-size", "32",
                       "--dataset", empty)
    assert code == 2 and "empty" in err
    code, _, err = cli("calibrate", "builtin:tiny-qwen3", "-o", calibrated["rtn"], "--method", "rtn",
                       "--group-size", "32")
    assert code == 2 and "--force" in err


def test_group_size_is_checked_before_any_data_or_weight_is_read(tmp_path, cli, checkpoint, monkeypatch) -> None:
    """Every built-in MoE model's experts are narrower than the default group of 128; calibrate used to
    find out only after tokenising the calibration data (and, for dense layers first, calibrating some).
    The widths come from the tensor table: refused before the data, a weight or the output is touched."""
    import qwen2om.quant.calibrate as cal

    checkpoint("tiny-qwen3-moe")  # built (if need be) before reading weights is forbidden

    def untouchable(*args: object, **kwargs: object) -> None:
        raise AssertionError("work started before the group size was checked")

    monkeypatch.setattr(cal, "windows", untouchable)
    monkeypatch.setattr(cal, "staged_output", untouchable)
    monkeypatch.setattr(Checkpoint, "get", untouchable)
    out = tmp_path / "x"
    code, _, err = cli("calibrate", "builtin:tiny-qwen3-moe", "-o", out)
    assert code == 2, err
    assert "model.layers.0.mlp.experts.0.down_proj.weight: input width 32 is not a multiple of --group-size 128" in err
    assert "use --group-size 32" in err and "nothing was written" in err
    assert not out.exists() and not (tmp_path / ".x.partial").exists()


def test_group_check_respects_ignore_and_the_lm_head(checkpoint) -> None:
    from qwen2om.quant.calibrate import CalibrationError, check_group_size, quantized_widths

    ckpt = Checkpoint(checkpoint("tiny-qwen2-moe"))
    widths = quantized_widths(ckpt, CalibrationConfig())
    assert widths["model.layers.1.mlp.experts.7.down_proj.weight"] == 32
    assert widths["model.layers.1.mlp.shared_expert.down_proj.weight"] == 48
    assert not {"model.layers.0.mlp.gate.weight", "model.layers.0.mlp.shared_expert_gate.weight",
                "lm_head.weight", "model.embed_tokens.weight"} & set(widths)  # never quantised
    with pytest.raises(CalibrationError, match=r"use --group-size 16, the largest power of two ≤ 32"):
        check_group_size(widths, 32)  # the shared expert's 48
    check_group_size(quantized_widths(ckpt, CalibrationConfig(ignore=("shared_expert",))), 32)
    check_group_size(quantized_widths(ckpt, CalibrationConfig(ignore=("down_proj",))), 64)
    head = quantized_widths(ckpt, CalibrationConfig(ignore=(r"model\.layers",), quantize_lm_head=True))
    assert head == {"lm_head.weight": 64}
    with pytest.raises(CalibrationError, match=r"^lm_head.weight: input width 64 .*use --group-size 64"):
        check_group_size(head, 128)


def test_short_dataset_is_packed_and_counted(tmp_path, cli) -> None:
    data = tmp_path / "chat.jsonl"
    lines = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
             {"text": "A short line."}] * 3
    data.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    code, out, err = cli("calibrate", "builtin:tiny-qwen3", "-o", tmp_path / "o", "--group-size", "32",
                         "--dataset", data, "--num-samples", "50", "--seq-len", "16")
    assert code == 0, err
    report = json.loads((tmp_path / "o" / "calibration_report.json").read_text())
    n = report["dataset"]["samples"]
    assert 0 < n < 50 and f"{n} samples of 16 tokens, not the 50 asked for" in err


@pytest.mark.parametrize("name", ["prose", "code", "chinese", "chat", "prose+code"])
def test_builtin_datasets_give_full_windows(name: str, checkpoint) -> None:
    from qwen2om.datasets import windows

    w = windows(f"builtin:{name}", checkpoint("tiny-qwen3"), num_samples=4, seq_len=128)
    assert len(w.samples) == 4 and all(len(s) == 128 for s in w.samples) and len(w.sha256) == 64
    if name == "chinese":
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(checkpoint("tiny-qwen3") / "tokenizer.json"))
        text = "".join(tok.decode(s) for s in w.samples)
        assert sum("\u4e00" <= c <= "\u9fff" for c in text) > 40
    if name == "chat":
        assert 151644 in w.samples[0]  # <|im_start|>: formatted with the chat template


def test_unknown_builtin_dataset_lists_the_known_ones(checkpoint) -> None:
    from qwen2om.datasets import DatasetError, windows

    with pytest.raises(DatasetError, match="known: prose, code, chinese, chat"):
        windows("builtin:poetry", checkpoint("tiny-qwen3"), num_samples=1, seq_len=8)


def _poisoned(checkpoint, tmp_path, name: str, value: float, everywhere: bool = False) -> Path:
    """tiny-qwen3 with one value (or, `everywhere`, every value) of tensor `name` replaced."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "ckpt"
    shutil.copytree(checkpoint("tiny-qwen3"), src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = src / index["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[slice(None) if everywhere else 0] = value
    save_file(tensors, shard, metadata={"format": "pt"})
    return src


def test_an_interrupted_calibration_leaves_nothing_to_trip_over(tmp_path, cli, monkeypatch) -> None:
    """An exception that is not a qwen2om error (a bare KeyboardInterrupt in a library call) removes the
    staging directory; one a killed run left behind is named, with --resume and --force as the ways on."""
    from qwen2om.quant.calibrate import Calibrator

    def interrupted(self: Calibrator, samples: list[list[int]], pool: object = None) -> None:
        raise KeyboardInterrupt
    monkeypatch.setattr(Calibrator, "run", interrupted)
    out = tmp_path / "q"
    with pytest.raises(KeyboardInterrupt):
        calibrate("builtin:tiny-qwen3", out, CalibrationConfig(method="rtn", group_size=32))
    assert not out.exists() and list(tmp_path.iterdir()) == []
    (tmp_path / ".q.partial").mkdir()  # left by a run killed outright
    code, _, err = cli("calibrate", "builtin:tiny-qwen3", "-o", out, "--method", "rtn", "--group-size", "32")
    assert code == 2 and "rerun with --force to start over" in err and "--resume" not in err  # RTN: nothing to resume
    code, _, err = cli("calibrate", "builtin:tiny-qwen3", "-o", out, "--group-size", "32")
    assert code == 2 and "--force" in err and "--resume" in err  # GPTQ resumes from its last finished layer


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_nan_weight_names_the_tensor_and_writes_nothing(checkpoint, tmp_path, cli, method: str) -> None:
    src = _poisoned(checkpoint, tmp_path, "model.layers.2.mlp.up_proj.weight", float("nan"))
    code, _, err = cli("calibrate", src, "-o", tmp_path / "out", "--method", method, "--group-size", "32",
                       "--num-samples", "2", "--seq-len", "32")
    assert code == 2 and "model.layers.2.mlp.up_proj.weight: 1 non-finite values" in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_non_finite_layer_output_names_the_layer(checkpoint, tmp_path, cli) -> None:
    """A finite but huge norm weight overflows the MLP's input: the error names the layer and the linear
    (the collecting pass stops before the layer's output, so the first linear to see Inf is named).
    Every channel's weight is huge: one channel alone overflows only where its normalised value
    exceeds 1.13 (3e38 · 1.13 > fp32 max), which depends on the fixture's random weights."""
    src = _poisoned(checkpoint, tmp_path, "model.layers.1.post_attention_layernorm.weight", 3e38, everywhere=True)
    code, _, err = cli("calibrate", src, "-o", tmp_path / "out", "--group-size", "32", "--num-samples", "2",
                       "--seq-len", "32")
    assert code == 2 and "layer 1: the input of mlp.gate_proj on calibration sample 0 is not finite" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("layer", [1, 3])
def test_overflowing_layer_output_names_that_layer(checkpoint, tmp_path, cli, layer: int) -> None:
    """A finite but huge down_proj overflows the layer's output. It was named as the next layer's input
    (layer 1) or not caught at all (layer 3, the last: no output pass feeds another layer)."""
    src = _poisoned(checkpoint, tmp_path, f"model.layers.{layer}.mlp.down_proj.weight", 3e38, everywhere=True)
    code, _, err = cli("calibrate", src, "-o", tmp_path / "out", "--group-size", "32", "--num-samples", "2",
                       "--seq-len", "32")
    assert code == 2 and f"layer {layer}: its output" in err and "calibration sample 0 is not finite" in err, err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_inspect_lists_the_quantised_modules(calibrated, cli) -> None:
    """`inspect CKPT` shows which modules are int4 at which group size (layers folded), and what stays float."""
    code, stdout, err = cli("inspect", calibrated["gptq"], "--json")
    assert code == 0, err
    rows = {r["module"]: r for r in json.loads(stdout)["quantized_modules"]}
    assert set(rows) == {f"model.layers.N.{m}" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                          "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                          "mlp.down_proj")}
    assert {(r["scheme"], tuple(r["block"]), r["symmetric"], r["count"]) for r in rows.values()} == {
        ("int4", (1, 32), True, 4)}
    code, stdout, _ = cli("inspect", calibrated["gptq"])
    text = " ".join(stdout.split())
    assert code == 0 and "quantised weights: 28 int4" in text
    assert "model.layers.N.mlp.down_proj │ int4 │ 1×32 │ none (symmetric)" in text
    assert "kept float by the checkpoint's config: lm_head" in text


def test_ascendv1_format_holds_the_same_quantisation(calibrated, tmp_path) -> None:
    """msModelSlim's W4A16 layout (int8 values in [-8, 7], float32 scale/offset, a description file):
    the same GPTQ run stored both ways dequantises identically, and converts to a graph that verifies."""
    from qwen2om.convert import convert
    from qwen2om.verify import verify

    out = tmp_path / "asc"
    calibrate("builtin:tiny-qwen3", out, CalibrationConfig(method="gptq", fmt="ascendv1", **SMALL))
    desc = json.loads((out / "quant_model_description.json").read_text())
    assert desc["model_quant_type"] == "W4A16" and desc["group_size"] == 32
    assert desc["model.layers.0.self_attn.q_proj.weight"] == "W4A16" and desc["model.norm.weight"] == "FLOAT"
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    asc, ct = Checkpoint(out), Checkpoint(calibrated["gptq"])
    name = "model.layers.1.mlp.down_proj.weight"
    raw = asc.raw(name)
    assert raw.dtype == torch.int8 and raw.min() >= -8 and raw.max() <= 7
    assert asc.raw("model.layers.1.mlp.down_proj.weight_scale").dtype == torch.float32
    assert set(asc.quantized) == set(ct.quantized)
    for n in asc.quantized:
        assert torch.equal(asc.get(n), ct.get(n)), n
    result = convert(out, tmp_path / "onnx", overrides=["max_seq_len=128", "prefill_chunk=16"])
    assert next(s for s in result.manifest["stages"] if s["pass"] == "lower_int4")["stats"]["lowered"] == 56
    report = verify(tmp_path / "onnx", str(out), tokens=8, prompts=["Once upon a time"])
    assert report.passed and report.max_abs <= 1e-3


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_scales_as_graph_inputs(calibrated, tmp_path, dtype: str) -> None:
    """`--scales inputs`: every quantised linear's scales become a `<weight>.scale` input listed in
    scale_map.json, with values in scales.safetensors that the runtime binds once."""
    from safetensors.torch import load_file

    from qwen2om.convert import convert
    from qwen2om.runtime.standalone import Engine, RuntimeInputError
    from qwen2om.verify import verify

    out = tmp_path / "out"
    result = convert(calibrated["gptq"], out, overrides=["max_seq_len=128", "prefill_chunk=16", f"dtype={dtype}",
                                                          "scales=inputs"])
    scale_ios = [io for io in result.manifest["graphs"]["decode"]["inputs"] if io["role"] == "scale"]
    assert len(scale_ios) == 28
    smap = json.loads((out / "scale_map.json").read_text())
    assert {io["name"] for io in scale_ios} == set(smap)
    entry = smap["model.layers.2.self_attn.o_proj.weight.scale"]
    assert entry["layer"] == 2 and entry["shape"] == [64, 4] and entry["group_size"] == 32
    assert entry["source"] == "model.layers.2.self_attn.o_proj.weight_scale"
    values = load_file(out / "scales.safetensors")
    ckpt = Checkpoint(calibrated["gptq"])
    assert torch.equal(values["model.layers.2.self_attn.o_proj.weight.scale"],
                       ckpt.raw(entry["source"]).float())
    if dtype == "fp32":
        report = verify(out, str(calibrated["gptq"]), tokens=8, prompts=["A scale input"])
        assert report.passed and report.max_abs <= 1e-3
    else:
        logits = Engine(out).prefill([[9707, 11, 1879]])
        assert np.isfinite(logits).all()
    from safetensors.torch import save_file

    values.pop("model.layers.2.self_attn.o_proj.weight.scale")
    save_file(values, str(out / "scales.safetensors"))
    with pytest.raises(RuntimeInputError, match="model.layers.2.self_attn.o_proj.weight.scale"):
        Engine(out)


def test_batch_size_changes_speed_not_the_result(calibrated, tmp_path) -> None:
    """Samples stacked four at a time through each layer give the same quantised weights."""
    out = tmp_path / "b4"
    calibrate("builtin:tiny-qwen3", out, CalibrationConfig(method="gptq", batch_size=4, **SMALL))
    a, b = Checkpoint(calibrated["gptq"]), Checkpoint(out)
    for n, q in a.quantized.items():
        assert torch.equal(a.raw(q.tensor("packed")), b.raw(q.tensor("packed"))), n
        assert torch.equal(a.raw(q.tensor("scale")), b.raw(q.tensor("scale"))), n


def test_recipe_extends_the_ignore_list_and_flags_override_it(tmp_path, cli) -> None:
    recipe = tmp_path / "cal.yaml"
    recipe.write_text("method: gptq\ngroup_size: 32\nnum_samples: 4\nseq_len: 32\nignore: ['mlp\\.down_proj']\n")
    code, _, err = cli("calibrate", "builtin:tiny-qwen3", "-o", tmp_path / "o", "--recipe", recipe, "--method", "rtn",
                       "--ignore", r"layers\.0\.self_attn\.q_proj")
    assert code == 0, err
    ckpt = Checkpoint(tmp_path / "o")
    assert json.loads((tmp_path / "o" / "calibration_report.json").read_text())["method"] == "rtn"
    assert not any("down_proj" in n for n in ckpt.quantized) and len(ckpt.quantized) == 4 * 6 - 1
    assert ckpt.info("model.layers.1.mlp.down_proj.weight").dtype == torch.bfloat16
    ignore = json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]["ignore"]
    assert "model.layers.0.self_attn.q_proj" in ignore and "model.layers.3.mlp.down_proj" in ignore
    recipe.write_text("methd: gptq\n")
    code, _, err = cli("calibrate", "builtin:tiny-qwen3", "-o", tmp_path / "p", "--recipe", recipe)
    assert code == 2 and "unknown setting(s) methd" in err


def test_verify_tolerance_follows_the_int4_accuracy_level() -> None:
    from qwen2om.verify import tolerance

    def manifest(dtype: str, level: int | None) -> dict:
        stages = [] if level is None else [{"pass": "lower_int4", "stats": {"lowered": 56, "accuracy_level": level}}]
        return {"runtime": {"dtype": dtype}, "stages": stages}

    assert tolerance(manifest("float32", None)) == {"max_abs": 1e-4, "agreement": 1.0}
    assert tolerance(manifest("float32", 0)) == tolerance(manifest("float32", 1)) == {"max_abs": 1e-4, "agreement": 1.0}
    acc4 = tolerance(manifest("float32", 4))
    assert acc4["max_abs"] is None and acc4["agreement"] == 0.90 and "int8" in acc4["why"]
    assert tolerance(manifest("float16", 2))["agreement"] == 0.99
    float_model = {"runtime": {"dtype": "float32"}, "stages": [{"pass": "lower_int4", "stats": {"lowered": 0,
                                                                                               "accuracy_level": 4}}]}
    assert tolerance(float_model)["max_abs"] == 1e-4  # nothing lowered: exact as before


@pytest.mark.slow
def test_quantized_lm_head_of_a_tied_model(tmp_path) -> None:
    """--quantize-lm-head on a tied model: its own int4 lm_head, the embedding stays float, convert
    lowers the head to MatMulNBits (its output is `logits` itself in fp32), and accuracy level 4
    passes verify with its own tolerance."""
    from qwen2om.convert import convert
    from qwen2om.verify import verify

    ckpt = tmp_path / "w4"
    calibrate("builtin:tiny-qwen3", ckpt, CalibrationConfig(method="rtn", quantize_lm_head=True, **SMALL))
    c = Checkpoint(ckpt)
    names = set(c.names())
    assert {"lm_head.weight_packed", "lm_head.weight_scale"} <= names and "lm_head.weight" not in names
    assert c.info("model.embed_tokens.weight").dtype.is_floating_point
    assert json.loads((ckpt / "config.json").read_text())["tie_word_embeddings"] is False
    recipe = tmp_path / "acc4.yaml"
    text = (Path(__file__).parents[1] / "recipes" / "ort.yaml").read_text()
    recipe.write_text(text.replace("  - lower_int4 ", "  - lower_int4: {accuracy_level: 4} ", 1))
    out = tmp_path / "out"
    result = convert(ckpt, out, recipe=str(recipe), overrides=["max_seq_len=128", "prefill_chunk=16"])
    assert next(s for s in result.manifest["stages"] if s["pass"] == "lower_int4")["stats"] == {
        "lowered": 2 * 29, "accuracy_level": 4}
    import onnx

    decode = onnx.load(str(out / "model.decode.onnx"), load_external_data=False)
    head = next(n for n in decode.graph.node if n.name == "/lm_head/MatMulNBits")
    assert head.output[0] == "logits"
    report = verify(out, str(ckpt), tokens=8, prompts=["The quick brown fox"])
    assert report.passed and report.tolerance["agreement"] == 0.90, report.to_dict()


def test_an_existing_output_is_refused_before_the_data_is_read(tmp_path, cli, checkpoint, monkeypatch) -> None:
    """OUT already there (without --force) is named before the dataset is read and tokenised."""
    import qwen2om.quant.calibrate as cal

    checkpoint("tiny-qwen3")

    def untouchable(*args: object, **kwargs: object) -> None:
        raise AssertionError("the dataset was read before the existing output was refused")

    monkeypatch.setattr(cal, "windows", untouchable)
    out = tmp_path / "x"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = cli("calibrate", "builtin:tiny-qwen3", "-o", out, "--group-size", "32")
    assert code == 2 and "exists; pass --force" in err, err
    assert (out / "keep.txt").read_text() == "mine"


def test_awq_stores_a_float_producer_it_shrank(tmp_path) -> None:
    """AWQ scales down_proj's input channels and folds 1/s into up_proj's output rows. With up_proj kept
    float (--ignore), that shrunk up_proj must be what is stored: it was written as read, unshrunk, so
    down_proj's scaled columns met unscaled inputs (a model off by s per channel)."""
    out = tmp_path / "q"
    calibrate("builtin:tiny-qwen3-trained", out, CalibrationConfig(
        method="awq", group_size=32, num_samples=8, seq_len=64, dataset="builtin:prose", ignore=(r"mlp\.up_proj",)))
    src, q = Checkpoint(resolve_model("builtin:tiny-qwen3-trained")), Checkpoint(out)
    names = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(src.dims.layers)]
    shrunk = [n for n in names if not torch.equal(q.get(n), src.get(n))]
    assert shrunk, "AWQ scaled no up_proj → down_proj group: the test shows nothing"
    for n in shrunk:  # the row scales are AWQ's 1/s: positive, one per output row
        ratio = (src.get(n, torch.float32) / q.get(n, torch.float32)).nanmedian(dim=1).values
        assert (ratio > 0).all() and not torch.allclose(ratio, torch.ones_like(ratio))
    ids = torch.tensor([list(range(5, 69))])
    import transformers

    load = transformers.AutoModelForCausalLM.from_pretrained
    with torch.no_grad():
        ref = load(src.root, dtype=torch.float32)(ids).logits.log_softmax(-1)
        got = load(out, dtype=torch.float32)(ids).logits.log_softmax(-1)
    kl = float((ref.exp() * (ref - got)).sum(-1).mean())
    # int4 noise only: 3.8e-4 here; the unshrunk up_proj written before the fix gave 2.2e-2
    assert kl < 5e-3, kl
