"""The allow-list checker (qwen2om/cann.py, qwen2om/ascend.py): CANN's parser registrations as data.

Each mutation is a small graph built with onnx.helper holding one construct ATC rejects or mis-reads;
the checker must name it, say why, and cite the table's source (repo:path@commit#Lline). A clean
graph reports nothing. The same through `qwen2om inspect FILE.onnx --check ascend`, and with a
modified table through `--cann-table`.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from qwen2om.ascend import RELEASES, cann_release, check_or_raise, problems, soc_info
from qwen2om.cann import Problem, check, load_table, parse_table, ranges
from qwen2om.errors import Qwen2omError
from qwen2om.kernels.ascend import pack_int4_int32

TABLE = Path(__file__).parent.parent / "qwen2om" / "data" / "cann-onnx-ops.json"
# repo:path@<40 hex>#L<line>: a source a person can open at the exact line
LINE = re.compile(r"^[\w.-]+/[\w.-]+:[\w./-]+@[0-9a-f]{40}#L\d+$")
F16 = TensorProto.FLOAT16


def vi(name: str, dtype: int, shape: list[int]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def onnx_model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
               inits: list[onnx.TensorProto] | None = None, opsets: dict[str, int] | None = None,
               functions: list[onnx.FunctionProto] | None = None) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits or [])
    ops = [helper.make_opsetid(d, v) for d, v in (opsets or {"": 18}).items()]
    return helper.make_model(graph, opset_imports=ops, ir_version=8, functions=functions or [])


def found(model: onnx.ModelProto, soc: str | None = None, **kw: Any) -> list[Problem]:
    return problems(ir.serde.deserialize_model(model), soc_info(soc) if soc else None, **kw)


def one(ps: list[Problem], what: str) -> Problem:
    hits = [p for p in ps if p.what == what]
    assert len(hits) == 1, (what, [p.line() for p in ps])
    return hits[0]


def unary(op: str, opset: int = 18, domain: str = "", opsets: dict[str, int] | None = None,
          **attrs: Any) -> onnx.ModelProto:
    node = helper.make_node(op, ["x"], ["y"], name=f"/m/{op}", domain=domain, **attrs)
    return onnx_model([node], [vi("x", F16, [2, 4])], [vi("y", F16, [2, 4])], opsets=opsets or {"": opset})


def wqbmm(group: int = 32, k: int = 64, n: int = 16, *, op: str = "WeightQuantBatchMatmulV2", domain: str = "npu",
          npu_version: int = 1, **attrs: Any) -> onnx.ModelProto:
    """x [2, k] fp16 @ int4 weight packed (k, n/8) int32, per-group scale (k/g, n): what lower_int4_ascend writes."""
    words = pack_int4_int32(np.zeros((k, n), np.int8))
    scale_rows = -(-k // group) if group else 1
    node = helper.make_node(op, ["x", "w", "s"], ["y"], name="/m/q_proj/WQBMM", domain=domain,
                            antiquant_group_size=group, dtype=-1, **attrs)
    opsets = {"": 18, "npu": npu_version} if domain == "npu" else {"": 18}
    return onnx_model([node], [vi("x", F16, [2, k])], [vi("y", F16, [2, n])],
                      [numpy_helper.from_array(words, "w"),
                       numpy_helper.from_array(np.ones((scale_rows, n), np.float16), "s")], opsets)


# -- the mutations of issue 23 --------------------------------------------------------------------------
def test_loop_is_not_registered_anywhere() -> None:
    body = helper.make_graph([helper.make_node("Identity", ["v"], ["v_out"])], "body",
                             [vi("i", TensorProto.INT64, []), vi("c", TensorProto.BOOL, []), vi("v", F16, [2, 4])],
                             [vi("c", TensorProto.BOOL, []), vi("v_out", F16, [2, 4])])
    node = helper.make_node("Loop", ["n", "", "x"], ["y"], name="/m/Loop", body=body)
    m = onnx_model([node], [vi("n", TensorProto.INT64, []), vi("x", F16, [2, 4])], [vi("y", F16, [2, 4])])
    p = one(found(m), "Loop")
    assert "no CANN parser plugin registers ai.onnx::Loop" in p.reason and "ai.onnx::18::Loop" in p.reason
    assert LINE.match(p.source) and "hicann/ge:parser/parser/onnx/onnx_parser.cc@" in p.source


def test_an_opset_the_table_lacks_for_the_op() -> None:
    """ReduceL2 is registered up to opset 17: at 18 the exact key is missing and nothing falls back."""
    p = one(found(unary("ReduceL2", 18, keepdims=1)), "ReduceL2")
    assert "ai.onnx::18::ReduceL2 is not registered" in p.reason and "opsets 8-17 only" in p.reason
    assert "does not fall back" in p.reason
    assert LINE.match(p.source) and "reduceL2_onnx_plugin.cpp@" in p.source
    assert not found(unary("ReduceL2", 17, keepdims=1))


def test_npu_op_needs_npu_version_1() -> None:
    ps = found(wqbmm(npu_version=2), "Ascend910B3")
    p = one(ps, "npu::WeightQuantBatchMatmulV2")
    assert "npu::2::WeightQuantBatchMatmulV2 is not registered" in p.reason and "npu version 1" in p.reason
    assert LINE.match(p.source) and "npu_weight_quant_batchmatmul_v2_onnx_plugin.cpp@" in p.source
    assert one(ps, "domain npu").reason.startswith("no CANN plugin registers an op for npu version 2")
    assert not found(wqbmm(), "Ascend910B3")


def test_node_in_a_domain_without_opset_import() -> None:
    m = unary("Foo", domain="com.example", opsets={"": 18})
    p = one(found(m), "com.example::Foo")
    assert "imports no opset for domain 'com.example'" in p.reason and "has no responding version" in p.reason
    assert LINE.match(p.source) and "onnx_parser.cc@" in p.source


def test_gather_nd_batch_dims() -> None:
    node = helper.make_node("GatherND", ["x", "i"], ["y"], name="/m/GatherND", batch_dims=1)
    m = onnx_model([node], [vi("x", F16, [2, 4, 3]), vi("i", TensorProto.INT64, [2, 1])], [vi("y", F16, [2, 3])])
    p = one(found(m), "GatherND batch_dims=1")
    assert "batch_dims=0" in p.reason and p.where == "/m/GatherND"
    assert LINE.match(p.source) and "gather_nd_onnx_plugin.cpp@" in p.source


@pytest.mark.parametrize(("op", "domain"), [("WeightQuantBatchMatmulV2", "npu"), ("NPUWeightQuantBatchMatmulV2", "")])
def test_wqbmm_group_48(op: str, domain: str) -> None:
    """Both origin types the plugin registers: npu::1::WeightQuantBatchMatmulV2 and ai.onnx::N::NPU..."""
    ps = found(wqbmm(48, op=op, domain=domain), "Ascend910B3")
    p = one(ps, f"{op} antiquant_group_size=48")
    assert "multiple of 32 below k = 64" in p.reason
    assert LINE.match(p.source) and "weight_quant_batch_matmul_v2_proto.h@" in p.source
    assert not found(wqbmm(32, op=op, domain=domain), "Ascend910B3")


def test_wqbmm_group_not_below_k() -> None:
    assert one(found(wqbmm(64, k=64), "Ascend910B3"), "WeightQuantBatchMatmulV2 antiquant_group_size=64")


def rms_norm(x_type: int = F16, gamma_type: int = F16) -> onnx.ModelProto:
    node = helper.make_node("NPURmsNorm", ["x", "g"], ["y", "rstd"], name="/model/norm/NPURmsNorm", domain="npu")
    return onnx_model([node], [vi("x", x_type, [1, 2, 64])], [vi("y", x_type, [1, 2, 64])],
                      [numpy_helper.from_array(np.ones(64, onnx.helper.tensor_dtype_to_np_dtype(gamma_type)), "g")],
                      {"": 18, "npu": 1})


def test_a_fused_op_needs_the_socs_kernel() -> None:
    """The SoC's op-info config decides (the table's params.kernels, cited): 910B and 310P have an
    RmsNorm kernel, 310B none; 310P's takes gamma in x's dtype only, 910B's a float32 gamma too."""
    assert not found(rms_norm(), "Ascend910B3") and not found(rms_norm(), "Ascend310P3")
    p = one(found(rms_norm(), "Ascend310B1"), "NPURmsNorm")
    assert "(310B) has no NPURmsNorm kernel" in p.reason and LINE.match(p.source) and "rms_norm_def.cpp@" in p.source
    assert not found(rms_norm(gamma_type=TensorProto.FLOAT), "Ascend910B3")
    p = one(found(rms_norm(gamma_type=TensorProto.FLOAT), "Ascend310P3"), "NPURmsNorm")
    assert "no dtype combination x FLOAT16, gamma FLOAT" in p.reason


