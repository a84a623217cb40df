"""The NPU's MoE gating kernel as qwen2om emits it (npu::NPUMoeGatingTopKSoftmax) and the pass that
emits it (fuse_moe_ascend): the NumPy reference against torch's own softmax and stable sort, the ONNX
decomposition verify runs on CPU against the reference, the pass on a hand-built routing region and on
tiny-qwen3-moe's exported graphs (910B3 fuses, 310B1 keeps lower_topk_ascend's ArgMax rounds), and
whole Ascend conversions of the MoE builtins verified through the reference kernels."""

from __future__ import annotations

import dataclasses
import json
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from unit_state import add, constant, context, value

from qwen2om.ascend import soc_info
from qwen2om.cann import check
from qwen2om.errors import PlanError
from qwen2om.kernels.ascend import decompose
from qwen2om.kernels.npu_moe import GATING, moe_gating_top_k_softmax
from qwen2om.passes.fuse_moe_ascend import FuseMoeAscend
from qwen2om.pipeline import RunContext, check_plan, run_pipeline
from qwen2om.state import ConvertState

E = 8
SCOPE = "/model/layers.0/mlp/experts"


# -- the reference -----------------------------------------------------------------------------------
def oracle(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """torch: softmax in float32, then a stable descending sort (lower index first on ties), first k."""
    p = torch.softmax(torch.from_numpy(x).float(), dim=-1)
    values, index = torch.sort(p, dim=-1, descending=True, stable=True)
    return values[..., :k].numpy().astype(x.dtype), index[..., :k].numpy()


def logits(kind: str, dtype: type, shape: tuple[int, ...] = (5, E), seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = 2 * rng.standard_normal(shape)
    if kind == "dominant":  # one expert takes nearly all the mass, the rest underflow toward 0
        x[..., 3] += 30
    elif kind == "ties":  # whole rows of equal logits, and rows with a tie for the top and the middle
        x[0] = 1.5
        x[1, [2, 5, 6]] = 4.0
        x[2, [0, 7]] = -1.0
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("kind", ["random", "dominant", "ties"])
@pytest.mark.parametrize("k", [1, 2, E])
def test_reference_is_softmax_then_stable_top_k(kind: str, dtype: type, k: int) -> None:
    x = logits(kind, dtype)
    y, expert_idx, row_idx = moe_gating_top_k_softmax(x, k=k)
    want_y, want_idx = oracle(x, k)
    assert y.dtype == dtype and expert_idx.dtype == np.int32 and row_idx.dtype == np.int32
    assert y.shape == expert_idx.shape == row_idx.shape == (5, k)
    np.testing.assert_array_equal(expert_idx, want_idx)
    np.testing.assert_allclose(y.astype(np.float32), want_y.astype(np.float32), rtol=1e-6, atol=1e-7)
    assert np.all(np.diff(y.astype(np.float32), axis=-1) <= 0)  # descending
    if k == E:  # all of the softmax: not renormalised, it already sums to 1
        np.testing.assert_allclose(y.astype(np.float32).sum(-1), 1, rtol=2e-3 if dtype == np.float16 else 1e-6)


def test_ties_put_the_lower_expert_first() -> None:
    x = logits("ties", np.float32)
    _, expert_idx, _ = moe_gating_top_k_softmax(x, k=4)
    assert expert_idx[0].tolist() == [0, 1, 2, 3]
    assert expert_idx[1, :3].tolist() == [2, 5, 6]


def test_dominant_expert_and_renormalisation_left_to_the_graph() -> None:
    """y is the softmax's own top-k, not renormalised: the graph's ReduceSum/Div still divides."""
    y, expert_idx, _ = moe_gating_top_k_softmax(logits("dominant", np.float32), k=2)
    assert (expert_idx[:, 0] == 3).all() and (y[:, 0] > 0.999).all()
    y, _, _ = moe_gating_top_k_softmax(logits("random", np.float32), k=2)
    assert (y.sum(-1) < 0.99).all()


@pytest.mark.parametrize("shape", [(5, E), (2, 3, E)])
def test_row_idx_is_k_major(shape: tuple[int, ...]) -> None:
    """row_idx[r, j] = j·rows + r, rows the product of the leading dims (3-D x counts d0·d1)."""
    k = 3
    _, _, row_idx = moe_gating_top_k_softmax(logits("random", np.float32, shape), k=k)
    rows = int(np.prod(shape[:-1]))
    flat = row_idx.reshape(rows, k)
    assert all(flat[r, j] == j * rows + r for r in range(rows) for j in range(k))


@pytest.mark.parametrize("k", [0, E + 1])
def test_k_outside_the_kernels_range_is_refused(k: int) -> None:
    with pytest.raises(ValueError, match="outside 0 < k"):
        moe_gating_top_k_softmax(logits("random", np.float32), k=k)


# -- the decomposition ---------------------------------------------------------------------------------
def gating_model(x_type: int, shape: list[int], k: int) -> onnx.ModelProto:
    out_shape = [*shape[:-1], k]
    node = helper.make_node(GATING, ["x"], ["y", "expert_idx", "row_idx"], domain="npu", name=GATING, k=k)
    graph = helper.make_graph([node], "gating", [helper.make_tensor_value_info("x", x_type, shape)], [
        helper.make_tensor_value_info("y", x_type, out_shape),
        helper.make_tensor_value_info("expert_idx", TensorProto.INT32, out_shape),
        helper.make_tensor_value_info("row_idx", TensorProto.INT32, out_shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("npu", 1)],
                             ir_version=8)


@pytest.mark.parametrize(("x_type", "shape", "k", "kind"), [
    (TensorProto.FLOAT16, [5, E], 2, "random"), (TensorProto.FLOAT, [5, E], 2, "ties"),
    (TensorProto.FLOAT16, [5, E], 1, "dominant"), (TensorProto.FLOAT, [5, E], E, "ties"),
    (TensorProto.FLOAT, [2, 3, E], 3, "random")])
def test_decomposition_equals_the_reference(x_type: int, shape: list[int], k: int, kind: str) -> None:
    """How verify runs a fused graph on CPU: the decomposition in ONNX Runtime gives the reference's
    experts in the same order (ties included), its row_idx, and its values to float32 rounding."""
    np_x = np.float16 if x_type == TensorProto.FLOAT16 else np.float32
    x = logits(kind, np_x, tuple(shape), seed=1)
    model = gating_model(x_type, shape, k)
    assert decompose(model) == 1
    onnx.checker.check_model(model, full_check=True)
    assert {o.domain for o in model.opset_import} == {""}
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"x": x})
    want = moe_gating_top_k_softmax(x, k=k)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2], want[2])
    np.testing.assert_allclose(got[0].astype(np.float32), want[0].astype(np.float32), rtol=1e-6,
                               atol=1e-3 if np_x == np.float16 else 1e-7)


