"""npu::NPURotaryPositionEmbedding: the NumPy reference against independent formulas (and transformers'
own apply_rotary_pos_emb), its ONNX decomposition in ONNX Runtime against the reference, the
`fuse_rope_ascend` pass on hand-built rotary regions, and whole tiny models converted for Ascend."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from unit_state import add, constant, context, value

from qwen2om.kernels.ascend import decompose
from qwen2om.kernels.npu_rope import ROPE, rotary_position_embedding
from qwen2om.npu_kernels import NPU_DOMAIN
from qwen2om.passes.fuse_rope_ascend import FuseRopeAscend
from qwen2om.state import ConvertState

RNG = np.random.default_rng(7)
THETA = 1e6
SMALL = ["max_seq_len=256", "prefill_chunk=32"]


def angles(positions: np.ndarray, r: int) -> np.ndarray:
    """θ [..., r/2]: position · inv_freq, as Qwen's rotary embedding computes it."""
    return positions[..., None].astype(np.float64) / THETA ** (np.arange(0, r, 2, dtype=np.float64) / r)


def tables(positions: np.ndarray, r: int) -> tuple[np.ndarray, np.ndarray]:
    """HF's cos/sin [..., r]: each frequency twice (rotate_half's layout), float32."""
    ang = np.concatenate([angles(positions, r)] * 2, axis=-1)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


