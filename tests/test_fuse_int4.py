"""fuse_int4: MatMulNBits sharing an input become one MatMulNBits + Split, same numbers in ONNX Runtime."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from qwen2om.graph_rewrite import MS_DOMAIN
from qwen2om.passes.fuse_int4 import FuseInt4, fused_base
from qwen2om.state import ConvertState
from qwen2om.weights import WeightRef, Weights

K, BLOCK = 64, 16


def nbits_node(graph: ir.Graph, weights: Weights, bindings: dict[str, WeightRef], x: ir.Value, base: str,
               n: int, *, zero_point: bool, accuracy_level: int = 0, seed: int = 0) -> ir.Node:
    """A lowered projection `base` as lower_int4 writes it: lazily produced B, scales (and zero points)."""
    g = torch.Generator().manual_seed(seed)
    blocks = K // BLOCK
    data = {".weight_nbits": (ir.DataType.UINT8, [n, blocks, BLOCK // 2],
                              torch.randint(0, 256, (n, blocks, BLOCK // 2), generator=g, dtype=torch.uint8)),
            ".weight_nbits_scale": (ir.DataType.FLOAT, [n * blocks], torch.rand(n * blocks, generator=g) * 0.1)}
    if zero_point:
        data[".weight_nbits_zero_point"] = (ir.DataType.UINT8, [n * ((blocks + 1) // 2)],
                                            torch.randint(0, 256, (n * ((blocks + 1) // 2),), generator=g,
                                                          dtype=torch.uint8))
    inputs = [x]
    for suffix, (dtype, shape, value) in data.items():
        v = ir.Value(name=base + suffix, shape=ir.Shape(shape), type=ir.TensorType(dtype))
        graph.initializers.add(v)
        weights.derived[v.name] = lambda value=value: value  # type: ignore[misc]
        bindings[v.name] = WeightRef(v.name)
        inputs.append(v)
    node = ir.Node(MS_DOMAIN, "MatMulNBits", inputs, [
        ir.AttrInt64("K", K), ir.AttrInt64("N", n), ir.AttrInt64("bits", 4), ir.AttrInt64("block_size", BLOCK),
        ir.AttrInt64("accuracy_level", accuracy_level)], num_outputs=1,
        name=f"/{base.replace('.', '/')}/MatMulNBits")
    node.outputs[0].name = f"{base}.out"
    node.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
    node.outputs[0].shape = ir.Shape([1, 3, n])
    graph.append(node)
    return node


def build(zero_point: bool) -> tuple[ir.Model, Weights, dict[str, WeightRef]]:
    """q/k/v and gate/up on one input each, o on another, one MatMulNBits at another accuracy level."""
    weights = Weights(lambda name: torch.zeros(0), {}, torch.float32, lazy=True)
    bindings: dict[str, WeightRef] = {}
    x = ir.Value(name="x", shape=ir.Shape([1, 3, K]), type=ir.TensorType(ir.DataType.FLOAT))
    h = ir.Value(name="h", shape=ir.Shape([1, 3, K]), type=ir.TensorType(ir.DataType.FLOAT))
    graph = ir.Graph([x, h], [], nodes=[], name="g", opset_imports={"": 18, MS_DOMAIN: 1})
    outs = [nbits_node(graph, weights, bindings, x, f"model.layers.0.self_attn.{p}", n, zero_point=zero_point,
                       seed=i) for i, (p, n) in enumerate((("q_proj", K), ("k_proj", 16), ("v_proj", 16)))]
    outs += [nbits_node(graph, weights, bindings, h, f"model.layers.0.mlp.{p}", 48, zero_point=zero_point,
                        seed=10 + i) for i, p in enumerate(("gate_proj", "up_proj"))]
    outs.append(nbits_node(graph, weights, bindings, h, "model.layers.0.mlp.other", 16, zero_point=zero_point,
                           accuracy_level=4, seed=20))  # same input, other accuracy level: stays alone
    outs.append(nbits_node(graph, weights, bindings, outs[0].outputs[0], "model.layers.0.self_attn.o_proj", K,
                           zero_point=zero_point, seed=30))
    for i, node in enumerate(outs):
        if node.inputs[0] is not outs[0].outputs[0]:  # everything but q feeds a graph output through Relu
            relu = ir.Node("", "Relu", [node.outputs[0]], num_outputs=1, name=f"/relu{i}")
            relu.outputs[0].name = f"y{i}"
            relu.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
            graph.append(relu)
            graph.outputs.append(relu.outputs[0])
    return ir.Model(graph, ir_version=8), weights, bindings


def run(model: ir.Model, weights: Weights, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Materialise the lazy initializers the way write_onnx would and run the graph in ONNX Runtime."""
    for v in model.graph.initializers.values():
        if v.const_value is None:
            v.const_value = ir.tensor(weights.derived[v.name]().numpy(), name=v.name)
    proto = ir.serde.serialize_model(model)
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    sess = ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def op_counts(model: ir.Model) -> collections.Counter[str]:
    return collections.Counter(n.op_type for n in model.graph)


