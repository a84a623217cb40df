"""scale_inputs on hand-built lowered linears: each quantised MatMul's scale initializer becomes a
`<module>.weight.scale` graph input in the checkpoint's shape, the signature and scale_map.json say so,
scales.safetensors holds the values, and the graph fed those values computes what it computed before."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
import torch
from safetensors.torch import load_file
from unit_state import FakeCheckpoint, add, constant, context, lazy_weights, op_counts, run, value

from qwen2om.graph_rewrite import FP8_SCALE, MS_DOMAIN, NBITS_SCALE, NBITS_WEIGHT, derived_initializer, scale_input
from qwen2om.passes.scale_inputs import SCALE_MAP, SCALES_FILE, ScaleInputs
from qwen2om.quant import fp8
from qwen2om.quant.int4 import Int4Spec, pack_int4, rtn
from qwen2om.quantized import Fp8Weight, Int4Weight
from qwen2om.signature import ROLE_SCALE, IOSpec
from qwen2om.state import ConvertState
from qwen2om.weights import WeightRef, Weights

K, GROUP, BLOCK = 64, 16, (8, 16)
Q, DOWN = "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"
FACTS = {"int4_lowered", "fp8_lowered"}


def checkpoint(*, int4: bool = True, fp8_too: bool = True) -> FakeCheckpoint:
    """q_proj [48, K] int4 in groups of 16 and down_proj [16, K] e4m3fn in 8×16 tiles."""
    ckpt = FakeCheckpoint({})
    gen = torch.Generator().manual_seed(0)
    if int4:
        q, scale, _ = rtn(torch.randn(48, K, generator=gen) * 0.1, Int4Spec(GROUP, True))
        ckpt.tensors |= {f"{Q}.weight_packed": pack_int4(q), f"{Q}.weight_scale": scale.to(torch.bfloat16)}
        ckpt.quantized[f"{Q}.weight"] = Int4Weight(f"{Q}.weight", 48, K, GROUP, True)
    if fp8_too:
        w, s = fp8.quantize(torch.randn(16, K, generator=gen) * 0.1, BLOCK)
        ckpt.tensors |= {f"{DOWN}.weight": w, f"{DOWN}.weight_scale_inv": s}
        ckpt.quantized[f"{DOWN}.weight"] = Fp8Weight(f"{DOWN}.weight", 16, K, BLOCK, f"{DOWN}.weight_scale_inv")
    return ckpt


def lowered(ckpt: FakeCheckpoint, t: int, weights: Weights, bindings: dict[str, WeightRef],
            dtype: ir.DataType = ir.DataType.FLOAT) -> ir.Model:
    """The graph as lower_int4 and lower_fp8 leave it: q = MatMulNBits(x, B, S) and
    down = x @ (Cast(Wq) · tile(S)), each S an initializer written later from the checkpoint."""
    x = value("x", [1, t, K], dtype)
    graph = ir.Graph([x], [], nodes=[], name="g", opset_imports={"": 19, MS_DOMAIN: 1})
    torch_dtype = torch.float32 if dtype == ir.DataType.FLOAT else torch.float16
    if (q := ckpt.quantized.get(f"{Q}.weight")) is not None:
        b = derived_initializer(graph, bindings, weights, Q + NBITS_WEIGHT, ir.DataType.UINT8,
                                [48, K // GROUP, GROUP // 2], lambda: q.nbits_b(ckpt))
        s = derived_initializer(graph, bindings, weights, Q + NBITS_SCALE, dtype, [48 * K // GROUP],
                                lambda: q.unpacked(ckpt)[1].to(torch_dtype).reshape(-1))
        graph.outputs.append(add(graph, "MatMulNBits", [x, b, s], "/model/layers.0/self_attn/q_proj/MatMulNBits",
                                 domain=MS_DOMAIN, out="q", shape=[1, t, 48], dtype=dtype, attrs=[
                                     ir.AttrInt64("K", K), ir.AttrInt64("N", 48), ir.AttrInt64("bits", 4),
                                     ir.AttrInt64("block_size", GROUP), ir.AttrInt64("accuracy_level", 0)]))
    if (f := ckpt.quantized.get(f"{DOWN}.weight")) is not None:
        wq = derived_initializer(graph, bindings, weights, DOWN + ".weight_fp8", ir.DataType.FLOAT8E4M3FN, [K, 16],
                                 lambda: ckpt.raw(f.name).T.contiguous().view(torch.uint8))
        s = derived_initializer(graph, bindings, weights, DOWN + FP8_SCALE, ir.DataType.FLOAT, [2, 4],
                                lambda: f.scale(ckpt))
        p = f"/{DOWN}/fp8"
        tiled = add(graph, "Reshape", [
            add(graph, "Expand", [
                add(graph, "Unsqueeze", [add(graph, "Transpose", [s], f"{p}/Transpose_0",
                                             attrs=[ir.AttrInt64s("perm", [1, 0])]),
                                         constant(graph, "/fp8/axes_1_3", np.array([1, 3], np.int64))],
                    f"{p}/Unsqueeze_1"),
                constant(graph, "/fp8/tiles", np.array([4, BLOCK[1], 2, BLOCK[0]], np.int64))], f"{p}/Expand_2"),
            constant(graph, "/fp8/shape", np.array([K, 16], np.int64))], f"{p}/Reshape_3")
        w = add(graph, "Mul", [add(graph, "Cast", [wq], f"{p}/Cast_4", attrs=[ir.AttrInt64("to", 1)]), tiled],
                f"{p}/Mul_5")
        if dtype != ir.DataType.FLOAT:
            w = add(graph, "Cast", [w], f"{p}/Cast_6", attrs=[ir.AttrInt64("to", dtype.value)])
        graph.outputs.append(add(graph, "MatMul", [x, w], "/model/layers.1/mlp/down_proj/MatMul", out="down",
                                 shape=[1, t, 16], dtype=dtype))
    return ir.Model(graph, ir_version=9)


def build(ckpt: FakeCheckpoint, dtype: ir.DataType = ir.DataType.FLOAT) -> ConvertState:
    """A decode and a prefill graph sharing the checkpoint's scales, with their signatures."""
    weights, bindings = lazy_weights(), dict[str, WeightRef]()
    graphs = {kind: lowered(ckpt, t, weights, bindings, dtype) for kind, t in (("decode", 1), ("prefill", 4))}
    name = "float32" if dtype == ir.DataType.FLOAT else "float16"
    signatures = {kind: ([IOSpec("x", name, (1, t, K), "hidden")],
                         [IOSpec(v.name, name, tuple(v.shape), "output") for v in graphs[kind].graph.outputs])  # type: ignore[arg-type]
                  for kind, t in (("decode", 1), ("prefill", 4))}
    return ConvertState(checkpoint=ckpt, weights=weights, bindings=bindings, graphs=graphs,  # type: ignore[arg-type]
                        signatures=signatures, stacked_scales={}, facts=set(FACTS))