# -- the NumPy reference ------------------------------------------------------------------------------
def test_reference_is_a_complex_rotation_of_the_two_halves() -> None:
    """With HF's tables, (x_low + i·x_high) · e^{iθ} is the rotation; with any tables, the index formula."""
    b, t, n, d = 2, 5, 3, 16
    x = RNG.standard_normal((b, t, n, d)).astype(np.float32)
    positions = np.arange(b * t).reshape(b, t) * 37
    cos, sin = tables(positions, d)
    z = (x[..., : d // 2] + 1j * x[..., d // 2:]) * np.exp(1j * angles(positions, d))[:, :, None]
    got = rotary_position_embedding(x, cos[:, :, None], sin[:, :, None])
    np.testing.assert_allclose(got, np.concatenate([z.real, z.imag], axis=-1), atol=1e-5)

    c, s = RNG.standard_normal((2, 1, 1, 8)).astype(np.float32), RNG.standard_normal((2, 1, 1, 8)).astype(np.float32)
    x = RNG.standard_normal((2, 3, 4, 8)).astype(np.float32)
    want = np.empty_like(x)
    for i in range(4):  # y_i = x_i c_i − x_{i+4} s_i,  y_{i+4} = x_{i+4} c_{i+4} + x_i s_{i+4}
        want[..., i] = x[..., i] * c[..., i] - x[..., i + 4] * s[..., i]
        want[..., i + 4] = x[..., i + 4] * c[..., i + 4] + x[..., i] * s[..., i + 4]
    np.testing.assert_allclose(rotary_position_embedding(x, c, s), want, atol=1e-6)


def test_reference_matches_transformers_apply_rotary_pos_emb() -> None:
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    b, t, heads, kv, d = 1, 7, 8, 2, 32
    q = RNG.standard_normal((b, t, heads, d)).astype(np.float32)
    k = RNG.standard_normal((b, t, kv, d)).astype(np.float32)
    cos, sin = tables(np.arange(3, 3 + t)[None], d)  # [B, T, D]
    # transformers: [B, heads, T, D] with cos [B, T, D] unsqueezed at 1; the kernel: BSND with [B, T, 1, D]
    hq, hk = apply_rotary_pos_emb(*(torch.from_numpy(a.transpose(0, 2, 1, 3)) for a in (q, k)),
                                  torch.from_numpy(cos), torch.from_numpy(sin))
    for x, want in ((q, hq), (k, hk)):
        got = rotary_position_embedding(x, cos[:, :, None], sin[:, :, None])
        np.testing.assert_allclose(got, want.numpy().transpose(0, 2, 1, 3), atol=1e-6)


def test_reference_rounds_once_and_refuses_what_it_does_not_model() -> None:
    x = RNG.standard_normal((1, 2, 2, 8)).astype(np.float16)
    cos, sin = (RNG.standard_normal((1, 2, 1, 8)).astype(np.float16) for _ in range(2))
    got = rotary_position_embedding(x, cos, sin)
    xf, cf, sf = (a.astype(np.float32) for a in (x, cos, sin))
    rotated = np.concatenate([-xf[..., 4:], xf[..., :4]], axis=-1)
    assert got.dtype == np.float16 and np.array_equal(got, (xf * cf + rotated * sf).astype(np.float16))
    with pytest.raises(NotImplementedError, match="mode 1"):
        rotary_position_embedding(x, cos, sin, mode=1)
    with pytest.raises(ValueError, match="even"):
        rotary_position_embedding(x[..., :7], cos[..., :7], sin[..., :7])


# -- the decomposition ------------------------------------------------------------------------------------
def rope_model(x_shape: list[int], table_shape: list[int], elem: int, rotary: int | None = None) -> onnx.ModelProto:
    """x → NPURotaryPositionEmbedding → y; with `rotary` = R < D, as the pass leaves Qwen3.5's partial
    rotary: Slice x[..., :R], the op with width-R tables, Concat x[..., R:] back."""
    d = x_shape[-1]
    r = rotary or d
    inits = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in
             (("zero", [0]), ("r", [r]), ("end", [d]), ("last", [-1]))]
    nodes = []
    x = "x"
    if rotary:
        nodes.append(helper.make_node("Slice", ["x", "zero", "r", "last"], ["x_rot"], name="slice_rot"))
        nodes.append(helper.make_node("Slice", ["x", "r", "end", "last"], ["x_pass"], name="slice_pass"))
        x = "x_rot"
    nodes.append(helper.make_node(ROPE, [x, "cos", "sin"], ["y_rot" if rotary else "y"], domain=NPU_DOMAIN,
                                  mode=0, name="/model/layers.0/self_attn/rotary/NPURotaryPositionEmbedding"))
    if rotary:
        nodes.append(helper.make_node("Concat", ["y_rot", "x_pass"], ["y"], axis=-1, name="concat"))
    graph = helper.make_graph(nodes, "rope", [helper.make_tensor_value_info("x", elem, x_shape),
                                              helper.make_tensor_value_info("cos", elem, table_shape),
                                              helper.make_tensor_value_info("sin", elem, table_shape)],
                              [helper.make_tensor_value_info("y", elem, x_shape)], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(NPU_DOMAIN, 1)],
                             ir_version=8)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize(("x_shape", "rotary"), [
    ([1, 1, 8, 64], None),   # decode q, 8 heads
    ([1, 6, 2, 64], None),   # prefill k, GQA's 2 KV heads
    ([2, 5, 4, 32], 8),      # partial rotary (Qwen3.5: R = D/4)
])
@pytest.mark.numerics
def test_decomposition_matches_reference(dtype: type, x_shape: list[int], rotary: int | None) -> None:
    b, t, _, d = x_shape
    r = rotary or d
    elem = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    model = rope_model(x_shape, [b, t, 1, r], elem, rotary)
    assert decompose(model) == 1
    assert all(n.domain == "" for n in model.graph.node) and NPU_DOMAIN not in {o.domain for o in model.opset_import}
    onnx.checker.check_model(model, full_check=True)
    x = (RNG.standard_normal(x_shape) * 4).astype(dtype)
    cos, sin = (a[:, :, None].astype(dtype) for a in tables(RNG.integers(0, 4096, (b, t)), r))
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "cos": cos, "sin": sin})[0]
    want = np.concatenate([rotary_position_embedding(x[..., :r], cos, sin), x[..., r:]], axis=-1)
    assert got.dtype == dtype and got.shape == tuple(x_shape)
    # the same float32 products and sum, rounded once: equal up to the last bit of x's dtype
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-3 if dtype == np.float16
                               else 1e-6, atol=1e-6)


