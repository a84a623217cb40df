"""The three graph defects CANN's parser table exposed (issue 23), each fixed and checked:

1. `Shape(x, start, end)` (GE's Shape returns the whole shape) and `Reshape`'s `allowzero` (an
   attribute GE's Reshape does not declare) in every `--gears` prefill graph: legalize_ort rewrites
   both, for every target, exactly (ONNX Runtime gives the same numbers before and after);
2. 310B W8A16 through `AscendAntiQuant` (scalar attributes, no ND int8 kernel): int8 weights are
   dequantised by `Cast` + `Mul` (tests/test_ascend.py, test_310b_needs_consent_for_w8a16, and the matrix);
3. routing `TopK` (int64 k and indices; GE's TopK is int32-only): lower_topk_ascend turns it into
   k ArgMax rounds that return TopK's values and indices bit for bit, ties included.

The unit tests build small graphs and run them on ONNX Runtime before and after each rewrite; the
slow ones check whole conversions with the Ascend checker (`inspect --check ascend`'s function)
and `verify` through the reference kernels.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qwen2om.errors import Qwen2omError
from qwen2om.inspect import check_graphs
from qwen2om.passes.legalize_ort import LegalizeOrt, drop_allowzero, slice_shapes
from qwen2om.passes.lower_topk_ascend import LowerTopkAscend
from qwen2om.pipeline import RunContext
from qwen2om.recipe import load_recipe
from qwen2om.state import ConvertState

RNG = np.random.default_rng(23)
ASCEND = ("target=ascend", "soc_version=Ascend910B3")
GEARS = (*ASCEND, "gears=8,16,32")


def run(model: onnx.ModelProto | ir.Model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    proto = ir.serde.serialize_model(model) if isinstance(model, ir.Model) else model
    onnx.checker.check_model(proto, full_check=True)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)  # type: ignore[return-value]


def toy(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
        inits: dict[str, np.ndarray]) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "toy", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def shape_ops(model: ir.Model) -> list[tuple[str, dict[str, int]]]:
    return [(n.op_type, {k: a.as_int() for k, a in n.attributes.items()}) for n in model.graph
            if n.op_type in ("Shape", "Reshape")]


def context(tmp_path: Path) -> RunContext:
    return RunContext(recipe=load_recipe("qwen3-ascend-fp16"), stage_dir=tmp_path, source=tmp_path, tool_version="t")


# -- 1. Shape start/end and Reshape allowzero ---------------------------------------------------------
def gears_like() -> onnx.ModelProto:
    """What the exporter writes for a symbolic-T graph: T and P + T read from the mask by Shape(start, end)
    into the Concat that builds a Reshape target (allowzero=1), plus a static slice of the same shape."""
    nodes = [
        helper.make_node("Shape", ["mask"], ["t"], start=2, end=3),
        helper.make_node("Shape", ["mask"], ["pt"], start=-1),
        helper.make_node("Shape", ["mask"], ["lead"], end=2),  # static dims: a constant
        helper.make_node("Concat", ["lead", "t", "pt"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"], allowzero=1),
        helper.make_node("Reshape", ["y", "flat"], ["z"], allowzero=1),  # a constant target
    ]
    mask = helper.make_tensor_value_info("mask", TensorProto.FLOAT, [1, 1, "T", "T+8"])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "T+8"])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, [None])
    return toy(nodes, [mask, x], [z], {"flat": np.array([-1], np.int64)})


@pytest.mark.parametrize("t", [1, 5, 8])
def test_shape_slices_and_allowzero_are_rewritten_exactly(t: int) -> None:
    proto = gears_like()
    feeds = {"mask": np.zeros((1, 1, t, t + 8), np.float32), "x": RNG.random((t, t + 8)).astype(np.float32)}
    before = run(proto, feeds)
    model = ir.serde.deserialize_model(proto)
    assert slice_shapes(model.graph) == 3 and drop_allowzero(model.graph) == (2, 0)
    # two Shape + Gather (the symbolic dims), the static one a constant; no start/end, no allowzero left
    assert shape_ops(model) == [("Shape", {}), ("Shape", {}), ("Reshape", {}), ("Reshape", {})]
    assert [n.op_type for n in model.graph].count("Gather") == 2
    assert np.array_equal(run(model, feeds)[0], before[0])
    assert slice_shapes(model.graph) == 0 and drop_allowzero(model.graph) == (0, 0)


def test_allowzero_is_kept_where_a_zero_could_matter() -> None:
    """An input of unknown shape reshaped to a computed target: a 0 there could mean "copy" or "empty",
    so the attribute stays (and the Ascend checker names it) rather than change what the graph computes."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Reshape", ["x", "s"], ["y"], allowzero=1),
             helper.make_node("Reshape", ["x", "s"], ["w"], allowzero=0)]  # 0: the default, dropped as said
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, None)
    model = ir.serde.deserialize_model(toy(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                                                        helper.make_tensor_value_info("w", TensorProto.FLOAT, None)],
                                           {}))
    assert drop_allowzero(model.graph) == (1, 1)
    assert shape_ops(model) == [("Shape", {}), ("Reshape", {"allowzero": 1}), ("Reshape", {})]


