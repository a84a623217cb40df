"""`qwen2om plan` and planner.stage_costs: bytes per device from config.json and the safetensors headers,
checked against bytes counted by hand from the tiny builtins' shapes."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from qwen2om.convert import choose_recipe, read_config
from qwen2om.errors import RecipeError
from qwen2om.planner import StageCosts, plan, stage_costs
from qwen2om.recipe import Recipe

SMALL = {"max_seq_len": 256, "prefill_chunk": 32}
W4A16 = Path(__file__).resolve().parents[1] / "fixtures" / "data" / "llmcompressor-tiny-qwen3-w4a16"


def resolved(path: Path, **settings: object) -> tuple[object, Recipe]:
    cfg = read_config(path)
    return cfg, choose_recipe(cfg, None, {**SMALL, **settings})


def attention_params(h: int, heads: int, kv: int, hd: int, *, gate: bool = False) -> int:
    """q, k, v, o of one full-attention layer, + q_norm and k_norm."""
    q = heads * hd * (2 if gate else 1)
    return q * h + 2 * kv * hd * h + h * heads * hd + 2 * hd


# tiny-qwen3: hidden 64, 4 layers, 4 heads, 2 KV heads, head_dim 32, intermediate 160, vocab 151,936, tied
H, HEADS, KV, HD, INTER, V, LAYERS = 64, 4, 2, 32, 160, 151936, 4
DENSE_LAYER = attention_params(H, HEADS, KV, HD) + 3 * INTER * H + 2 * H  # + input / post-attention norms
KV_CACHE = 2 * 1 * KV * 256 * HD  # K and V, batch 1, P = 256: elements


def test_dense_costs_are_the_weights_and_cache_by_hand(checkpoint) -> None:
    cfg, r = resolved(checkpoint("tiny-qwen3"))
    c = stage_costs(cfg, r)
    assert isinstance(c, StageCosts)
    assert c.layers == [(DENSE_LAYER + KV_CACHE) * 4] * LAYERS  # fp32
    # tied: the one [hidden, vocab] table is the first stage's embedding and the last stage's LM head
    assert c.first == V * H * 4
    assert c.last == V * H * 4 + H * 4  # + the final norm
    assert c.workspace > 0


def test_fp16_halves_every_float_byte(checkpoint) -> None:
    cfg, r = resolved(checkpoint("tiny-qwen3"), dtype="fp16")
    c = stage_costs(cfg, r)
    assert c.layers == [(DENSE_LAYER + KV_CACHE) * 2] * LAYERS
    assert (c.first, c.last) == (V * H * 2, (V * H + H) * 2)


def test_batch_and_capacity_scale_the_cache_only(checkpoint) -> None:
    cfg, r = resolved(checkpoint("tiny-qwen3"), batch_size=3, max_seq_len=512)
    c = stage_costs(cfg, r)
    assert c.layers == [(DENSE_LAYER + 2 * 3 * KV * 512 * HD) * 4] * LAYERS


def test_moe_counts_every_expert_and_the_router(checkpoint) -> None:
    cfg, r = resolved(checkpoint("tiny-qwen3-moe"))
    d = cfg.dims
    assert (d.experts, d.moe_intermediate, d.sparse) == (8, 32, (0, 1, 2, 3))
    moe = d.experts * 3 * d.moe_intermediate * H + d.experts * H  # experts + router [E, hidden]
    layer = attention_params(H, HEADS, KV, HD) + moe + 2 * H
    assert stage_costs(cfg, r).layers == [(layer + KV_CACHE) * 4] * LAYERS


def test_hybrid_layers_hold_state_or_kv_by_kind(checkpoint) -> None:
    cfg, r = resolved(checkpoint("tiny-qwen3-5"))
    d = cfg.dims
    assert d.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    hk, hv, dk, dv, k = d.lin_k_heads, d.lin_v_heads, d.lin_k_dim, d.lin_v_dim, d.conv_kernel
    conv = 2 * hk * dk + hv * dv
    linear = (conv * H + hv * dv * H + 2 * hv * H  # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
              + conv * k + 2 * hv + dv + H * hv * dv)  # conv1d, A_log + dt_bias, norm, out_proj
    state = 1 * (k - 1) * conv * 4 + 1 * hv * dk * dv * 4  # conv state (fp32 compute) + recurrent state (fp32)
    full = attention_params(H, HEADS, KV, HD, gate=True)
    mlp = 3 * INTER * H + 2 * H
    c = stage_costs(cfg, r)
    assert c.layers == [(linear + mlp) * 4 + state] * 3 + [(full + mlp + KV_CACHE) * 4]
    assert c.first == d.vocab * H * 4 and c.last == (d.vocab * H + H) * 4


def test_hybrid_conv_state_follows_the_compute_dtype_and_recurrent_stays_fp32(checkpoint) -> None:
    cfg, r32 = resolved(checkpoint("tiny-qwen3-5"))
    _, r16 = resolved(checkpoint("tiny-qwen3-5"), dtype="fp16")
    d = cfg.dims
    from qwen2om.planner import cache_bytes

    conv = 2 * d.lin_k_heads * d.lin_k_dim + d.lin_v_heads * d.lin_v_dim
    rec = d.lin_v_heads * d.lin_k_dim * d.lin_v_dim * 4
    assert cache_bytes(d, r32, 0) == 3 * conv * 4 + rec
    assert cache_bytes(d, r16, 0) == 3 * conv * 2 + rec


def test_a_config_alone_counts_the_float_table(tmp_path, checkpoint) -> None:
    """stage_costs without a checkpoint to open: the tensor table config.json implies, in the compute dtype."""
    shutil.copyfile(checkpoint("tiny-qwen3") / "config.json", tmp_path / "config.json")
    cfg, r = resolved(tmp_path)
    assert stage_costs(cfg, r) == stage_costs(*resolved(checkpoint("tiny-qwen3")))


# -- quantised checkpoints: bytes as the target's lowering stores them --------------------------------
# [N, K] of q, k, v, o, gate, up, down
LINEARS = [(HEADS * HD, H), (KV * HD, H), (KV * HD, H), (H, HEADS * HD), (INTER, H), (INTER, H), (H, INTER)]
FLOAT_IN_LAYER = 2 * H + 2 * HD  # norms, q_norm, k_norm


@pytest.fixture(scope="module")
def w4a16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llm-compressor's W4A16 tiny-qwen3 (symmetric, group 32, lm_head float), with a zero embedding in place of
    the one the repository leaves out: the plan reads its headers only."""
    import torch
    from safetensors.torch import save_file

    out = tmp_path_factory.mktemp("w4a16") / "ckpt"
    out.mkdir()
    for name in ("config.json", "layers.safetensors"):
        shutil.copyfile(W4A16 / name, out / name)
    save_file({"model.embed_tokens.weight": torch.zeros(V, H, dtype=torch.bfloat16)}, str(out / "embed.safetensors"))
    return out