def test_incre_flash_attention_is_refused_with_why() -> None:
    """Its kernels exist on 910B, but its ONNX plugin cannot carry grouped K/V heads: refused, cited."""
    node = helper.make_node("NPUIncreFlashAttention", ["q", "k", "v", "", "m", "l"], ["y"], name="/m/IFA",
                            domain="npu", num_heads=4, input_layout="BNSD")
    m = onnx_model([node], [vi("q", F16, [1, 4, 1, 8]), vi("k", F16, [1, 2, 16, 8]), vi("v", F16, [1, 2, 16, 8]),
                            vi("m", TensorProto.BOOL, [1, 1, 1, 16]), vi("l", TensorProto.INT64, [1])],
                   [vi("y", F16, [1, 4, 1, 8])], opsets={"": 18, "npu": 1})
    p = one(found(m, "Ascend910B3"), "NPUIncreFlashAttention")
    assert "never forwards num_key_value_heads" in p.reason and LINE.match(p.source)


def test_npu_prefixed_name_in_the_npu_domain_is_unregistered() -> None:
    """The npu domain registers WeightQuantBatchMatmulV2; the NPU-prefixed name lives in ai.onnx only."""
    p = one(found(wqbmm(op="NPUWeightQuantBatchMatmulV2", domain="npu"), "Ascend910B3"),
            "npu::NPUWeightQuantBatchMatmulV2")
    assert "it is registered as ai.onnx::NPUWeightQuantBatchMatmulV2" in p.reason