def feeds(t: int, dtype: type = np.float32) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(t).standard_normal((1, t, K)).astype(dtype)}


def test_scales_become_inputs(tmp_path: Path) -> None:
    ckpt = checkpoint()
    reference = build(ckpt)
    expected = {kind: run(m, feeds(t), reference.weights, reference.bindings)
                for (kind, m), t in zip(reference.graphs.items(), (1, 4), strict=True)}  # type: ignore[union-attr]
    state = build(ckpt)
    assert state.graphs is not None and state.signatures is not None and state.bindings is not None
    before = {kind: op_counts(m) for kind, m in state.graphs.items()}
    q_in, down_in = scale_input(Q), scale_input(DOWN)

    assert set(ScaleInputs.requires) <= state.filled()  # what the pipeline would hand it
    result = ScaleInputs()(state, context(tmp_path))  # scales: auto, and the checkpoint has FP8 weights

    assert result.modified and result.stats == {"scales": "inputs", "scale_inputs": 2}  # shared by both graphs
    assert q_in == "model.layers.0.self_attn.q_proj.weight.scale"
    for kind, model in state.graphs.items():
        graph = model.graph
        assert [(v.name, list(v.shape), v.dtype) for v in graph.inputs] == [  # type: ignore[arg-type]
            ("x", [1, 1 if kind == "decode" else 4, K], ir.DataType.FLOAT),
            (q_in, [48, K // GROUP], ir.DataType.FLOAT), (down_in, [2, 4], ir.DataType.FLOAT)]
        # int4's [N·K/g] scale is reshaped from the checkpoint's [N, K/g]; FP8's grid is read as it is
        assert op_counts(model) - before[kind] == {"Reshape": 1} and not before[kind] - op_counts(model)
        reshape = graph.node(0)
        assert reshape.name == f"/{Q}/scale/Reshape" and reshape.inputs[0] is graph.inputs[1]
        nbits = next(n for n in graph if n.op_type == "MatMulNBits")
        assert nbits.inputs[2] is reshape.outputs[0] and reshape.outputs[0].name == f"{q_in}/graph"
        assert next(n for n in graph if n.op_type == "Transpose").inputs[0] is graph.inputs[2]
        assert not any(n.endswith((NBITS_SCALE, FP8_SCALE)) for n in graph.initializers)
        assert state.signatures[kind][0][1:] == [IOSpec(q_in, "float32", (48, 4), ROLE_SCALE, 0),
                                                 IOSpec(down_in, "float32", (2, 4), ROLE_SCALE, 1)]
    assert not any(n.endswith((NBITS_SCALE, FP8_SCALE)) for n in (*state.bindings, *state.weights.derived))  # type: ignore[union-attr]
    assert Q + NBITS_WEIGHT in state.bindings  # the weights themselves stay initializers

    entries = json.loads((tmp_path / SCALE_MAP).read_text())
    assert entries == state.scale_map == {
        q_in: {"source": f"{Q}.weight_scale", "layer": 0, "module": Q, "weight": f"{Q}.weight", "shape": [48, 4],
               "dtype": "float32", "scheme": "int4", "format": "compressed-tensors", "group_size": GROUP},
        down_in: {"source": f"{DOWN}.weight_scale_inv", "layer": 1, "module": DOWN, "weight": f"{DOWN}.weight",
                  "shape": [2, 4], "dtype": "float32", "scheme": "fp8", "format": "fp8", "block_size": list(BLOCK)}}
    scales = load_file(tmp_path / SCALES_FILE)
    assert sorted(scales) == [q_in, down_in] and all(v.dtype == torch.float32 for v in scales.values())
    assert torch.equal(scales[q_in], ckpt.tensors[f"{Q}.weight_scale"].float())  # bf16 as stored, widened
    assert torch.equal(scales[down_in], ckpt.tensors[f"{DOWN}.weight_scale_inv"])

    for (kind, model), t in zip(state.graphs.items(), (1, 4), strict=True):
        fed = feeds(t) | {k: v.numpy() for k, v in scales.items()}
        got = run(model, fed, state.weights, state.bindings)
        for g, e in zip(got, expected[kind], strict=True):  # a constant scale is folded at load: 1 ulp apart
            np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6)


def test_fp16_graph_casts_the_fed_scale(tmp_path: Path) -> None:
    """In an fp16 graph the float32 input is reshaped, then cast to the dtype the kernel's scale had."""
    ckpt = checkpoint(fp8_too=False)
    state = build(ckpt, ir.DataType.FLOAT16)
    expected = run(build(ckpt, ir.DataType.FLOAT16).graphs["prefill"], feeds(4, np.float16),  # type: ignore[index]
                   state.weights, state.bindings)
    result = ScaleInputs()(state, context(tmp_path, scales="inputs"))
    assert result.stats == {"scales": "inputs", "scale_inputs": 1}
    graph = state.graphs["prefill"].graph  # type: ignore[index]
    assert [n.name for n in graph][:2] == [f"/{Q}/scale/Reshape", f"/{Q}/scale/Cast"]
    cast = graph.node(1)
    assert cast.attributes["to"].as_int() == ir.DataType.FLOAT16.value and cast.outputs[0].dtype == ir.DataType.FLOAT16
    assert graph.inputs[1].dtype == ir.DataType.FLOAT  # fed as float32 whatever the graph computes in
    fed = feeds(4, np.float16) | {k: v.numpy() for k, v in load_file(tmp_path / SCALES_FILE).items()}
    np.testing.assert_array_equal(run(state.graphs["prefill"], fed, state.weights, state.bindings)[0],  # type: ignore[index]
                                  expected[0])


@pytest.mark.parametrize(("int4", "fp8_too", "setting", "mode"), [
    (True, False, "auto", "constants"),  # int4 only: ONNX Runtime prepacks constant scales
    (True, True, "constants", "constants"),
    (False, False, "inputs", "none"),  # a float model has no scales
])
def test_scales_left_as_constants(tmp_path: Path, int4: bool, fp8_too: bool, setting: str, mode: str) -> None:
    state = build(checkpoint(int4=int4, fp8_too=fp8_too))
    before = {kind: (op_counts(m), sorted(m.graph.initializers)) for kind, m in state.graphs.items()}  # type: ignore[union-attr]
    result = ScaleInputs()(state, context(tmp_path, scales=setting))
    assert not result.modified and result.stats == {"scales": mode, "scale_inputs": 0}
    assert state.scale_map == {}
    assert {kind: (op_counts(m), sorted(m.graph.initializers)) for kind, m in state.graphs.items()} == before  # type: ignore[union-attr]
    assert all(len(m.graph.inputs) == 1 for m in state.graphs.values())  # type: ignore[union-attr]
    assert not (tmp_path / SCALE_MAP).exists() and not (tmp_path / SCALES_FILE).exists()


def test_stacked_expert_scales(tmp_path: Path) -> None:
    """An MoE layer's scales stacked over experts by a lowering pass become one [E, ...] input, described
    by the lowering pass's own record."""
    mlp = "model.layers.2.mlp"
    ckpt = checkpoint(int4=False)
    state = build(ckpt)
    assert state.graphs is not None and state.stacked_scales is not None
    values = torch.rand(4, 2, 4) + 0.5
    name = f"{mlp}.experts.gate_proj{FP8_SCALE}"
    for model in state.graphs.values():  # read by a ReduceSum standing in for the experts' dequantisation
        s = derived_initializer(model.graph, state.bindings, state.weights, name, ir.DataType.FLOAT,  # type: ignore[arg-type]
                                [4, 2, 4], lambda: values)
        model.graph.outputs.append(add(model.graph, "ReduceSum", [s], f"/{mlp}/experts/ReduceSum", out="experts",
                                       shape=[1, 1, 1], attrs=[ir.AttrInt64("keepdims", 1)]))
    record = {"input": scale_input(f"{mlp}.experts.gate_proj"), "source": f"{mlp}.experts.*.gate_proj.weight_scale_inv",
              "module": f"{mlp}.experts.*.gate_proj", "weight": f"{mlp}.experts.*.gate_proj.weight",
              "shape": [4, 2, 4], "experts": 4, "block_size": [8, 16], "scheme": "fp8", "format": "fp8"}
    state.stacked_scales[name] = record | {"values": lambda: values}

    result = ScaleInputs()(state, context(tmp_path))

    assert result.stats == {"scales": "inputs", "scale_inputs": 2}
    stacked = f"{mlp}.experts.gate_proj.weight.scale"
    for model in state.graphs.values():
        assert [v.name for v in model.graph.inputs] == ["x", scale_input(DOWN), stacked]
        assert name not in model.graph.initializers and model.graph.inputs[2].shape == ir.Shape([4, 2, 4])
    assert state.signatures["decode"][0][-1] == IOSpec(stacked, "float32", (4, 2, 4), ROLE_SCALE, 2)  # type: ignore[index]
    entry = json.loads((tmp_path / SCALE_MAP).read_text())[stacked]
    assert entry == {k: v for k, v in record.items() if k != "input"} | {"layer": 2, "dtype": "float32",
                                                                         "stacked": True}
    assert torch.equal(load_file(tmp_path / SCALES_FILE)[stacked], values)
    fed = feeds(1) | {k: v.numpy() for k, v in load_file(tmp_path / SCALES_FILE).items()}
    got = run(state.graphs["decode"], fed, state.weights, state.bindings)
    np.testing.assert_allclose(got[-1].reshape(()), values.sum().item(), rtol=1e-6)


def test_second_run_changes_nothing(tmp_path: Path) -> None:
    """A second run found no scale initializers left and overwrote scale_map.json with an empty one."""
    state = build(checkpoint())
    ScaleInputs()(state, context(tmp_path))
    written, entries = (tmp_path / SCALE_MAP).read_text(), dict(state.scale_map or {})
    again = ScaleInputs()(state, context(tmp_path))
    assert (tmp_path / SCALE_MAP).read_text() == written and state.scale_map == entries
    assert not again.modified