def test_legalize_reports_the_rewrites_and_a_second_run_changes_nothing(tmp_path: Path) -> None:
    ws = ConvertState(graphs={"prefill": ir.serde.deserialize_model(gears_like())})
    first = LegalizeOrt()(ws, context(tmp_path))
    assert first.modified and first.stats["shapes_sliced"] == 3 and first.stats["allowzero_dropped"] == 2
    again = LegalizeOrt()(ws, context(tmp_path))
    assert not again.modified and again.stats["shapes_sliced"] == again.stats["allowzero_dropped"] == 0


# -- 3. routing TopK -----------------------------------------------------------------------------------
def router(k: int, axis: int, dtype: int = TensorProto.FLOAT) -> onnx.ModelProto:
    nodes = [helper.make_node("Softmax", ["logits"], ["probs"], axis=axis),
             helper.make_node("TopK", ["probs", "k"], ["values", "indices"], axis=axis, largest=1, sorted=1,
                              name="/model/layers.0/mlp/experts/TopK")]
    shape = [6, 8] if axis in (-1, 1) else [8, 6]
    out = [6, k] if axis in (-1, 1) else [k, 6]
    return toy(nodes, [helper.make_tensor_value_info("logits", dtype, shape)],
               [helper.make_tensor_value_info("values", dtype, out),
                helper.make_tensor_value_info("indices", TensorProto.INT64, out)], {"k": np.array([k], np.int64)})


@pytest.mark.parametrize(("k", "axis", "dtype"), [(1, -1, TensorProto.FLOAT), (2, -1, TensorProto.FLOAT),
                                                   (8, -1, TensorProto.FLOAT), (3, 0, TensorProto.FLOAT),
                                                   (2, -1, TensorProto.FLOAT16)])
def test_routing_topk_rounds_return_topk_bit_for_bit(tmp_path: Path, k: int, axis: int, dtype: int) -> None:
    """The same values and indices as ONNX Runtime's TopK, ties included (rows of equal logits: the
    lower index first), and only ops CANN registers without an int64 restriction."""
    proto = router(k, axis, dtype)
    np_type = np.float16 if dtype == TensorProto.FLOAT16 else np.float32
    shape = [d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim]
    logits = RNG.normal(size=shape).astype(np_type)
    tied = np.moveaxis(logits, axis, -1)
    tied[0] = 0.0  # every expert equal
    tied[1, 2:6] = 1.5  # four equal maxima
    feeds = {"logits": logits}
    want = run(proto, feeds)
    ws = ConvertState(graphs={"prefill": ir.serde.deserialize_model(proto)})
    result = LowerTopkAscend()(ws, context(tmp_path))
    model = ws.graphs["prefill"]
    assert result.modified and result.stats == {"lowered": 1}
    assert {n.op_type for n in model.graph} <= {"Softmax", "ArgMax", "GatherElements", "Equal", "Where", "Concat"}
    got = run(model, feeds)
    assert got[1].dtype == np.int64 and np.array_equal(got[1], want[1])
    assert got[0].dtype == np_type and np.array_equal(got[0], want[0])
    assert not LowerTopkAscend()(ws, context(tmp_path)).modified


def test_only_a_routers_topk_is_rewritten(tmp_path: Path) -> None:
    """Masking a picked value with −inf is TopK only when every row holds k values above −inf, which a
    Softmax's probabilities do; a TopK over anything else is refused, named."""
    proto = router(2, -1)
    proto.graph.node[0].op_type = "Relu"
    proto.graph.node[0].ClearField("attribute")
    with pytest.raises(Qwen2omError, match=r"/model/layers.0/mlp/experts/TopK: TopK reads Relu, not a Softmax"):
        LowerTopkAscend()(ConvertState(graphs={"g": ir.serde.deserialize_model(proto)}), context(tmp_path))
    smallest = router(2, -1)
    smallest.graph.node[1].attribute[1].i = 0  # largest=0
    with pytest.raises(Qwen2omError, match="largest=1"):
        LowerTopkAscend()(ConvertState(graphs={"g": ir.serde.deserialize_model(smallest)}), context(tmp_path))