def test_shape_with_start() -> None:
    p = one(found(unary("Shape", start=2)), "Shape start/end")
    assert "returns the full shape" in p.reason
    assert LINE.match(p.source) and "shape_onnx_plugin.cpp@" in p.source
    assert not found(unary("Shape"))
    assert not found(unary("Shape", start=0))


def test_a_clean_graph_reports_nothing() -> None:
    """Ops an LLM graph holds, at opset 18 / IR 8, fp16, an int4 WQBMM for 910B: nothing to report."""
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="/m/Shape"),
             helper.make_node("Reshape", ["x", "shape"], ["r"], name="/m/Reshape"),
             helper.make_node("Softmax", ["r"], ["p"], axis=-1, name="/m/Softmax"),
             helper.make_node("Cast", ["p"], ["c"], to=TensorProto.FLOAT, name="/m/Cast"),
             helper.make_node("ReduceMean", ["c", "axes"], ["m"], keepdims=1, name="/m/ReduceMean"),
             helper.make_node("Gather", ["x", "idx"], ["g"], axis=0, name="/m/Gather"),
             helper.make_node("Constant", [], ["one"], value=numpy_helper.from_array(np.ones(1, np.float16)))]
    m = onnx_model(nodes, [vi("x", F16, [2, 4])], [vi("m", TensorProto.FLOAT, [2, 1]), vi("g", F16, [1, 4]),
                                                    vi("s", TensorProto.INT64, [2]), vi("one", F16, [1])],
                   [numpy_helper.from_array(np.array([2, 4], np.int64), "shape"),
                    numpy_helper.from_array(np.array([-1], np.int64), "axes"),
                    numpy_helper.from_array(np.array([1], np.int64), "idx")])
    assert found(m) == [] and found(m, "Ascend910B3") == []
    assert found(wqbmm(), "Ascend910B3") == [] and found(wqbmm(), "Ascend910_9392") == []


