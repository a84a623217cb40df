"""Layer cloning (qwen2om/replicate.py): a graph traced with two layers and grown to L is the same
computation as one traced with all L layers."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from qwen2om.builtin import resolve_model
from qwen2om.convert import choose_recipe, read_config
from qwen2om.pipeline import RunContext, run_pipeline
from qwen2om.replicate import TemplateError, replicate_layers
from qwen2om.state import ConvertState

STEPS = ["load_checkpoint", "static_model"]


def build(name: str, tmp_path, replicate: bool) -> tuple[ConvertState, dict]:
    src = resolve_model(f"builtin:{name}")
    r = choose_recipe(read_config(src), None, {"max_seq_len": 64, "prefill_chunk": 8})
    stage = tmp_path / ("rep" if replicate else "full")
    stage.mkdir()
    ws = ConvertState()
    ctx = RunContext(recipe=r, stage_dir=stage, source=src)
    steps = [(s, {}) for s in STEPS] + [("export_onnx", {"replicate": replicate}), ("legalize_ort", {}),
                                        ("write_onnx", {})]
    reports = run_pipeline(steps, ws, ctx)
    return ws, reports[2].stats


def session(path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # compare the graphs as written
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def assert_same_graph(rep, full) -> None:
    """Same inputs and outputs, and bit-identical results on random ids, states and a real mask
    (0 or the dtype's minimum: the hybrids' conv reads which rows are pads from it)."""
    a, b = session(rep), session(full)
    assert [(i.name, i.shape) for i in a.get_inputs()] == [(i.name, i.shape) for i in b.get_inputs()]
    assert [(o.name, o.shape) for o in a.get_outputs()] == [(o.name, o.shape) for o in b.get_outputs()]
    rng = np.random.default_rng(0)
    feeds = {}
    for i in a.get_inputs():
        if i.type == "tensor(int64)":
            feeds[i.name] = rng.integers(0, 60, size=i.shape).astype(np.int64)
        elif i.name == "attention_mask":
            feeds[i.name] = np.where(rng.random(i.shape) < 0.5, 0, np.finfo(np.float32).min).astype(np.float32)
        else:
            feeds[i.name] = rng.standard_normal(i.shape).astype(np.float32)
    for x, y, o in zip(a.run(None, feeds), b.run(None, feeds), a.get_outputs(), strict=True):
        assert np.array_equal(x, y), o.name


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3-untied"])
def test_cloned_layers_compute_exactly_what_traced_layers_do(name: str, tmp_path) -> None:
    ws_rep, stats_rep = build(name, tmp_path, True)
    ws_full, stats_full = build(name, tmp_path, False)
    assert stats_rep["decode_layers_traced"] == 2 and stats_full["decode_layers_traced"] == 4
    for kind in ("decode", "prefill"):
        assert stats_rep[f"{kind}_nodes"] == stats_full[f"{kind}_nodes"]
        assert_same_graph(ws_rep.onnx_files[kind], ws_full.onnx_files[kind])


@pytest.mark.slow
def test_cloned_nodes_are_named_after_their_layer(tmp_path) -> None:
    ws, _ = build("tiny-qwen3", tmp_path, True)
    names = {n.name for n in ws.graphs["decode"].graph}
    for layer in range(4):
        assert f"/model/layers.{layer}/self_attn/q_proj/MatMul" in names
    inits = set(ws.graphs["decode"].graph.initializers)
    assert "model.layers.3.mlp.down_proj.weight" in inits


def test_a_graph_without_layer_scopes_is_refused() -> None:
    x = ir.Value(name="x", shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.FLOAT))
    node = ir.Node("", "Relu", [x], num_outputs=1)
    graph = ir.Graph([x], node.outputs, nodes=[node])
    with pytest.raises(TemplateError, match="no nodes"):
        replicate_layers(ir.Model(graph, ir_version=8), 4)


@pytest.mark.slow
def test_hybrid_layers_clone_by_kind(tmp_path, monkeypatch) -> None:
    """Qwen3-Next with 8 layers (linear ×3, full, linear ×3, full): four layers traced, layers 4-7 cloned
    from the stamp of their kind (layer 3 for full attention, 2 for linear); same graph as all traced."""
    import dataclasses

    from qwen2om.fixtures import tiny

    spec = tiny.TINY["tiny-qwen3-next"]
    monkeypatch.setitem(tiny.TINY, "tiny-qwen3-next-8", dataclasses.replace(
        spec, name="tiny-qwen3-next-8", config={**spec.config, "num_hidden_layers": 8}))
    ws_rep, stats_rep = build("tiny-qwen3-next-8", tmp_path, True)
    ws_full, stats_full = build("tiny-qwen3-next-8", tmp_path, False)
    assert stats_rep["prefill_layers_traced"] == 4 and stats_full["prefill_layers_traced"] == 8
    for kind in ("decode", "prefill"):
        # A full trace may share values computed from the inputs alone between the two full-attention
        # layers (the exporter's CSE): the mask's reshape and the RoPE cos/sin reshapes of the
        # `rotary` module; the clone of layer 3 recomputes them: at most three nodes more, same numbers.
        assert 0 <= stats_rep[f"{kind}_nodes"] - stats_full[f"{kind}_nodes"] <= 3
        assert_same_graph(ws_rep.onnx_files[kind], ws_full.onnx_files[kind])
