"""fuse_attention and fuse_norm: each layer's cache attention becomes one
com.microsoft::GroupQueryAttention that reads only the filled cache slots, its RoPE two
com.microsoft::RotaryEmbedding, each residual Add + RMSNorm one SkipSimplifiedLayerNormalization,
and the graph computes exactly what the portable form computes (the bundled ORT recipes fuse; end-to-end parity
with transformers is test_parity's, and the hybrids' test_hybrid's)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import SMALL
from test_moe import recipe_with

from qwen2om.convert import convert

CASES = [("tiny-qwen3", 1), ("tiny-qwen3", 2), ("tiny-qwen2", 1)]


@pytest.fixture(scope="module")
def outs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int, bool], Path]:
    """Each (model, batch) with the bundled recipe (fused) and without `fuse_attention` and `fuse_norm` (portable)."""
    found = {}
    for name, batch in CASES:
        tmp = tmp_path_factory.mktemp(f"{name}-b{batch}")
        overrides = [*SMALL, f"batch_size={batch}"]
        found[name, batch, True] = tmp / "fused"
        convert(f"builtin:{name}", found[name, batch, True], overrides=overrides)
        found[name, batch, False] = tmp / "portable"
        convert(f"builtin:{name}", found[name, batch, False], overrides=overrides,
                recipe=recipe_with(tmp, "portable", {"fuse_attention": None, "fuse_norm": None}))
    return found


def graph(out: Path, kind: str) -> onnx.GraphProto:
    return onnx.load(out / f"model.{kind}.onnx", load_external_data=False).graph


@pytest.mark.parametrize(("name", "batch"), CASES)
def test_one_kernel_per_layer_and_no_attention_matmuls_left(outs, name: str, batch: int) -> None:
    for kind in ("decode", "prefill"):
        g = graph(outs[name, batch, True], kind)
        layers = sum(i.name.startswith("past_key.") for i in g.input)
        rotary = [n for n in g.node if "/self_attn/rotary/" in n.name]
        assert sum(n.op_type == "RotaryEmbedding" and n.domain == "com.microsoft" for n in rotary) == 2 * layers
        assert {n.op_type for n in rotary} == {"RotaryEmbedding", "Reshape"}, kind
        scoped = [n for n in g.node if "/self_attn/cache_attention/" in n.name]
        kernels = sum(n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft" for n in scoped)
        if kind == "prefill" and batch > 1:
            # ONNX Runtime's kernel takes a multi-token chunk with a cache only at batch 1.
            assert kernels == 0 and any(n.op_type == "Softmax" for n in scoped)
            continue
        assert kernels == layers, kind
        # What is left in the scope is the kernel and its operand layouts: no score MatMul, no Softmax.
        assert {n.op_type for n in scoped} <= {"GroupQueryAttention", "Transpose", "Reshape", "Slice"}, kind
        # Every residual Add + RMSNorm pair: post-attention norms, input norms after layer 0, and the
        # final norm unless the prefill graph slices the last position between them.
        skip = sum(n.op_type == "SkipSimplifiedLayerNormalization" for n in g.node)
        assert skip == 2 * layers - (kind == "prefill"), kind
        portable = graph(outs[name, batch, False], kind)
        assert not any(n.op_type == "GroupQueryAttention" for n in portable.node)
        assert any(n.op_type == "Softmax" and "/cache_attention/" in n.name for n in portable.node)


def hard_feeds(session: ort.InferenceSession, rng: np.random.Generator, gear: int | None = None,
               ) -> dict[str, np.ndarray]:
    """Random ids and caches (garbage in every slot, so a slot read that the mask excludes shows),
    and masks the kernel must honour exactly: rows of different lengths, a hole in the cache, an
    empty cache, left padding in the chunk, and a free cache slot after the last filled one.
    A graph with prefill gears (symbolic T) is fed `gear` tokens."""
    p = next(i.shape[2] for i in session.get_inputs() if i.name.startswith("past_key"))

    def concrete(shape: list[int | str]) -> list[int]:  # "T" → gear, "T+P" → gear + P
        return [d if isinstance(d, int) else gear + (p if "+" in d else 0) for d in shape]  # type: ignore[operator]

    feeds: dict[str, np.ndarray] = {}
    for i in session.get_inputs():
        shape = concrete(i.shape)
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(0, 1000, size=shape, dtype=np.int64)
        elif i.name.startswith("past_"):
            feeds[i.name] = rng.standard_normal(shape).astype(np.float32) * 3
    b, _, t, pt = concrete(next(i.shape for i in session.get_inputs() if i.name == "attention_mask"))
    low = np.finfo(np.float32).min
    mask = np.full((b, 1, t, pt), low, dtype=np.float32)
    positions = np.zeros((b, t), dtype=np.int64)
    # row: (cached length, holes in the cache, left pads in the chunk)
    rows = ([(7, [2, 6], min(3, t - 1)), (0, [], 0)] if t > 1 else [(7, [2, 6], 0), (19, [0], 0)])[:b]
    for r, (length, holes, pad) in enumerate(rows):
        n = t - pad
        mask[r, 0, pad:, :length] = 0
        mask[r, 0, :, holes] = low
        mask[r, 0, pad:, p + pad:][np.tril(np.ones((n, n), dtype=bool))] = 0
        for i in range(pad):
            mask[r, 0, i, p + i] = 0
        positions[r, pad:] = np.arange(length, length + n)
    assert p > 19 + t  # slots past every row's length stay free (and masked)
    feeds["attention_mask"], feeds["position_ids"] = mask, positions
    return feeds


@pytest.mark.parametrize(("name", "batch"), CASES)
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_fused_graph_computes_what_the_portable_graph_computes(outs, name: str, batch: int, kind: str) -> None:
    sessions = [ort.InferenceSession(str(outs[name, batch, fused] / f"model.{kind}.onnx"),
                                     providers=["CPUExecutionProvider"]) for fused in (True, False)]
    feeds = hard_feeds(sessions[1], np.random.default_rng(0))
    got, want = (dict(zip([o.name for o in s.get_outputs()], s.run(None, feeds), strict=True)) for s in sessions)
    # A decode graph also returns the kernel's whole cache (cache_key/value.i), for the runtime to share.
    extra = {k for k in got if k.startswith("cache_")}
    assert got.keys() - extra == want.keys()
    assert extra == ({k.replace("present_", "cache_") for k in want if k.startswith("present_")} if kind == "decode"
                     else set())
    assert np.isfinite(got["logits"]).all()
    for key in want:
        assert np.abs(got[key] - want[key]).max() <= 2e-5, key


@pytest.mark.parametrize(("name", "batch"), CASES)
def test_decode_reads_the_shared_cache_in_place(outs, name: str, batch: int) -> None:
    """As the runtime runs it: each `cache_*.i` output bound to its past input's own buffer. Outputs
    equal the portable graph's on the hard masks, and the kernel wrote each row's new K/V into its
    cache at one slot only — one past the row's last visible slot — and nowhere else."""
    out = outs[name, batch, True]
    manifest = json.loads((out / "manifest.json").read_text())
    spec = manifest["graphs"]["decode"]
    roles = {io["name"]: io["role"] for io in spec["outputs"]}
    layers = manifest["dims"]["layers"]
    assert sorted(n for n, r in roles.items() if r in ("cache_key", "cache_value")) == sorted(
        f"cache_{kv}.{i}" for kv in ("key", "value") for i in range(layers))
    fused, portable = (ort.InferenceSession(str(outs[name, batch, f] / "model.decode.onnx"),
                                            providers=["CPUExecutionProvider"]) for f in (True, False))
    feeds = hard_feeds(portable, np.random.default_rng(1))
    want = dict(zip([o.name for o in portable.get_outputs()], portable.run(None, feeds), strict=True))
    buffers = {k: v.copy() for k, v in feeds.items()}
    binding, keep, got = fused.io_binding(), [], {}
    for i in fused.get_inputs():
        keep.append(ort.OrtValue.ortvalue_from_numpy(buffers[i.name]))
        binding.bind_ortvalue_input(i.name, keep[-1])
    for o in fused.get_outputs():
        target = buffers[o.name.replace("cache_", "past_")] if o.name.startswith("cache_") else got.setdefault(
            o.name, np.zeros(o.shape, np.float32))
        keep.append(ort.OrtValue.ortvalue_from_numpy(target))
        binding.bind_ortvalue_output(o.name, keep[-1])
    fused.run_with_iobinding(binding)
    for key in want:
        assert np.abs(got[key] - want[key]).max() <= 2e-5, key
    visible = feeds["attention_mask"][:, 0, 0, :-1] > np.finfo(np.float32).min / 2  # [B, P]: cache slots
    for layer in range(layers):
        for kv in ("key", "value"):
            before, after = feeds[f"past_{kv}.{layer}"], buffers[f"past_{kv}.{layer}"]
            for b in range(batch):
                slot = int(np.flatnonzero(visible[b]).max()) + 1
                changed = np.flatnonzero(np.abs(after[b] - before[b]).max(axis=(0, 2)))
                assert changed.tolist() == [slot], (layer, kv, b, changed)
                assert np.array_equal(after[b, :, slot], got[f"present_{kv}.{layer}"][b, :, 0])