# -- the rest of the table's constraints -----------------------------------------------------------------
def test_topk_int64() -> None:
    node = helper.make_node("TopK", ["x", "k"], ["v", "i"], name="/m/router/TopK")
    m = onnx_model([node], [vi("x", F16, [2, 8])], [vi("v", F16, [2, 2]), vi("i", TensorProto.INT64, [2, 2])],
                   [numpy_helper.from_array(np.array([2], np.int64), "k")])
    ps = found(m)
    assert {p.what for p in ps} == {"TopK k int64", "TopK indices int64"}
    assert all(LINE.match(p.source) and "topk_proto.h@" in p.source for p in ps)


def test_other_attribute_constraints() -> None:
    cases = {"ArgMax select_last_index=1": unary("ArgMax", select_last_index=1),
             "Reshape allowzero=1": onnx_model([helper.make_node("Reshape", ["x", "s"], ["y"], allowzero=1)],
                                               [vi("x", F16, [2, 4]), vi("s", TensorProto.INT64, [1])],
                                               [vi("y", F16, [8])]),
             "Cast to FLOAT8E4M3FN": unary("Cast", to=TensorProto.FLOAT8E4M3FN),
             "ReduceMean noop_with_empty_axes=1": unary("ReduceMean", 11, noop_with_empty_axes=1)}
    for what, m in cases.items():
        p = one(found(m), what)
        assert LINE.match(p.source), (what, p.source)
    # allowzero matters only where the shape may hold a 0: a constant shape without one is fine
    reshape = helper.make_node("Reshape", ["x", "s"], ["y"], allowzero=1)
    for shape, bad in (([8], False), ([0, 8], True)):
        m = onnx_model([reshape], [vi("x", F16, [2, 4])], [vi("y", F16, [8])],
                       [numpy_helper.from_array(np.array(shape, np.int64), "s")])
        assert bool(found(m)) == bad, shape
    scatter = helper.make_node("ScatterND", ["x", "i", "u"], ["y"], reduction="mul")
    m = onnx_model([scatter], [vi("x", F16, [4]), vi("i", TensorProto.INT64, [1, 1]), vi("u", F16, [1])],
                   [vi("y", F16, [4])])
    assert "TensorScatterUpdate" in one(found(m), "ScatterND reduction=mul").reason


def test_inline_fp8_is_refused_external_fp8_parses(tmp_path: Path) -> None:
    w = helper.make_tensor("w8", TensorProto.FLOAT8E4M3FN, [4], bytes([56, 64, 48, 0]), raw=True)
    m = onnx_model([helper.make_node("Identity", ["w8"], ["y"])], [], [vi("y", TensorProto.FLOAT8E4M3FN, [4])], [w])
    table_only = RELEASES["table"]
    p = one(found(m, release=table_only), "FLOAT8E4M3FN")
    assert p.where == "w8" and "inline FLOAT8E4M3FN tensor is refused" in p.reason
    assert LINE.match(p.source) and "onnx_constant_parser.cc@" in p.source
    onnx.save(m, tmp_path / "ext.onnx", save_as_external_data=True, size_threshold=0, location="ext.data")
    external = onnx.load(tmp_path / "ext.onnx", load_external_data=False)
    assert found(external, release=table_only) == []
    by_tensor = {p.where: p for p in found(external)}  # CANN 7/8: FP8 anywhere is unconfirmed
    assert by_tensor["w8"].reason.startswith("FP8 tensors are not confirmed") and set(by_tensor) == {"w8", "y"}