# -- whole conversions -----------------------------------------------------------------------------------
def ops_of(path: Path) -> list[onnx.NodeProto]:
    return list(onnx.load(path, load_external_data=False).graph.node)


def defects(out: Path) -> dict[str, list[str]]:
    """Each graph's nodes carrying one of the three defects (empty lists when fixed)."""
    found = {}
    for f in sorted(out.glob("model.*.onnx")):
        found[f.name] = [f"{n.op_type} {n.name}" for n in ops_of(f) if n.op_type in ("TopK", "AscendAntiQuant")
                         or (n.op_type == "Shape" and {a.name for a in n.attribute} & {"start", "end"})
                         or (n.op_type == "Reshape" and any(a.name == "allowzero" for a in n.attribute))]
    return found


@pytest.mark.slow
@pytest.mark.parametrize("target", ["ascend", "ort"])
def test_gears_prefill_reads_its_dims_with_shape_and_gather(converted, target: str) -> None:
    """Every --gears prefill graph, Ascend's and ONNX Runtime's: T and P + T come from Shape + Gather, and
    no Reshape carries allowzero; the Ascend one (910B3's, with the fused ops) passes the checker. (Both
    verify at every gear in tests/test_gears.py; every SoC's gears graphs: tests/test_ascend_matrix.py.)"""
    out = converted("tiny-qwen3", "fp16", *GEARS) if target == "ascend" else converted("tiny-qwen3", "fp32",
                                                                                         "gears=8,16,32")
    assert defects(out) == {"model.decode.onnx": [], "model.prefill.onnx": []}
    gathers = [n for n in ops_of(out / "model.prefill.onnx")
               if n.op_type == "Gather" and n.input[1].startswith("shape_index")]
    if target == "ascend":  # ORT's fused attention reads T itself; the exporter's reads are then unused
        assert len(gathers) == 2
        assert check_graphs(out, "ascend", "Ascend910B3") == {"decode": [], "prefill": []}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-qwen3-next"])
def test_routing_without_topk_verifies(converted, name: str) -> None:
    """MoE and Qwen3-Next routing as ArgMax rounds: no TopK, the checker clean, and every greedy token
    equal to transformers' through the reference kernels (fp16 tolerance, as for the other Ascend graphs).
    On 310B, which has no MoeGatingTopKSoftmax kernel (910B's fused routing: tests/test_npu_moe.py)."""
    from qwen2om.verify import verify

    out = converted(name, "fp16", "target=ascend", "soc_version=Ascend310B1")
    assert defects(out) == {"model.decode.onnx": [], "model.prefill.onnx": []}
    ops = {n.op_type for n in ops_of(out / "model.decode.onnx")}
    assert "ArgMax" in ops and "TopK" not in ops
    assert check_graphs(out, "ascend", "Ascend310B1") == {"decode": [], "prefill": []}
    report = verify(out, f"builtin:{name}", tokens=16)
    assert report.passed and report.agreement == 1.0 and report.max_abs < 2e-2


def test_wqbmm_reshape_back_reads_dims_with_shape_and_gather() -> None:
    """More than one symbolic leading dim (no export writes that yet): the Reshape back to x's dims
    reads them with Shape + Gather, not Shape(end=-1), which CANN would read as the whole shape."""
    from types import SimpleNamespace

    from qwen2om.passes.lower_int4_ascend import LowerInt4Ascend
    from qwen2om.quantized import Int4Weight

    graph = ir.Graph([], [], nodes=[], name="g")
    x = ir.Value(name="x", shape=ir.Shape([1, "T", "S", 64]), type=ir.TensorType(ir.DataType.FLOAT16))
    q = Int4Weight("model.layers.0.mlp.up_proj.weight", n=16, k=64, group=32, symmetric=True)
    nodes: list[ir.Node] = []
    LowerInt4Ascend().wqbmm(graph, nodes, q, x, None, SimpleNamespace(derived={}), {})
    shapes = [n for n in nodes if n.op_type == "Shape"]
    assert len(shapes) == 1 and not shapes[0].attributes
    gather = next(n for n in nodes if n.op_type == "Gather")
    assert gather.inputs[0] is shapes[0].outputs[0] and gather.inputs[1].const_value.numpy().tolist() == [0, 1, 2]