# -- the pass on a hand-built routing region -----------------------------------------------------------
def routing(k: int, *, indices_out: bool = False, probs: str = "Softmax", n: int = 5) -> ir.Model:
    """The exporter's routing as static_model.RoutedExperts writes it, every node in the experts' scope:
    Cast (fp16 logits → float32) → Softmax → TopK(k) → ReduceSum/Div (norm_topk_prob), the indices
    read by an Unsqueeze (the GatherND's index) or returned as they are."""
    x = value("logits", [n, E], ir.DataType.FLOAT16)
    graph = ir.Graph([x], [], nodes=[], name="routing", opset_imports={"": 18})
    xf = add(graph, "Cast", [x], f"{SCOPE}/Cast", attrs=[ir.AttrInt64("to", ir.DataType.FLOAT)], shape=[n, E])
    p = add(graph, probs, [xf], f"{SCOPE}/{probs}", attrs=[ir.AttrInt64("axis", -1)] if probs == "Softmax" else [],
            out="softmax_1", shape=[n, E])
    topk = ir.Node("", "TopK", [p, constant(graph, "val_k", np.array([k], np.int64))],
                   [ir.AttrInt64("axis", -1), ir.AttrInt64("largest", 1), ir.AttrInt64("sorted", 1)],
                   num_outputs=2, name=f"{SCOPE}/TopK")
    values, indices = topk.outputs
    values.name, indices.name = "getitem", "getitem_1"
    values.shape, values.type = ir.Shape([n, k]), ir.TensorType(ir.DataType.FLOAT)
    indices.shape, indices.type = ir.Shape([n, k]), ir.TensorType(ir.DataType.INT64)
    graph.append(topk)
    axes = constant(graph, "val_15", np.array([-1], np.int64))
    total = add(graph, "ReduceSum", [values, axes], f"{SCOPE}/ReduceSum", attrs=[ir.AttrInt64("keepdims", 1)],
                shape=[n, 1])
    graph.outputs.append(add(graph, "Div", [values, total], f"{SCOPE}/Div", out="weights", shape=[n, k]))
    if indices_out:
        graph.outputs.append(indices)
    else:
        graph.outputs.append(add(graph, "Unsqueeze", [indices, axes], f"{SCOPE}/Unsqueeze_1", out="index",
                                 shape=[n, k, 1], dtype=ir.DataType.INT64))
    return ir.Model(graph, ir_version=8)