def test_wqbmm_transpose_and_layout() -> None:
    ps = found(wqbmm(transpose_weight=1), "Ascend910B3")
    assert "forces transpose_weight=false" in one(ps, "WeightQuantBatchMatmulV2 transpose_weight=1").reason
    m = wqbmm()
    m.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.zeros((2, 64), np.int32), "w"))  # (n/8, k): transposed
    p = one(found(m, "Ascend910B3"), "WeightQuantBatchMatmulV2 weight [2, 64]")
    assert "must be [64, 2]" in p.reason and LINE.match(p.source)


def test_soc_kernels() -> None:
    """910B has int4 kernels; 310P's op info takes int8 weights only (and its conditions ONNX cannot
    meet); 310B has no WeightQuantBatchMatmulV2 and no ND AscendAntiQuant."""
    p = one(found(wqbmm(), "Ascend310P3"), "WeightQuantBatchMatmulV2 FLOAT16/INT32")
    assert "weight INT8 only" in p.reason and "weight_quant_batch_matmul_v2_def.cpp@" in p.source
    int8 = wqbmm(0)
    int8.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.zeros((64, 16), np.int8), "w"))
    p = one(found(int8, "Ascend310P3"), "WeightQuantBatchMatmulV2")
    assert "transpose_weight true" in p.reason and LINE.match(p.source)
    assert found(int8, "Ascend910B3") == []
    # so the int4 lowering emits it on neither: 310P and 310B take W8A16 (weight_storage=int8)
    assert [s for s in ("Ascend910B3", "Ascend910_9392", "Ascend310P3", "Ascend310B1") if soc_info(s).w4a16] == [
        "Ascend910B3", "Ascend910_9392"]
    p = one(found(wqbmm(), "Ascend310B1"), "WeightQuantBatchMatmulV2")
    assert "has no WeightQuantBatchMatmulV2 kernel" in p.reason and LINE.match(p.source)
    anti = unary("AscendAntiQuant", scale=1.0, offset=0.0, dtype=1, sqrt_mode=0)
    p = one(found(anti, "Ascend310B1"), "AscendAntiQuant")
    assert "Ascend950-only" in p.reason and LINE.match(p.source)


def test_subgraphs_and_local_functions() -> None:
    loop = helper.make_node("Loop", ["n", "", "x"], ["y"], name="/m/inner/Loop",
                            body=helper.make_graph([], "b", [], []))
    branch = helper.make_graph([loop], "then", [], [vi("y", F16, [2, 4])])
    node = helper.make_node("If", ["c"], ["y"], name="/m/If", then_branch=branch, else_branch=branch)
    m = onnx_model([node], [vi("c", TensorProto.BOOL, []), vi("n", TensorProto.INT64, []), vi("x", F16, [2, 4])],
                   [vi("y", F16, [2, 4])])
    assert [p.where for p in found(m) if p.what == "Loop"] == ["/m/inner/Loop", "/m/inner/Loop"]
    f = helper.make_function("local", "F", ["a"], ["b"], [helper.make_node("Identity", ["a"], ["b"])],
                             [helper.make_opsetid("", 18)])
    m = onnx_model([helper.make_node("F", ["x"], ["y"], domain="local")], [vi("x", F16, [2])], [vi("y", F16, [2])],
                   opsets={"": 18, "local": 1}, functions=[f])
    ps = found(m)
    assert "no FunctionProto" in one(ps, "local functions").reason and one(ps, "local::F")