# -- the pass on hand-built regions -------------------------------------------------------------------------
def exported_rotary(dtype: ir.DataType, *, d: int = 16, rotary: int | None = None, t: int = 3,
                    swap: bool = False) -> ir.Model:
    """One layer's `self_attn.rotary` as the exporter writes it: q [1, T, 4, D] and k [1, T, 2, D] (BSND),
    cos/sin gathered by position_ids, cast to x's dtype and transposed to [1, T, 1, R] in layer 0's scope;
    with `rotary` = R < D the exporter's own Slice/Concat around it; `swap`: rotate_half's halves in the
    wrong order (not RoPE)."""
    r = rotary or d
    scope = "/model/layers.0/self_attn/rotary"
    q, k, pos = value("q", [1, t, 4, d], dtype), value("k", [1, t, 2, d], dtype), \
        value("position_ids", [1, t], ir.DataType.INT64)
    graph = ir.Graph([q, k, pos], [], nodes=[], name="rope", opset_imports={"": 18})
    cos_t, sin_t = tables(np.arange(64), r)

    def i64(name: str, v: list[int]) -> ir.Value:
        return constant(graph, name, np.array(v, np.int64))

    tabs = []
    for name, table in (("cos", cos_t), ("sin", sin_t)):
        v = add(graph, "Gather", [constant(graph, f"rope_{name}", table), pos], f"/Gather_{name}",
                shape=[1, t, r])
        v = add(graph, "Cast", [v], f"/Cast_{name}", attrs=[ir.AttrInt64("to", dtype)], shape=[1, t, r], dtype=dtype)
        v = add(graph, "Unsqueeze", [v, i64("one", [1])], f"/Unsqueeze_{name}", shape=[1, 1, t, r], dtype=dtype)
        tabs.append(add(graph, "Transpose", [v], f"{scope}/Transpose_{name}",
                        attrs=[ir.AttrInt64s("perm", [0, 2, 1, 3])], shape=[1, t, 1, r], dtype=dtype))
    cos, sin = tabs

    def op(kind: str, inputs: list[ir.Value], name: str, like: ir.Value, width: int, **attrs: int) -> ir.Value:
        """A node of the region; its output is `like`'s [1, T, heads] with last dim `width`."""
        return add(graph, kind, inputs, f"{scope}/{name}", attrs=[ir.AttrInt64(a, v) for a, v in attrs.items()],
                   shape=[*list(like.shape)[:3], width], dtype=dtype)  # type: ignore[arg-type]

    def slice_(v: ir.Value, lo: int, hi: int, name: str, width: int) -> ir.Value:
        bounds = [i64(f"s{lo}", [lo]), i64(f"e{hi}", [hi]), i64("last", [-1]), i64("step", [1])]
        return op("Slice", [v, *bounds], f"Slice_{name}", v, width)

    outs = []
    for x in (q, k):
        n = x.name
        xr = slice_(x, 0, r, f"{n}_rot", r) if rotary else x
        lo, hi = slice_(xr, 0, r // 2, f"{n}_lo", r // 2), slice_(xr, r // 2, 2**62, f"{n}_hi", r // 2)
        neg = op("Neg", [hi], f"Neg_{n}", x, r // 2)
        cat = op("Concat", [lo, neg] if swap else [neg, lo], f"Concat_{n}", x, r, axis=-1)
        y = op("Add", [op("Mul", [xr, cos], f"Mul_{n}_cos", x, r), op("Mul", [cat, sin], f"Mul_{n}_sin", x, r)],
               f"Add_{n}", x, r)
        if rotary:
            y = op("Concat", [y, slice_(x, r, d, f"{n}_pass", d - r)], f"Concat_{n}_pass", x, d, axis=-1)
        outs.append(add(graph, "Identity", [y], f"/model/layers.0/self_attn/Identity_{n}", out=f"{n}_rotated",
                        shape=x.shape, dtype=dtype))
    graph.outputs.extend(outs)
    return ir.Model(graph, ir_version=8)


def run_npu(model: ir.Model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    proto = ir.serde.serialize_model(model)
    decompose(proto)
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def fuse(model: ir.Model, tmp_path: Path, soc: str = "Ascend910B3") -> tuple[object, list[str]]:
    logs: list[str] = []
    ctx = dataclasses.replace(context(tmp_path, soc_version=soc), log=logs.append)
    state = ConvertState(graphs={"decode": model}, facts={"graphs_legal"})
    assert set(FuseRopeAscend.requires) <= state.filled()
    return FuseRopeAscend()(state, ctx), logs


def rope_nodes(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if n.op_type == ROPE]


@pytest.mark.numerics
@pytest.mark.parametrize(("dtype", "rotary"), [(ir.DataType.FLOAT16, None), (ir.DataType.FLOAT, None),
                                               (ir.DataType.FLOAT16, 8)])
def test_pass_fuses_q_and_k_and_keeps_the_numbers(tmp_path: Path, dtype: ir.DataType, rotary: int | None) -> None:
    np_dtype = dtype.numpy()
    feeds = {"q": RNG.standard_normal((1, 3, 4, 16)).astype(np_dtype),
             "k": RNG.standard_normal((1, 3, 2, 16)).astype(np_dtype),
             "position_ids": np.array([[5, 6, 7]], np.int64)}
    before = run_npu(exported_rotary(dtype, rotary=rotary), feeds)
    model = exported_rotary(dtype, rotary=rotary)
    result, logs = fuse(model, tmp_path)

    assert result.modified and result.stats == {"decode_fused_rope": 1, "decode_kept_rope": 0}  # type: ignore[attr-defined]
    assert not logs and model.opset_imports[NPU_DOMAIN] == 1
    nodes = rope_nodes(model)
    assert [n.inputs[0].name for n in nodes] == (["q", "k"] if not rotary else
                                                 ["/model/layers.0/self_attn/rotary/Slice_q_rot_out",
                                                  "/model/layers.0/self_attn/rotary/Slice_k_rot_out"])
    assert all(n.domain == NPU_DOMAIN and n.attributes["mode"].type == ir.AttributeType.INT
               and n.attributes.get_int("mode") == 0 for n in nodes)
    assert [n.inputs[1].name for n in nodes] == ["/model/layers.0/self_attn/rotary/Transpose_cos_out"] * 2
    left = {n.op_type for n in model.graph if "/rotary/" in (n.name or "")}
    assert left == {"Transpose", ROPE} | ({"Slice", "Concat"} if rotary else set())
    after = run_npu(model, feeds)
    tol = 2e-3 if dtype == ir.DataType.FLOAT16 else 1e-6  # the portable form rounds each op in fp16
    for a, b in zip(before, after, strict=True):
        np.testing.assert_allclose(b.astype(np.float32), a.astype(np.float32), rtol=tol, atol=tol)

    again, logs = fuse(model, tmp_path)  # idempotent: nothing left to fuse, nothing logged
    assert not again.modified and again.stats == {"decode_fused_rope": 0, "decode_kept_rope": 0}  # type: ignore[attr-defined]
    assert not logs


@pytest.mark.parametrize(("soc", "d", "swap", "why"), [
    ("Ascend310B1", 16, False, "no NPURotaryPositionEmbedding kernel"),
    ("Ascend910B3", 1024, False, "head dim 1024 exceeds the Atlas A2 (910B) kernel's limit of 896"),
    ("Ascend910B3", 16, True, "rotate_half is not Concat"),
])
def test_pass_leaves_what_it_cannot_fuse_and_says_why(tmp_path: Path, soc: str, d: int, swap: bool, why: str) -> None:
    model = exported_rotary(ir.DataType.FLOAT16, d=d, swap=swap)
    count = len(list(model.graph))
    result, logs = fuse(model, tmp_path, soc)
    assert not result.modified and result.stats == {"decode_fused_rope": 0, "decode_kept_rope": 1}  # type: ignore[attr-defined]
    assert len(list(model.graph)) == count and not rope_nodes(model)
    assert len(logs) == 1 and why in logs[0] and "RoPE left in standard ops" in logs[0]


# -- whole tiny models ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ascend_rope(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[str]]]:
    """Each tiny model converted once for Ascend910B3 (and tiny-qwen3 for 310B1), with convert's log."""
    from qwen2om.convert import convert

    done = {}
    for name, soc in (("tiny-qwen3", "Ascend910B3"), ("tiny-qwen3-5", "Ascend910B3"),
                      ("tiny-qwen3-moe", "Ascend910B3"), ("tiny-qwen3", "Ascend310B1")):
        out = tmp_path_factory.mktemp("rope") / f"{name}-{soc}"
        logs: list[str] = []
        convert(f"builtin:{name}", out, overrides=[*SMALL, "target=ascend", f"soc_version={soc}"], log=logs.append)
        done[f"{name}-{soc}"] = (out, logs)
    return done


def graph_nodes(out: Path) -> dict[str, list[onnx.NodeProto]]:
    return {kind: list(onnx.load(out / f"model.{kind}.onnx", load_external_data=False).graph.node)
            for kind in ("decode", "prefill")}


@pytest.mark.slow
@pytest.mark.parametrize(("name", "layers", "partial"), [("tiny-qwen3", 4, False), ("tiny-qwen3-5", 1, True)])
def test_converted_for_910b_uses_the_kernel(ascend_rope, name: str, layers: int, partial: bool) -> None:
    out, _ = ascend_rope[f"{name}-Ascend910B3"]
    for kind, nodes in graph_nodes(out).items():
        rope = [n for n in nodes if n.op_type == ROPE]
        assert len(rope) == 2 * layers, kind  # q and k of every full-attention layer
        assert all(n.domain == NPU_DOMAIN and [(a.name, a.type, a.i) for a in n.attribute] ==
                   [("mode", onnx.AttributeProto.INT, 0)] for n in rope)
        region = {n.op_type for n in nodes if "/self_attn/rotary/" in n.name}
        assert not region & {"Neg", "Mul", "Add"}, kind
        assert region <= {"Transpose", ROPE, "Slice", "Concat"} and (("Slice" in region) == partial), kind
    model = onnx.load(out / "model.decode.onnx", load_external_data=False)
    assert {o.domain: o.version for o in model.opset_import}[NPU_DOMAIN] == 1


@pytest.mark.slow
def test_converted_for_310b_keeps_rope_portable_and_says_why(ascend_rope) -> None:
    out, logs = ascend_rope["tiny-qwen3-Ascend310B1"]
    for kind, nodes in graph_nodes(out).items():
        assert not [n for n in nodes if n.op_type == ROPE], kind
        assert [n for n in nodes if "/self_attn/rotary/" in n.name and n.op_type == "Neg"], kind
    said = [m for m in logs if "RoPE left in standard ops" in m]
    assert len(said) == 1 and "310B" in said[0] and "no NPURotaryPositionEmbedding kernel" in said[0]


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3-5", "tiny-qwen3-moe"])
def test_verify_passes_through_the_decomposition(ascend_rope, name: str) -> None:
    from qwen2om.verify import verify

    out, _ = ascend_rope[f"{name}-Ascend910B3"]
    assert any(n.op_type == ROPE for n in graph_nodes(out)["decode"])
    report = verify(out, f"builtin:{name}", tokens=16)
    assert report.passed and report.agreement == 1.0, report
