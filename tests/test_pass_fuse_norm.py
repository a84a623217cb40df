"""fuse_norm on a hand-built layer: residual Add + RMSNorm becomes one SkipSimplifiedLayerNormalization,
only where the exact fp32 pattern is, and ONNX Runtime gives the same numbers before and after."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from unit_state import add, constant, context, op_counts, run, value

from qwen2om.graph_rewrite import MS_DOMAIN
from qwen2om.passes.fuse_norm import FuseNorm
from qwen2om.state import ConvertState

H, EPS = 32, 1e-6
NORM_OPS = ("Pow", "ReduceMean", "Add", "Sqrt", "Div", "Mul")


def rmsnorm(graph: ir.Graph, scope: str, x: ir.Value, weight: str, seed: int, *, out: str | None = None) -> ir.Value:
    """`x / sqrt(mean(x²) + ε) · w` as the exporter writes qwen2om's RMSNorm, every node in `scope`."""
    two = constant(graph, "two", np.array(2.0, np.float32))
    axes = constant(graph, "axes", np.array([-1], np.int64))
    eps = constant(graph, "eps", np.array(EPS, np.float32))
    w = constant(graph, weight, (1 + 0.1 * np.random.default_rng(seed).standard_normal(H)).astype(np.float32))
    p = add(graph, "Pow", [x, two], f"{scope}/Pow")
    m = add(graph, "ReduceMean", [p, axes], f"{scope}/ReduceMean", attrs=[ir.AttrInt64("keepdims", 1)])
    s = add(graph, "Sqrt", [add(graph, "Add", [m, eps], f"{scope}/Add")], f"{scope}/Sqrt")
    return add(graph, "Mul", [add(graph, "Div", [x, s], f"{scope}/Div"), w], f"{scope}/Mul", out=out,
               shape=x.shape, dtype=x.dtype)


def layer(t: int, *, lm_head: bool = True) -> ir.Model:
    """One decoder layer's residual stream and the final norm, MLP and attention reduced to a Relu:

        n0 = input_layernorm(x)                       (reads a graph input: no Add to fold)
        s1 = x + attn;  n1 = post_attention_layernorm(s1)
        s2 = s1 + Relu(n1);  y = norm(s2)             (s1 read by two nodes)
    """
    shape = [1, t, H]
    x, attn = value("x", shape), value("attn", shape)
    graph = ir.Graph([x, attn], [], nodes=[], name="layer", opset_imports={"": 18})
    n0 = rmsnorm(graph, "/model/layers.0/input_layernorm", x, "model.layers.0.input_layernorm.weight", 0)
    s1 = add(graph, "Add", [x, attn], "/model/layers.0/Add", shape=shape)
    n1 = rmsnorm(graph, "/model/layers.0/post_attention_layernorm", s1,
                 "model.layers.0.post_attention_layernorm.weight", 1)
    s2 = add(graph, "Add", [s1, add(graph, "Relu", [n1], "/model/layers.0/mlp/Relu", shape=shape)],
             "/model/layers.0/Add_1", shape=shape)
    y = rmsnorm(graph, "/model/norm", s2, "model.norm.weight", 2)
    if lm_head:
        y = add(graph, "Relu", [y], "/lm_head/Relu", out="logits", shape=shape)
    graph.outputs.extend([n0, y])
    return ir.Model(graph, ir_version=8)