def test_w4a16_on_ort_is_matmulnbits_bytes(w4a16) -> None:
    cfg, r = resolved(w4a16)  # fp32: MatMulNBits' scales in fp32
    g = 32
    layer = sum(n * k // 2 + n * (k // g) * 4 for n, k in LINEARS) + FLOAT_IN_LAYER * 4
    c = stage_costs(cfg, r)
    assert c.layers == [layer + KV_CACHE * 4] * LAYERS
    assert c.first == V * H * 4  # the embedding stays float


def test_w4a16_on_910b_is_weightquantbatchmatmul_bytes(w4a16) -> None:
    cfg, r = resolved(w4a16, target="ascend", soc_version="Ascend910B3")  # fp16
    g = 32
    layer = sum(k * math.ceil(n / 8) * 4 + n * (k // g) * 2 for n, k in LINEARS) + FLOAT_IN_LAYER * 2
    assert stage_costs(cfg, r).layers == [layer + KV_CACHE * 2] * LAYERS
    stage = plan(cfg, r, devices=1).stages[0]
    assert stage.weights["int32"] == LAYERS * sum(k * math.ceil(n / 8) * 4 for n, k in LINEARS)


def test_w4a16_on_310p_is_counted_as_w8a16_and_says_so(w4a16) -> None:
    cfg, r = resolved(w4a16, target="ascend", soc_version="Ascend310P3")
    g = 32
    layer = sum(k * n + n * (k // g) * 2 for n, k in LINEARS) + FLOAT_IN_LAYER * 2
    assert stage_costs(cfg, r).layers == [layer + KV_CACHE * 2] * LAYERS
    assert any("W8A16" in n and "weight_storage=int8" in n for n in plan(cfg, r, devices=1).notes)


def test_fp8_is_e4m3_bytes_and_float32_block_scales(checkpoint) -> None:
    cfg, r = resolved(checkpoint("tiny-qwen3-fp8"))  # ort, fp32: lower_fp8 keeps float8e4m3fn
    tiles = [math.ceil(n / 128) * math.ceil(k / 128) for n, k in LINEARS]
    layer = sum(n * k for n, k in LINEARS) + 4 * sum(tiles) + FLOAT_IN_LAYER * 4
    assert stage_costs(cfg, r).layers == [layer + KV_CACHE * 4] * LAYERS
    weights = plan(cfg, r, devices=1).stages[0].weights
    assert weights["float8_e4m3fn"] == LAYERS * sum(n * k for n, k in LINEARS)
    _, ra = resolved(checkpoint("tiny-qwen3-fp8"), target="ascend", soc_version="Ascend910B3")
    assert plan(cfg, ra, devices=1).stages[0].weights["uint8"] == LAYERS * sum(n * k for n, k in LINEARS)  # bytes


def test_fp8_moe_experts_are_dequantised_on_ascend_and_it_is_said(checkpoint) -> None:
    cfg, r = resolved(checkpoint("tiny-qwen3-moe-fp8"), target="ascend", soc_version="Ascend910B3")
    p = plan(cfg, r, devices=1)
    d = cfg.dims
    experts = LAYERS * d.experts * 3 * d.moe_intermediate * H
    assert p.stages[0].weights["uint8"] == LAYERS * sum(n * k for n, k in LINEARS[:4])  # attention only
    assert p.stages[0].weights["float16"] >= experts * 2
    assert any("experts" in n and "float16 stacks" in n for n in p.notes)


def test_scheme_w4a16_estimates_a_float_checkpoint_as_calibrated(checkpoint, w4a16) -> None:
    """--scheme w4a16 with the group llm-compressor used gives the bytes of its real W4A16 checkpoint."""
    from qwen2om.planner import model_bytes

    cfg, r = resolved(checkpoint("tiny-qwen3"))
    real_cfg, _ = resolved(w4a16)
    from qwen2om.checkpoint import Checkpoint

    estimated = model_bytes(cfg, r, Checkpoint(checkpoint("tiny-qwen3")), scheme="w4a16", group=32)
    real = model_bytes(real_cfg, r, Checkpoint(w4a16))
    assert estimated.layer_weights == real.layer_weights
    assert any("as if calibrated" in n for n in estimated.notes)


def test_scheme_refusals(checkpoint, w4a16) -> None:
    from qwen2om.checkpoint import Checkpoint
    from qwen2om.errors import Qwen2omError
    from qwen2om.planner import model_bytes

    cfg, r = resolved(checkpoint("tiny-qwen3"))
    with pytest.raises(Qwen2omError, match="not a multiple of --group-size 128 .*plan with --group-size 32"):
        model_bytes(cfg, r, Checkpoint(checkpoint("tiny-qwen3")), scheme="w4a16")
    with pytest.raises(RecipeError, match="not one of w4a16, fp8-block"):
        model_bytes(cfg, r, Checkpoint(checkpoint("tiny-qwen3")), scheme="int3")
    wcfg, _ = resolved(w4a16)
    with pytest.raises(RecipeError, match="already quantised"):
        model_bytes(wcfg, r, Checkpoint(w4a16), scheme="w4a16", group=32)


# -- the split and the device -----------------------------------------------------------------------------
def test_devices_split_uses_stages_split_layers(checkpoint) -> None:
    from qwen2om.stages import split_layers

    cfg, r = resolved(checkpoint("tiny-qwen3"))
    c = stage_costs(cfg, r)
    p = plan(cfg, r, devices=3, device_memory=1)
    assert [(s.start, s.stop) for s in p.stages] == split_layers(c.layers, 3, first=c.first, last=c.last)
    assert [(s.start, s.stop) for s in p.stages] == [(0, 1), (1, 3), (3, 4)]  # embedding and head at the ends
    assert p.stages[0].total == c.first + c.layers[0] + c.workspace
    assert p.stages[2].total == c.last + c.layers[3] + c.workspace
    assert sum(s.kv_cache for s in p.stages) == LAYERS * KV_CACHE * 4
    assert p.fits


def test_without_devices_the_fewest_stages_that_fit(checkpoint) -> None:
    cfg, r = resolved(checkpoint("tiny-qwen3"))
    c = stage_costs(cfg, r)
    roomy = plan(cfg, r, device_memory=1)
    # one stage holds the tied table once: the embedding's Gather and the LM head's MatMul read the same initializer
    assert len(roomy.stages) == 1 and roomy.stages[0].total == sum(c.layers) + c.last + c.workspace
    assert plan(cfg, r, devices=1, device_memory=1).stages[0].total == roomy.stages[0].total
    # room for the embedding (or the head) and one or two layers, not for both tables: two stages
    gib = (c.first + 2 * c.layers[0] + c.workspace + 1000) / 2**30
    assert [(s.start, s.stop) for s in plan(cfg, r, device_memory=gib).stages] == [(0, 2), (2, 4)]


def test_soc_memory_is_data_with_sources() -> None:
    from qwen2om.planner import soc_memory, soc_table

    assert soc_memory("Ascend910B3").memory == 64 * 2**30
    assert soc_memory("Ascend910B4").memory == 32 * 2**30
    assert soc_memory("Ascend910_9392").memory == 64 * 2**30
    assert soc_memory("Ascend310P3").memory == 24 * 2**30
    assert soc_memory("Ascend310B1").memory == 8 * 2**30
    assert all(e["source"] and e["product"] for e in soc_table())


def test_target_ort_without_device_memory_is_this_machine(checkpoint) -> None:
    cfg, r = resolved(checkpoint("tiny-qwen3"))
    p = plan(cfg, r)
    assert p.device.name == "this machine" and any("this machine's RAM" in n for n in p.notes)


def test_devices_more_than_layers_is_refused(checkpoint) -> None:
    cfg, r = resolved(checkpoint("tiny-qwen3"))
    with pytest.raises(RecipeError, match="--devices 5 is more than the model's 4 decoder layers"):
        plan(cfg, r, devices=5, device_memory=1)


def test_cannot_fit_n_devices_names_the_stage_and_its_bytes(checkpoint) -> None:
    cfg, r = resolved(checkpoint("tiny-qwen3"))
    c = stage_costs(cfg, r)
    gib = (c.first + c.layers[0] + c.workspace + 1000) / 2**30  # room for the embedding stage, not for more
    with pytest.raises(RecipeError) as e:
        plan(cfg, r, devices=2, device_memory=gib)
    need = c.first + 2 * c.layers[0] + c.workspace
    assert f"stage 0 of 2 (layers 0–1) needs {need / 2**30:.2f} GiB ({need:,} bytes" in str(e.value)
    assert "cannot fit 2 devices" in str(e.value) and "the fewest that fit are 3" in str(e.value)


def test_no_split_fits_names_the_stage(checkpoint) -> None:
    cfg, r = resolved(checkpoint("tiny-qwen3"))
    with pytest.raises(RecipeError, match=r"the first stage \(layer 0 with the embedding\) needs .* GiB but one "
                                          r"device .* has .* it cannot fit however the layers are split"):
        plan(cfg, r, device_memory=0.03)


# -- the command ------------------------------------------------------------------------------------------
def test_cli_prints_the_table(cli) -> None:
    code, out, err = cli("plan", "builtin:tiny-qwen3-5", "--devices", "2", "--device-memory", "1", "--max-seq-len",
                         "256")
    assert code == 0, err
    assert "2 stage(s)" in out and "KV" in out and "workspace per stage" in out
    assert "device: 1.00 GiB (--device-memory)" in out


def test_cli_json_shape(cli, checkpoint) -> None:
    code, out, err = cli("plan", "builtin:tiny-qwen3", "--soc-version", "Ascend910B3", "--max-seq-len", "256",
                         "--devices", "2", "--json")
    assert code == 0, err
    p = json.loads(out)
    assert set(p) == {"model", "architecture", "scheme", "settings", "device", "workspace", "costs", "stages",
                      "total", "fits", "notes"}
    assert p["settings"] == {"target": "ascend", "soc_version": "Ascend910B3", "dtype": "fp16", "max_seq_len": 256,
                             "prefill_chunk": 128, "batch_size": 1, "logits": "last"}
    assert p["device"]["memory"] == 64 * 2**30 and "Atlas 800I A2" in p["device"]["source"]
    assert [s["layers"] for s in p["stages"]] == [[0, 2], [2, 4]]
    st = p["stages"][0]
    assert set(st) == {"index", "layers", "weights", "weight_bytes", "kv_cache", "linear_state", "workspace", "total"}
    assert st["total"] == st["weight_bytes"] + st["kv_cache"] + st["linear_state"] + st["workspace"]
    assert st["kv_cache"] == 2 * KV_CACHE * 2  # two layers, fp16
    assert sum(p["workspace"]["parts"].values()) == p["workspace"]["per_stage"] == st["workspace"]
    assert p["fits"] is True and p["costs"]["first"] == V * H * 2


def test_cli_cannot_fit_is_one_line_and_exit_2(cli) -> None:
    code, out, err = cli("plan", "builtin:tiny-qwen3", "--devices", "2", "--device-memory", "0.04")
    assert code == 2 and out == ""
    assert err.startswith("error: stage 0 of 2 (layers 0–1) needs") and "Traceback" not in err


def test_cli_refuses_devices_beyond_layers(cli) -> None:
    code, _, err = cli("plan", "builtin:tiny-qwen3", "--devices", "9", "--device-memory", "1")
    assert code == 2 and "--devices 9 is more than the model's 4 decoder layers" in err


def test_cli_scheme_on_w4a16_checkpoint_refused(cli, w4a16) -> None:
    code, _, err = cli("plan", str(w4a16), "--scheme", "w4a16", "--device-memory", "1")
    assert code == 2 and "already quantised" in err


# -- against what a conversion writes ---------------------------------------------------------------------
@pytest.mark.parametrize(("name", "extra"), [
    ("tiny-qwen3", ("fp32",)),
    ("tiny-qwen3-moe", ("fp32",)),
    ("tiny-qwen3-5", ("fp32",)),
    ("tiny-qwen3-fp8", ("fp16", "target=ascend", "soc_version=Ascend910B3", "compile=dry-run")),
])
def test_plan_weights_are_the_converted_graphs_initializers(converted, checkpoint, name, extra) -> None:
    """The one-stage plan's weights by dtype are the initializers the conversion wrote (each graph holds them
    all; decode and prefill share one data file), less the RoPE tables (counted in the workspace) and a few
    dozen bytes of shape constants, plus the FP8 scales, which are graph inputs (scale_map.json)."""
    from qwen2om.inspect import inspect

    out = converted(name, *extra)
    decode = inspect(str(out), False).graphs["decode"].initializers
    settings = dict(e.split("=") for e in extra[1:] if not e.startswith("compile"))
    cfg, r = resolved(checkpoint(name), dtype=extra[0], **settings)
    p = plan(cfg, r, devices=1, device_memory=1)
    planned = p.stages[0].weights
    compute = {"fp32": "float32", "fp16": "float16"}[extra[0]]
    rope = p.workspace["rope"]
    graph = {("float8_e4m3fn" if dt == "float8e4m3fn" else dt): v.bytes for dt, v in decode.items()}
    expected = dict(planned)
    if compute == "float16":  # the only float32 weights of an fp16 plan are FP8 scales: inputs, not initializers
        expected["float32"] = 0
    expected["float32"] = expected.get("float32", 0) + rope
    table = 256 * 4 if "target=ascend" in extra and name.endswith("fp8") else 0  # the e4m3 decode table
    for dt in ("float32", "float16"):
        assert 0 <= graph.get(dt, 0) - expected.get(dt, 0) < 64 + (table if dt == "float32" else 0), dt
    for dt in ("uint8", "float8_e4m3fn", "int32", "int8"):
        assert graph.get(dt, 0) == planned.get(dt, 0), dt


def test_scheme_on_a_hybrid_moe_counts_experts_as_the_ascend_recipe_stores_them(checkpoint) -> None:
    """--scheme w4a16 on 910B: linears int4 (WeightQuantBatchMatmulV2), routed experts dequantised into fp16
    stacks (said in a note); the what-if storage that keeps experts int4 moves their bytes to int32."""
    import dataclasses

    from qwen2om.planner import Storage, model_bytes

    cfg, r = resolved(checkpoint("tiny-qwen3-5-moe"), target="ascend", soc_version="Ascend910B3")
    today = model_bytes(cfg, r, scheme="w4a16", group=16)
    assert today.layer_weights[0]["int32"] > 0 and any("lower_int4_ascend lowers linears" in n for n in today.notes)
    what_if = model_bytes(cfg, r, scheme="w4a16", group=16,
                          storage=dataclasses.replace(Storage.of(r), int4_experts="target"))
    d = cfg.dims
    experts = d.experts * 3 * d.moe_intermediate * d.hidden  # parameters of one layer's routed experts
    # fp16 weights out, fp16 scales (one per 16 values) in
    assert today.layer_weights[0]["float16"] - what_if.layer_weights[0]["float16"] == experts * 2 - experts // 16 * 2
    assert what_if.layer_weights[0]["int32"] - today.layer_weights[0]["int32"] == experts // 2  # 4 bits each