@pytest.mark.parametrize("zero_point", [False, True])
def test_fused_graph_matches_the_unfused_one(zero_point: bool) -> None:
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((1, 3, K), dtype=np.float32),
             "h": rng.standard_normal((1, 3, K), dtype=np.float32)}
    reference_model, reference_weights, _ = build(zero_point)
    expected = run(reference_model, reference_weights, feeds)

    model, weights, bindings = build(zero_point)
    ws = ConvertState(graphs={"decode": model}, weights=weights, bindings=bindings, scale_map={},
                      facts={"int4_lowered"})
    result = FuseInt4()(ws, None)  # type: ignore[arg-type]
    assert result.modified and result.stats == {"decode_fused_groups": 2, "decode_fused_nodes": 5}
    assert op_counts(model) == {"MatMulNBits": 4, "Split": 2, "Relu": 6}
    names = set(model.graph.initializers)
    assert "model.layers.0.self_attn.q_proj+k_proj+v_proj.weight_nbits" in names
    assert "model.layers.0.mlp.gate_proj+up_proj.weight_nbits_scale" in names
    assert ("model.layers.0.mlp.gate_proj+up_proj.weight_nbits_zero_point" in names) == zero_point
    assert not any(n.startswith(("model.layers.0.self_attn.q_proj.", "model.layers.0.mlp.up_proj.")) for n in names)
    assert bindings["model.layers.0.mlp.gate_proj+up_proj.weight_nbits"] == WeightRef(
        "model.layers.0.mlp.gate_proj+up_proj.weight_nbits")
    qkv = next(n for n in model.graph if n.op_type == "MatMulNBits" and n.attributes["N"].as_int() == 96
               and "q_proj" in (n.name or ""))
    assert qkv.name == "/model/layers/0/self_attn/q_proj+k_proj+v_proj/MatMulNBits"
    assert qkv.inputs[1] is not None and list(qkv.inputs[1].shape) == [96, K // BLOCK, BLOCK // 2]

    got = run(model, weights, feeds)
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)

    again = FuseInt4()(ws, None)  # type: ignore[arg-type]
    assert not again.modified and again.stats == {"decode_fused_groups": 0, "decode_fused_nodes": 0}


def test_fused_tensors_are_produced_lazily() -> None:
    """The pass only registers producers; nothing is concatenated until write_onnx asks."""
    model, weights, bindings = build(zero_point=False)
    calls: list[str] = []
    for name, produce in list(weights.derived.items()):
        weights.derived[name] = lambda name=name, produce=produce: calls.append(name) or produce()  # type: ignore[misc]
    FuseInt4()(ConvertState(graphs={"decode": model}, weights=weights, bindings=bindings,
                            scale_map={}, facts={"int4_lowered"}), None)  # type: ignore[arg-type]
    assert calls == []
    b = weights.derived["model.layers.0.self_attn.q_proj+k_proj+v_proj.weight_nbits"]()
    assert b.shape == (96, K // BLOCK, BLOCK // 2) and len(calls) == 3


def test_scales_fed_as_inputs_are_left_alone() -> None:
    model, weights, bindings = build(zero_point=False)
    for node in model.graph:  # what scale_inputs does: the scale is no longer an initializer
        if node.op_type == "MatMulNBits" and "q_proj" in (node.name or ""):
            scale = ir.Value(name="q.scale", shape=node.inputs[2].shape, type=node.inputs[2].type)  # type: ignore[union-attr]
            model.graph.inputs.append(scale)
            node.replace_input_with(2, scale)
    result = FuseInt4()(ConvertState(graphs={"decode": model}, weights=weights, bindings=bindings,
                                     scale_map={}, facts={"int4_lowered"}), None)  # type: ignore[arg-type]
    assert result.stats == {"decode_fused_groups": 2, "decode_fused_nodes": 4}  # k+v and gate+up; q stays alone


def test_fused_base_names() -> None:
    assert fused_base(["a.b.q_proj", "a.b.k_proj"]) == ("a.b.", "q_proj+k_proj")
    assert fused_base(["x.gate", "x.gate_up"]) == ("x.", "gate+gate_up")


@pytest.mark.slow
def test_convert_fuses_qkv_and_gate_up(tmp_path: Path) -> None:
    """A calibrated tiny Qwen3 converts to 4 MatMulNBits per layer (qkv, o, gate_up, down) and
    decodes the same logits as its unfused conversion (accuracy level 0)."""
    from qwen2om.convert import convert
    from qwen2om.quant.calibrate import CalibrationConfig, calibrate

    ckpt = tmp_path / "w4"
    calibrate("builtin:tiny-qwen3", ckpt, CalibrationConfig(method="rtn", group_size=32, num_samples=8, seq_len=64))
    sets = ["max_seq_len=64", "prefill_chunk=8"]
    fused = convert(ckpt, tmp_path / "fused", overrides=sets)
    stats = next(s for s in fused.manifest["stages"] if s["pass"] == "fuse_int4")["stats"]
    # per graph: 4 layers × (qkv, gate_up)
    assert stats == {"decode_fused_groups": 4 * 2, "decode_fused_nodes": 4 * 5,
                     "prefill_fused_groups": 4 * 2, "prefill_fused_nodes": 4 * 5}
    summary = (tmp_path / "fused" / "graphs" / "summary.txt").read_text()
    assert "op     MatMulNBits 16" in summary and "op     Split 8" in summary

    text = (Path(__file__).parents[1] / "recipes" / "ort.yaml").read_text()
    recipe = tmp_path / "unfused.yaml"
    recipe.write_text("\n".join(line for line in text.splitlines() if "- fuse_int4" not in line) + "\n")
    convert(ckpt, tmp_path / "unfused", recipe=str(recipe), overrides=sets)

    from qwen2om.runtime.standalone import Engine

    ids = [1, 2, 3, 4, 5]
    a, b = Engine(tmp_path / "fused"), Engine(tmp_path / "unfused")
    la, lb = a.prefill([ids])[0], b.prefill([ids])[0]
    np.testing.assert_allclose(la, lb, rtol=0, atol=1e-4)
    for tok in (7, 8, 9):
        np.testing.assert_allclose(a.step([tok])[0], b.step([tok])[0], rtol=0, atol=1e-4)