def test_ort_contrib_ops_name_the_domain() -> None:
    """What an ONNX Runtime output reports: its com.microsoft kernels and the domain, nothing else."""
    node = helper.make_node("SkipSimplifiedLayerNormalization", ["x", "x", "g"], ["y"], domain="com.microsoft")
    m = onnx_model([node], [vi("x", TensorProto.FLOAT, [2, 4])], [vi("y", TensorProto.FLOAT, [2, 4])],
                   [numpy_helper.from_array(np.ones(4, np.float32), "g")], {"": 18, "com.microsoft": 1})
    ps = found(m)
    assert {p.what for p in ps} == {"domain com.microsoft", "com.microsoft::SkipSimplifiedLayerNormalization"}
    assert "registered: versions 11-18" in one(ps, "domain com.microsoft").reason  # MultiHeadAttention's


# -- where the table and CANN 7/8 disagree: --cann-version -------------------------------------------------
def test_trilu_and_bf16_per_cann_version() -> None:
    trilu = unary("Trilu", upper=0)
    p = one(found(trilu), "Trilu")  # default: CANN 7/8, the safer rule
    assert "no parser in CANN 7/8" in p.reason and "trilu" in p.source.lower()
    assert found(trilu, release=cann_release("table")) == [] == check(ir.serde.deserialize_model(trilu))
    bf16 = unary("Cast", to=TensorProto.BFLOAT16)
    assert one(found(bf16), "Cast to BFLOAT16") and not found(bf16, release=cann_release("table"))
    assert cann_release(None).name == "7" and cann_release("8.0.RC2").name == "8"
    assert cann_release("7.0").name == "7" and cann_release("TABLE").name == "table"
    with pytest.raises(Qwen2omError, match="known are 7.x, 8.x"):
        cann_release("6.3")


def test_opset_and_ir_limits_of_cann_7() -> None:
    m = unary("Relu", 19)
    m.ir_version = 9
    whats = {p.what for p in found(m)}
    assert {"opset 19", "ir_version 9", "Relu"} <= whats
    assert {p.what for p in found(m, release=cann_release("table"))} == {"Relu"}  # the table: Relu 8-18 only


def test_check_or_raise_names_the_source() -> None:
    with pytest.raises(Qwen2omError, match=r"prefill graph: /m/Shape: Shape start/end: .*shape_onnx_plugin\.cpp@"):
        check_or_raise({"prefill": ir.serde.deserialize_model(unary("Shape", end=3))}, soc_info("Ascend910B3"))
    check_or_raise({"decode": ir.serde.deserialize_model(unary("Relu"))}, soc_info("Ascend910B3"))


# -- the table itself ---------------------------------------------------------------------------------------
def test_shipped_table_provenance() -> None:
    raw = json.loads(TABLE.read_text(encoding="utf-8"))
    table = load_table()
    hex40 = re.compile(r"^[0-9a-f]{40}$")
    assert {r for r, c in table.repos.items() if hex40.match(c)} >= {
        "hicann/ops-math", "hicann/ops-nn", "hicann/ops-cv", "hicann/ge"}
    # 268 ai.onnx op types plus Constant (the parser's own); 54 NPU* ops plus npu::WeightQuantBatchMatmulV2
    assert len([k for k in raw if not k.startswith("_")]) == 269 and len(raw["_other_domains"]["npu"]) == 55
    for (domain, op), entry in table.ops.items():
        if op != "Constant":
            assert all(LINE.match(x) or x.endswith("#L0") for x in entry.lines), (domain, op)
    from qwen2om.cann import RULES

    for key in RULES:  # every check cites lines the table records
        assert key in table.constraints and table.constraints[key]["lines"], key
        assert all(LINE.match(x) for x in table.constraints[key]["lines"].values()), key
    assert ranges({8, 9, 10, 14, 16, 17}) == "8-10, 14, 16-17"