@pytest.mark.slow
def test_fused_prefill_with_gears_computes_what_the_portable_graph_computes(tmp_path: Path) -> None:
    """A prefill graph exported with gears (symbolic T: the kernel's lengths come from the mask's shape at
    run time) against its portable form, at every gear, on the same hard masks."""
    overrides = [*SMALL, "gears=4,8,32"]
    convert("builtin:tiny-qwen3", tmp_path / "fused", overrides=overrides)
    convert("builtin:tiny-qwen3", tmp_path / "portable", overrides=overrides,
            recipe=recipe_with(tmp_path, "portable", {"fuse_attention": None, "fuse_norm": None}))
    assert sum(n.op_type == "GroupQueryAttention" for n in graph(tmp_path / "fused", "prefill").node) == 4
    sessions = [ort.InferenceSession(str(tmp_path / kind / "model.prefill.onnx"), providers=["CPUExecutionProvider"])
                for kind in ("fused", "portable")]
    for gear in (4, 8, 32):
        feeds = hard_feeds(sessions[1], np.random.default_rng(gear), gear)
        got, want = (dict(zip([o.name for o in s.get_outputs()], s.run(None, feeds), strict=True)) for s in sessions)
        assert got["logits"].shape[1] == 1 and got["present_key.0"].shape[2] == gear
        for key in want:
            assert np.abs(got[key] - want[key]).max() <= 2e-5, (gear, key)