def feeds(t: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(t)
    return {"x": rng.standard_normal((1, t, H), dtype=np.float32),
            "attn": rng.standard_normal((1, t, H), dtype=np.float32)}


def test_residual_add_and_norm_become_one_node(tmp_path: Path) -> None:
    graphs = {"decode": layer(1), "prefill": layer(5)}
    expected = {kind: run(layer(t), feeds(t)) for kind, t in (("decode", 1), ("prefill", 5))}
    state = ConvertState(graphs=graphs, facts={"graphs_legal"})

    assert set(FuseNorm.requires) <= state.filled()  # what the pipeline would hand it
    result = FuseNorm()(state, context(tmp_path))

    assert result.modified and result.stats == {"decode_fused_norms": 2, "prefill_fused_norms": 2}
    for kind, t in (("decode", 1), ("prefill", 5)):
        model = graphs[kind]
        # input_layernorm stays (its Add ε and nothing else), the two residual Adds are gone
        assert op_counts(model) == {"SkipSimplifiedLayerNormalization": 2, "Relu": 2,
                                    **dict.fromkeys(NORM_OPS, 1)}, kind
        fused = [n for n in model.graph if n.op_type == "SkipSimplifiedLayerNormalization"]
        assert [n.name for n in fused] == ["/model/layers.0/post_attention_layernorm/SkipSimplifiedLayerNormalization",
                                           "/model/norm/SkipSimplifiedLayerNormalization"]
        assert all(n.domain == MS_DOMAIN for n in fused) and model.opset_imports[MS_DOMAIN] == 1
        assert [v.name for v in fused[0].inputs] == [  # type: ignore[union-attr]
            "x", "attn", "model.layers.0.post_attention_layernorm.weight"]
        assert fused[1].inputs[0] is fused[0].outputs[3]  # the next residual reads the fused sum
        assert fused[1].inputs[2].name == "model.norm.weight"  # type: ignore[union-attr]
        assert fused[0].attributes["epsilon"].as_float() == pytest.approx(EPS)
        assert [v.name for v in model.graph.outputs] == ["/model/layers.0/input_layernorm/Mul_out", "logits"]
        for got, want in zip(run(model, feeds(t)), expected[kind], strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    again = FuseNorm()(state, context(tmp_path))
    assert not again.modified and again.stats == {"decode_fused_norms": 0, "prefill_fused_norms": 0}
    assert op_counts(graphs["decode"])["SkipSimplifiedLayerNormalization"] == 2


def near_miss(kind: str) -> ir.Model:
    """The layer with one departure from the pattern in the post-attention norm or its residual."""
    model = layer(3)
    graph = model.graph
    nodes = {n.name: n for n in graph}
    scope = "/model/layers.0/post_attention_layernorm"
    if kind == "broadcast":  # x + bias is not a residual
        bias = value("bias", [H])
        graph.inputs.append(bias)
        nodes["/model/layers.0/Add"].replace_input_with(1, bias)
    elif kind == "sum_is_output":  # the residual sum leaves the graph: the fused node would hide it
        graph.outputs.append(nodes["/model/layers.0/Add"].outputs[0])
    elif kind == "cube":  # Pow 3: not a mean of squares
        nodes[f"{scope}/Pow"].replace_input_with(1, constant(graph, "three", np.array(3.0, np.float32)))
    elif kind == "eps_input":  # ε fed at run time
        eps = value("eps_in", [])
        graph.inputs.append(eps)
        nodes[f"{scope}/Add"].replace_input_with(1, eps)
    elif kind == "extra_node":  # a Cast inside the scope (how fp16 statistics look)
        pow_ = nodes[f"{scope}/Pow"]
        cast = ir.Node("", "Cast", [pow_.inputs[0]], [ir.AttrInt64("to", ir.DataType.FLOAT.value)],
                       num_outputs=1, name=f"{scope}/Cast")
        graph.insert_before(pow_, cast)
        pow_.replace_input_with(0, cast.outputs[0])
    return model


@pytest.mark.parametrize("kind", ["broadcast", "sum_is_output", "cube", "eps_input", "extra_node"])
def test_near_misses_are_left_alone(tmp_path: Path, kind: str) -> None:
    model = near_miss(kind)
    before = op_counts(model)
    result = FuseNorm()(ConvertState(graphs={"prefill": model}), context(tmp_path))
    assert result.stats == {"prefill_fused_norms": 1}  # the final norm only
    assert [n.name for n in model.graph if n.op_type == "SkipSimplifiedLayerNormalization"] == [
        "/model/norm/SkipSimplifiedLayerNormalization"]
    assert op_counts(model)["Pow"] == before["Pow"] - 1
    rng = np.random.default_rng(7)
    extra = {"bias": rng.standard_normal(H, dtype=np.float32), "eps_in": np.array(EPS, np.float32)}
    np.testing.assert_allclose(run(model, feeds(3) | extra)[1], run(near_miss(kind), feeds(3) | extra)[1],
                               rtol=1e-5, atol=1e-5)


def test_norm_output_as_graph_output_is_left_alone(tmp_path: Path) -> None:
    """It raised half-way (replace_all_uses_with refuses graph outputs), the fused node already in;
    qwen2om's graphs always feed the final norm to lm_head, but a norm that is an output stays."""
    model = layer(2, lm_head=False)  # the final norm's output is the graph's output
    expected = run(layer(2, lm_head=False), feeds(2))
    result = FuseNorm()(ConvertState(graphs={"prefill": model}), context(tmp_path))
    assert result.stats == {"prefill_fused_norms": 1}
    assert [v.name for v in model.graph.outputs][1] == "/model/norm/Mul_out"
    np.testing.assert_allclose(run(model, feeds(2))[1], expected[1], rtol=1e-5, atol=1e-5)