def test_bad_table_files(tmp_path: Path) -> None:
    (tmp_path / "t.json").write_text("[]")
    with pytest.raises(Qwen2omError, match="JSON object"):
        load_table(tmp_path / "t.json")
    with pytest.raises(Qwen2omError, match="not a table of CANN's ONNX registrations"):
        parse_table({"Add": {"opsets": [18]}}, "x.json")


# -- through the CLI -------------------------------------------------------------------------------------
def saved(tmp_path: Path, name: str, m: onnx.ModelProto) -> Path:
    path = tmp_path / name
    onnx.save(m, path)
    return path


def test_cli_single_onnx_file(tmp_path: Path, cli, monkeypatch) -> None:
    bad = saved(tmp_path, "bad.onnx", unary("Shape", start=2))
    code, stdout, _ = cli("inspect", bad, "--check", "ascend", "--json")
    out = json.loads(stdout)
    assert code == 1 and out["cann_version"] == "7" and out["cann_table"] == "qwen2om/data/cann-onnx-ops.json"
    assert re.fullmatch(r"[0-9a-f]{40}", out["cann_sources"]["hicann/ops-math"])
    [p] = out["problems"]["bad.onnx"]
    assert p["what"] == "Shape start/end" and LINE.match(p["source"])
    monkeypatch.setenv("COLUMNS", "400")
    code, stdout, _ = cli("inspect", bad, "--check", "ascend")
    assert code == 1 and "Shape start/end" in stdout and "shape_onnx_plugin.cpp@" in stdout
    clean = saved(tmp_path, "clean.onnx", unary("Relu"))
    code, stdout, _ = cli("inspect", clean, "--check", "ascend")
    assert code == 0 and "no construct ATC is known to reject" in stdout and "hicann/ops-math@c41933244c31" in stdout
    code, _, err = cli("inspect", clean, "--cann-version", "7")
    assert code == 2 and "go with --check ascend" in err


def test_cli_cann_version(tmp_path: Path, cli) -> None:
    trilu = saved(tmp_path, "trilu.onnx", unary("Trilu", upper=0))
    assert cli("inspect", trilu, "--check", "ascend")[0] == 1
    assert cli("inspect", trilu, "--check", "ascend", "--cann-version", "table")[0] == 0
    code, _, err = cli("inspect", trilu, "--check", "ascend", "--cann-version", "5.1")
    assert code == 2 and "known are 7.x, 8.x" in err


def test_cli_cann_table(tmp_path: Path, cli) -> None:
    """A newer table decides: here one whose Shape plugin honours start/end (the constraint is gone)
    and that registers Loop for opset 18, with its own provenance."""
    shape = saved(tmp_path, "shape.onnx", unary("Shape", start=2))
    loop = saved(tmp_path, "loop.onnx", onnx_model([helper.make_node("Loop", ["n", "", "x"], ["y"],
                                                                      body=helper.make_graph([], "b", [], []))],
                                                    [vi("n", TensorProto.INT64, []), vi("x", F16, [2])],
                                                    [vi("y", F16, [2])]))
    raw = json.loads(TABLE.read_text(encoding="utf-8"))
    newer = copy.deepcopy(raw)
    del newer["_constraints"]["ops"]["Shape"]
    newer["Loop"] = {"opsets": [18], "ge_op": "PartitionedCall", "lines": ["example/ops:loop.cpp@" + "1" * 40 + "#L7"]}
    newer["_meta"]["repos"]["hicann/ops-math"] = "f" * 40
    table_file = tmp_path / "newer.json"
    table_file.write_text(json.dumps(newer))
    assert cli("inspect", shape, "--check", "ascend")[0] == 1
    code, stdout, _ = cli("inspect", shape, "--check", "ascend", "--cann-table", table_file, "--json")
    assert code == 0 and json.loads(stdout)["cann_sources"]["hicann/ops-math"] == "f" * 40
    assert cli("inspect", loop, "--check", "ascend", "--cann-table", table_file)[0] == 0
    code, stdout, _ = cli("inspect", loop, "--check", "ascend", "--json")
    assert code == 1 and json.loads(stdout)["problems"]["loop.onnx"][0]["what"] == "Loop"
    (tmp_path / "broken.json").write_text("{")
    code, _, err = cli("inspect", shape, "--check", "ascend", "--cann-table", tmp_path / "broken.json")
    assert code == 2 and "--cann-table" in err