def test_fuse_passes_count_each_graph_on_its_own(converted) -> None:
    """fuse_attention reported fused_layers=8 for a 4-layer model: the decode and prefill graphs summed.
    Every fuse_* pass now counts per graph."""
    manifest = json.loads((converted("tiny-qwen3", "fp32") / "manifest.json").read_text())
    stats = {s["pass"]: s["stats"] for s in manifest["stages"]}
    layers = manifest["dims"]["layers"]
    per_graph = lambda **counts: {f"{g}_{k}": n for g in ("decode", "prefill") for k, n in counts.items()}  # noqa: E731
    assert {k: v for k, v in stats["fuse_attention"].items() if "shared" not in k} == per_graph(
        fused_layers=layers, kept_layers=0, rotary_layers=layers)
    # post-attention norms and the next layer's input norms (or the final one); prefill's final norm reads
    # the last position's slice, not a residual Add
    assert stats["fuse_norm"] == {"decode_fused_norms": 2 * layers, "prefill_fused_norms": 2 * layers - 1}
    assert stats["fuse_moe"] == per_graph(fused_layers=0, kept_layers=0)  # dense: nothing to fuse
    assert stats["fuse_int4"] == per_graph(fused_groups=0, fused_nodes=0)  # float: nothing to fuse


def test_manifest_reports_the_fused_layers(outs) -> None:
    manifest = json.loads((outs["tiny-qwen3", 1, True] / "manifest.json").read_text())
    stats = next(s for s in manifest["stages"] if s["pass"] == "fuse_attention")["stats"]
    layers = manifest["dims"]["layers"]
    assert stats == {"decode_fused_layers": layers, "decode_kept_layers": 0, "decode_rotary_layers": layers,
                     "decode_shared_cache_layers": layers,  # prefill (a padded chunk) slices its past
                     "prefill_fused_layers": layers, "prefill_kept_layers": 0, "prefill_rotary_layers": layers}
    # batch 2: the kernel takes a chunk with a cache only at batch 1, so prefill keeps every layer
    manifest = json.loads((outs["tiny-qwen3", 2, True] / "manifest.json").read_text())
    stats = next(s for s in manifest["stages"] if s["pass"] == "fuse_attention")["stats"]
    assert (stats["decode_fused_layers"], stats["prefill_fused_layers"], stats["prefill_kept_layers"]) == (layers, 0,
                                                                                                           layers)