def run_model(model: ir.Model, x: np.ndarray) -> list[np.ndarray]:
    proto = ir.serde.serialize_model(model)
    decompose(proto)
    onnx.checker.check_model(proto, full_check=True)
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"logits": x})  # type: ignore[return-value]


def soc_context(tmp_path: Path, soc: str, logs: list[str]) -> RunContext:
    return dataclasses.replace(context(tmp_path, soc_version=soc), log=logs.append)


@pytest.mark.parametrize(("k", "indices_out"), [(2, False), (1, True), (E, False)])
def test_pass_fuses_the_routing_and_onnx_runtime_agrees(tmp_path: Path, k: int, indices_out: bool) -> None:
    x = logits("ties", np.float16, (5, E), seed=2)
    expected = run_model(routing(k, indices_out=indices_out), x)
    model = routing(k, indices_out=indices_out)
    state = ConvertState(graphs={"decode": model}, facts={"graphs_legal"})
    assert set(FuseMoeAscend.requires) <= state.filled()
    logs: list[str] = []
    result = FuseMoeAscend()(state, soc_context(tmp_path, "Ascend910B3", logs))

    assert result.modified and result.stats == {"decode_fused_routing": 1, "decode_kept_routing": 0}
    assert logs == [] and model.opset_imports["npu"] == 1
    ops = [(n.domain, n.op_type) for n in model.graph]
    assert ("npu", GATING) in ops and ("", "TopK") not in ops and ("", "Softmax") not in ops
    gating = next(n for n in model.graph if n.op_type == GATING)
    assert gating.name == f"{SCOPE}/{GATING}" and gating.attributes["k"].type == ir.AttributeType.INT
    assert gating.attributes["k"].as_int() == k and gating.inputs[0].dtype == ir.DataType.FLOAT
    # the exporter's names stay on the values the rest of the graph reads
    assert {"getitem", "getitem_1"} <= {v.name for n in model.graph for v in n.outputs}
    for got, want in zip(run_model(model, x), expected, strict=True):
        np.testing.assert_array_equal(got, want)

    again = FuseMoeAscend()(state, soc_context(tmp_path, "Ascend910B3", logs))
    assert not again.modified and again.stats == {"decode_fused_routing": 0, "decode_kept_routing": 0}