# -- the regeneration script ---------------------------------------------------------------------------------
PLUGIN = """
REGISTER_CUSTOM_OP("GeFoo")
    .FrameworkType(ONNX)
    .OriginOpType({ge::AscendString("ai.onnx::17::Foo"), ge::AscendString("ai.onnx::18::Foo"),
                   ge::AscendString("npu::1::NPUFoo"), ge::AscendString("aten::foo")})
    .ParseParamsFn(ParseFoo);
REGISTER_CUSTOM_OP("TfOnly").FrameworkType(TENSORFLOW).OriginOpType("Bar");
#define REG(ONNX_OPP, ATC_OPP, FUN) \\
    REGISTER_CUSTOM_OP(#ATC_OPP)    \\
        .FrameworkType(ONNX)        \\
        .OriginOpType(#ONNX_OPP)    \\
        .ParseParamsFn(FUN)
REG(ai.onnx::11::Baz, GeBaz, F1);
REG(ai.onnx::12 ::Baz, GeBaz, F2);
"""


def test_regeneration_script(tmp_path: Path, monkeypatch) -> None:
    """tools/cann_table.py on a one-file repository: direct and macro registrations, the
    preprocessor's stringification (a stray space unregisters), constraint lines from anchors."""
    spec = importlib.util.spec_from_file_location("cann_table", TABLE.parent.parent.parent / "tools" / "cann_table.py")
    tool = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    monkeypatch.setitem(sys.modules, "cann_table", tool)  # its dataclass looks its module up
    spec.loader.exec_module(tool)  # type: ignore[union-attr]
    repo = tmp_path / "ops"
    (repo / "framework").mkdir(parents=True)
    (repo / "framework" / "foo_onnx_plugin.cpp").write_text(PLUGIN)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "plugin"], check=True)
    base = {"_meta": {"repos": {"example/ops": "HEAD"}}, "_other_domains": {}, "_non_standard_origin_types": [],
            "_llm_core": {},
            "_constraints": {"parser": [], "history": [], "ops": {"Foo": {"what": "x", "source": "y", "anchors": {
                "fact": {"repo": "example/ops", "path": "framework/foo_onnx_plugin.cpp", "pattern": r"ParseFoo"},
                "gone": {"repo": "example/ops", "path": "framework/foo_onnx_plugin.cpp", "pattern": r"Nowhere"}}}}}}
    table, stale = tool.regenerate(base, {"example/ops": tool.Repo("example/ops", repo, "HEAD")})
    commit = table["_meta"]["repos"]["example/ops"]
    assert re.fullmatch(r"[0-9a-f]{40}", commit)
    assert table["Foo"]["opsets"] == [17, 18] and table["Foo"]["ge_op"] == "GeFoo"
    assert table["Foo"]["lines"] == [f"example/ops:framework/foo_onnx_plugin.cpp@{commit}#L2"]
    assert table["_other_domains"]["npu"]["NPUFoo"]["opsets"] == [1]
    assert table["Baz"]["opsets"] == [11]  # 'ai.onnx::12 ::Baz' is no key the parser builds
    assert {o["origin"][0] for o in table["_non_standard_origin_types"]} == {"aten::foo", "ai.onnx::12 ::Baz"}
    assert "Bar" not in json.dumps(table)
    assert table["_constraints"]["ops"]["Foo"]["lines"]["fact"].endswith("#L6")
    assert stale and "Nowhere" in stale[0]