@pytest.mark.parametrize(("soc", "probs", "why"), [
    ("Ascend310B1", "Softmax", r"\(310B\) has no NPUMoeGatingTopKSoftmax kernel: its op-info config lists "
                               r"ascend910_93, ascend910b, ascend950"),
    ("Ascend310P3", "Softmax", r"\(310P\) has no NPUMoeGatingTopKSoftmax kernel"),
    ("Ascend910B3", "Sigmoid", r"layer 0: .*the TopK reads Sigmoid, not the region's Softmax")])
def test_pass_leaves_the_routing_and_says_why(tmp_path: Path, soc: str, probs: str, why: str) -> None:
    model = routing(2, probs=probs)
    before = [(n.op_type, n.name) for n in model.graph]
    logs: list[str] = []
    result = FuseMoeAscend()(ConvertState(graphs={"decode": model}, facts={"graphs_legal"}),
                             soc_context(tmp_path, soc, logs))
    assert not result.modified and result.stats == {"decode_fused_routing": 0, "decode_kept_routing": 1}
    assert [(n.op_type, n.name) for n in model.graph] == before and "npu" not in model.opset_imports
    assert len(logs) == 1 and re.search(why, logs[0]), logs


def test_plan_puts_the_fusion_before_the_topk_lowering() -> None:
    check_plan(["fuse_moe_ascend", "lower_topk_ascend"], {"graphs", "graphs_legal"})
    with pytest.raises(PlanError, match="'lower_topk_ascend' must run after 'fuse_moe_ascend'"):
        check_plan(["lower_topk_ascend", "fuse_moe_ascend"], {"graphs", "graphs_legal"})


# -- the pass on tiny-qwen3-moe's exported graphs ------------------------------------------------------
@pytest.fixture(scope="module")
def exported() -> tuple[dict[str, bytes], RunContext, int]:
    """tiny-qwen3-moe's Ascend graphs as legalize_ort leaves them, serialised once (the weights that
    write_onnx would fill are zeros here: the pass reads none), the run's context and top_k."""
    from qwen2om.builtin import resolve_model
    from qwen2om.convert import choose_recipe, read_config

    src = resolve_model("builtin:tiny-qwen3-moe")
    r = choose_recipe(read_config(src), None, {"target": "ascend", "soc_version": "Ascend910B3",
                                               "max_seq_len": 256, "prefill_chunk": 32})
    ctx = RunContext(recipe=r, stage_dir=Path(tempfile.mkdtemp(prefix="npu-moe-")), source=src, tool_version="t")
    state = ConvertState()
    run_pipeline([(s, {}) for s in ("load_checkpoint", "static_model", "export_onnx", "legalize_ort")], state, ctx)
    protos = {}
    for kind, model in state.graphs.items():
        for v in model.graph.initializers.values():
            if v.const_value is None:
                v.const_value = ir.tensor(np.zeros([int(d) for d in v.shape], v.dtype.numpy()), name=v.name)
        protos[kind] = ir.serde.serialize_model(model).SerializeToString()
    top_k = json.loads((src / "config.json").read_text())["num_experts_per_tok"]
    return protos, ctx, top_k


def fuse_then_lower(exported: tuple[dict[str, bytes], RunContext, int], soc: str
                    ) -> tuple[ConvertState, list[str], dict[str, dict[str, int | float | str]]]:
    protos, ctx, _ = exported
    graphs = {kind: ir.serde.deserialize_model(onnx.load_from_string(p)) for kind, p in protos.items()}
    state = ConvertState(graphs=graphs, facts={"graphs_legal"})
    logs: list[str] = []
    ctx = dataclasses.replace(ctx, recipe=dataclasses.replace(ctx.recipe, soc_version=soc), log=logs.append)
    reports = run_pipeline([("fuse_moe_ascend", {}), ("lower_topk_ascend", {})], state, ctx)
    return state, logs, {r.name: r.stats for r in reports}


def moe_layers(model: ir.Model) -> int:
    return len({m.group(1) for n in model.graph if (m := re.match(r"/model/layers\.(\d+)/mlp/experts/", n.name or ""))})


def layer_ops(model: ir.Model, layer: int) -> list[str]:
    return [n.op_type for n in model.graph if (n.name or "").startswith(f"/model/layers.{layer}/mlp/experts/")]


@pytest.mark.slow  # an export of tiny-qwen3-moe (seconds), shared by the module
def test_tiny_qwen3_moe_routing_fused_for_910b(exported) -> None:
    state, logs, stats = fuse_then_lower(exported, "Ascend910B3")
    top_k, layers = exported[2], moe_layers(state.graphs["decode"])
    assert stats["fuse_moe_ascend"] == {"decode_fused_routing": layers, "decode_kept_routing": 0,
                                        "prefill_fused_routing": layers, "prefill_kept_routing": 0}
    assert stats["lower_topk_ascend"] == {"lowered": 0} and logs == []
    for kind, model in state.graphs.items():
        assert model.opset_imports["npu"] == 1
        for layer in range(layers):
            ops = layer_ops(model, layer)
            assert ops.count(GATING) == 1 and not {"TopK", "ArgMax", "Softmax"} & set(ops), (kind, layer, ops)
        gatings = [n for n in model.graph if n.op_type == GATING]
        assert len(gatings) == layers and all(n.domain == "npu" and n.attributes["k"].as_int() == top_k
                                              for n in gatings)
        assert all(n.inputs[0].dtype == ir.DataType.FLOAT for n in gatings)  # the float32 logits after the Cast
        assert not [p for p in check(model, soc=soc_info("Ascend910B3")) if GATING in p.what], kind
        # the same graph on a SoC without the kernel is refused by the checker, citing the op-info config
        refused = [p for p in check(model, soc=soc_info("Ascend310B1")) if GATING in p.what]
        assert len(refused) == layers and "def.cpp" in refused[0].source


@pytest.mark.slow  # an export of tiny-qwen3-moe (seconds), shared by the module
def test_tiny_qwen3_moe_routing_kept_as_argmax_rounds_for_310b(exported) -> None:
    state, logs, stats = fuse_then_lower(exported, "Ascend310B1")
    top_k, layers = exported[2], moe_layers(state.graphs["decode"])
    assert stats["fuse_moe_ascend"] == {"decode_fused_routing": 0, "decode_kept_routing": layers,
                                        "prefill_fused_routing": 0, "prefill_kept_routing": layers}
    assert stats["lower_topk_ascend"] == {"lowered": 2 * layers}
    assert len(logs) == 1 and "(310B) has no NPUMoeGatingTopKSoftmax kernel" in logs[0], logs
    for model in state.graphs.values():
        ops = layer_ops(model, 0)
        assert ops.count("ArgMax") == top_k and GATING not in ops and "TopK" not in ops


# -- whole conversions, verified through the reference kernels -----------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-qwen3-5-moe", "tiny-qwen3-next"])
def test_ascend_moe_conversion_verifies(converted: Callable[..., Path], name: str) -> None:
    """The fused routing in a whole Ascend910B3 conversion (the dense MoE and both hybrid MoE builtins):
    the checker clean, and `qwen2om verify` PASSes through the decomposition."""
    from qwen2om.inspect import check_graphs
    from qwen2om.verify import verify

    out = converted(name, "fp16", "target=ascend", "soc_version=Ascend910B3")
    decode = onnx.load(out / "model.decode.onnx", load_external_data=False)
    ops = [n.op_type for n in decode.graph.node]
    assert GATING in ops and "TopK" not in ops and "ArgMax" not in ops
    assert check_graphs(out, "ascend", "Ascend910B3") == {"decode": [], "prefill": []}
    report = verify(out, f"builtin:{name}", tokens=8)
    assert report.passed and report.agreement == 1.0, report
