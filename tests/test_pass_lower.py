"""lower_int4 and lower_fp8 on hand-built MatMuls: each quantised `MatMul(x, Wᵀ)` becomes the target's form
(MatMulNBits; an e4m3fn weight dequantised by its block scale), float MatMuls stay, tensors are produced
lazily under the names later passes look for, and ONNX Runtime gives the numbers of the float graph."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
import torch
from unit_state import FakeCheckpoint, add, constant, context, lazy_weights, op_counts, run, value

from qwen2om.errors import Qwen2omError
from qwen2om.graph_rewrite import FP8_SCALE, MS_DOMAIN, NBITS_SCALE, NBITS_WEIGHT, NBITS_ZERO_POINT
from qwen2om.passes.lower_fp8 import WEIGHT_SUFFIX, LowerFp8
from qwen2om.passes.lower_int4 import LowerInt4
from qwen2om.quant import fp8
from qwen2om.quant.int4 import Int4Spec, pack_int4, rtn
from qwen2om.quantized import Fp8Weight, Int4Weight, QuantWeight
from qwen2om.state import ConvertState
from qwen2om.weights import WeightRef

K, T = 64, 3
Q, DOWN = "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"


def graph_of(dequantized: dict[str, torch.Tensor]) -> tuple[ir.Model, dict[str, WeightRef]]:
    """What export_onnx writes for two quantised linears and a float LM head, weights as initializers
    holding their float values (what a recipe without the lowering passes writes):

        q = x @ W_qᵀ;  logits = Relu(q) @ W_lmᵀ          (W_lm float: not the pass's)
        down = x @ W_downᵀ                              (a graph output)
    """
    x = value("x", [1, T, K])
    graph = ir.Graph([x], [], nodes=[], name="g", opset_imports={"": 18})
    bindings: dict[str, WeightRef] = {}

    def linear(inp: ir.Value, base: str, w: torch.Tensor, out: str | None = None) -> ir.Value:
        init = constant(graph, f"{base}.weight", w.T.contiguous().numpy())
        bindings[init.name] = WeightRef(f"{base}.weight", transpose=True)  # type: ignore[index]
        return add(graph, "MatMul", [inp, init], f"/{base.replace('.', '/')}/MatMul".replace("layers/0", "layers.0"),
                   out=out, shape=[1, T, w.shape[0]])

    q = linear(x, Q, dequantized[Q])
    lm = torch.randn(16, dequantized[Q].shape[0], generator=torch.Generator().manual_seed(9))
    logits = linear(add(graph, "Relu", [q], "/model/layers.0/Relu", shape=q.shape), "lm_head", lm, out="logits")
    down = linear(x, DOWN, dequantized[DOWN], out="down")
    graph.outputs.extend([logits, down])
    return ir.Model(graph, ir_version=8), bindings


def float_weight(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1


def int4_checkpoint(group: int, symmetric: bool) -> FakeCheckpoint:
    """q_proj [48, K] and down_proj [K, K] in compressed-tensors pack-quantized form."""
    ckpt = FakeCheckpoint({})
    for seed, (base, n) in enumerate(((Q, 48), (DOWN, K))):
        q, scale, zp = rtn(float_weight(n, K, seed), Int4Spec(group, symmetric))
        ckpt.tensors |= {f"{base}.weight_packed": pack_int4(q), f"{base}.weight_scale": scale,
                         f"{base}.weight_shape": torch.tensor([n, K])}
        if not symmetric:
            ckpt.tensors[f"{base}.weight_zero_point"] = pack_int4(zp.to(torch.int8), dim=0)
        ckpt.quantized[f"{base}.weight"] = Int4Weight(f"{base}.weight", n, K, group, symmetric)
    return ckpt


def fp8_checkpoint(block: tuple[int, int]) -> FakeCheckpoint:
    """q_proj [40, K] and down_proj [20, K] in e4m3fn with bf16 block scales (Qwen's FP8 releases)."""
    ckpt = FakeCheckpoint({})
    for seed, (base, n) in enumerate(((Q, 40), (DOWN, 20))):
        q, scale = fp8.quantize(float_weight(n, K, seed), block)
        ckpt.tensors |= {f"{base}.weight": q, f"{base}.weight_scale_inv": scale.to(torch.bfloat16)}
        ckpt.quantized[f"{base}.weight"] = Fp8Weight(f"{base}.weight", n, K, block, f"{base}.weight_scale_inv")
    return ckpt


def dequantized(ckpt: FakeCheckpoint) -> dict[str, torch.Tensor]:
    """The linears' float weights: the checkpoint's, dequantised; a float model's own."""
    found = {q.base: q.dequantize(ckpt) for q in ckpt.quantized.values()}
    ckpt.reads.clear()
    return found or {Q: float_weight(48, K, 0), DOWN: float_weight(K, K, 1)}


def state_of(ckpt: FakeCheckpoint, dtype: torch.dtype = torch.float32) -> ConvertState:
    model, bindings = graph_of(dequantized(ckpt))
    return ConvertState(checkpoint=ckpt, weights=lazy_weights(dtype), bindings=bindings,  # type: ignore[arg-type]
                        graphs={"prefill": model}, facts={"graphs_legal"})


def feeds() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(0).standard_normal((1, T, K), dtype=np.float32)}


def reference(ckpt: FakeCheckpoint) -> list[np.ndarray]:
    model, _ = graph_of(dequantized(ckpt))
    return run(model, feeds())


# -- lower_int4 -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("group", "symmetric"), [(16, True), (32, False)])
def test_lower_int4_to_matmulnbits(tmp_path: Path, group: int, symmetric: bool) -> None:
    ckpt = int4_checkpoint(group, symmetric)
    expected = reference(ckpt)
    state = state_of(ckpt)
    model, weights, bindings = state.graphs["prefill"], state.weights, state.bindings  # type: ignore[index]

    assert set(LowerInt4.requires) <= state.filled()  # what the pipeline would hand it
    result = LowerInt4()(state, context(tmp_path))

    assert result.modified and result.stats == {"lowered": 2, "accuracy_level": 0}
    assert state.stacked_scales == {}
    assert op_counts(model) == {"MatMulNBits": 2, "MatMul": 1, "Relu": 1}
    assert model.opset_imports[MS_DOMAIN] == 1
    nbits = {n.name: n for n in model.graph if n.op_type == "MatMulNBits"}
    assert set(nbits) == {"/model/layers.0/self_attn/q_proj/MatMulNBits", "/model/layers.0/mlp/down_proj/MatMulNBits"}
    q_node = nbits["/model/layers.0/self_attn/q_proj/MatMulNBits"]
    assert q_node.domain == MS_DOMAIN
    assert {a: q_node.attributes[a].as_int() for a in ("K", "N", "bits", "block_size", "accuracy_level")} == {
        "K": K, "N": 48, "bits": 4, "block_size": group, "accuracy_level": 0}
    parts = [NBITS_WEIGHT, NBITS_SCALE] + ([] if symmetric else [NBITS_ZERO_POINT])
    assert [v.name for v in q_node.inputs[1:]] == [Q + p for p in parts]  # type: ignore[union-attr]
    assert list(q_node.inputs[1].shape) == [48, K // group, group // 2]  # type: ignore[union-attr, arg-type]
    assert sorted(model.graph.initializers) == sorted([*(b + p for b in (Q, DOWN) for p in parts), "lm_head.weight"])
    assert all(bindings[b + p] == WeightRef(b + p) and b + p in weights.derived  # type: ignore[index, union-attr]
               for b in (Q, DOWN) for p in parts)
    assert [v.name for v in model.graph.outputs] == ["logits", "down"]  # the output keeps its name
    assert ckpt.reads == []  # nothing read until write_onnx asks

    got = run(model, feeds(), weights, bindings)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-4)

    again = LowerInt4()(state, context(tmp_path))
    assert again.stats["lowered"] == 0 and op_counts(model) == {"MatMulNBits": 2, "MatMul": 1, "Relu": 1}


def test_lower_int4_fp16_scales_in_compute_dtype(tmp_path: Path) -> None:
    state = state_of(int4_checkpoint(16, True), torch.float16)
    LowerInt4(accuracy_level=4)(state, context(tmp_path))
    model = state.graphs["prefill"]  # type: ignore[index]
    assert model.graph.initializers[Q + NBITS_SCALE].dtype == ir.DataType.FLOAT16
    assert model.graph.initializers[Q + NBITS_WEIGHT].dtype == ir.DataType.UINT8
    assert {n.attributes["accuracy_level"].as_int() for n in model.graph if n.op_type == "MatMulNBits"} == {4}
    assert state.weights.derived[Q + NBITS_SCALE]().dtype == torch.float16  # type: ignore[union-attr]


def test_lower_int4_refuses_a_group_matmulnbits_cannot_take(tmp_path: Path) -> None:
    with pytest.raises(Qwen2omError, match=r"model.layers.0.self_attn.q_proj: MatMulNBits needs .* group 8"):
        LowerInt4()(state_of(int4_checkpoint(8, True)), context(tmp_path))


def test_lower_int4_leaves_fp8_and_float_models(tmp_path: Path) -> None:
    for ckpt in (fp8_checkpoint((16, 16)), FakeCheckpoint({})):
        state = state_of(ckpt)
        result = LowerInt4()(state, context(tmp_path))
        assert not result.modified and result.stats == {"lowered": 0}
        assert op_counts(state.graphs["prefill"]) == {"MatMul": 3, "Relu": 1}  # type: ignore[index]
        assert state.stacked_scales == {}  # started for the passes after it


# -- lower_fp8 -------------------------------------------------------------------------------------------
FP8_CHAIN = {"float8": ["Transpose", "Unsqueeze", "Expand", "Reshape", "Slice", "Cast", "Mul"],
             "bytes": ["Transpose", "Unsqueeze", "Expand", "Reshape", "Slice", "Cast", "Gather", "Mul"]}


@pytest.mark.parametrize("storage", ["float8", "bytes"])
def test_lower_fp8_dequantizes_in_the_graph(tmp_path: Path, storage: str) -> None:
    """Tiles of 16×48 on [40, 64] and [20, 64] weights: ragged both ways, so the tiling ends in a Slice."""
    ckpt = fp8_checkpoint((16, 48))
    expected = reference(ckpt)
    state = state_of(ckpt)
    model, weights, bindings = state.graphs["prefill"], state.weights, state.bindings  # type: ignore[index]

    assert set(LowerFp8.requires) <= state.filled()
    result = LowerFp8(storage=storage)(state, context(tmp_path))

    assert result.modified and result.stats == {"lowered": 2, "expert_stacks": 0, "storage": storage}
    assert state.stacked_scales == {}
    assert op_counts(model)["MatMul"] == 3  # the MatMuls stay; their weight is computed
    for base, n in ((Q, 40), (DOWN, 20)):
        chain = [node for node in model.graph if (node.name or "").startswith(f"/{base}/fp8/")]
        assert [node.op_type for node in chain] == FP8_CHAIN[storage], base
        assert [node.name for node in chain] == [f"/{base}/fp8/{node.op_type}_{i}" for i, node in enumerate(chain)]
        wq, scale = model.graph.initializers[base + WEIGHT_SUFFIX], model.graph.initializers[base + FP8_SCALE]
        assert wq.dtype == (ir.DataType.FLOAT8E4M3FN if storage == "float8" else ir.DataType.UINT8)
        assert list(wq.shape) == [K, n] and list(scale.shape) == [-(-n // 16), 2]  # type: ignore[arg-type]
        assert scale.dtype == ir.DataType.FLOAT and bindings[scale.name] == WeightRef(scale.name)  # type: ignore[index, arg-type]
        assert f"{base}.weight" not in model.graph.initializers
        matmul = next(node for node in model.graph if node.name == f"/{base.replace('.', '/')}/MatMul".replace(
            "layers/0", "layers.0"))
        assert matmul.inputs[1] is chain[-1].outputs[0]
    assert "lm_head.weight" in model.graph.initializers
    if storage == "float8":
        assert (model.opset_imports[""], model.ir_version) == (19, 9)
    else:
        assert (model.opset_imports[""], model.ir_version) == (18, 8)
        assert "/fp8/e4m3fn_table" in model.graph.initializers
    assert ckpt.reads == []

    got = run(model, feeds(), weights, bindings)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6)

    before = op_counts(model)
    again = LowerFp8(storage=storage)(state, context(tmp_path))
    assert again.stats["lowered"] == 0 and op_counts(model) == before


def test_lower_fp8_leaves_int4_and_float_models(tmp_path: Path) -> None:
    for ckpt in (int4_checkpoint(16, True), FakeCheckpoint({})):
        state = state_of(ckpt)
        result = LowerFp8()(state, context(tmp_path))
        assert not result.modified and result.stats == {"lowered": 0}
        assert op_counts(state.graphs["prefill"]) == {"MatMul": 3, "Relu": 1}  # type: ignore[index]
        assert state.stacked_scales == {}


def test_lower_fp8_refuses_an_unknown_storage() -> None:
    with pytest.raises(ValueError, match="storage must be one of float8, bytes"):
        LowerFp8(storage="int8")


def test_lower_fp8_on_a_real_checkpoint(tmp_path: Path, checkpoint: Callable[[str], Path]) -> None:
    """One projection of builtin:tiny-qwen3-fp8 as Checkpoint reads it: 128×128 tiles on a [64, 160]
    weight (one partial tile each way), bf16 scales."""
    from qwen2om.checkpoint import Checkpoint

    ckpt = Checkpoint(checkpoint("tiny-qwen3-fp8"))
    try:
        name = "model.layers.0.mlp.down_proj.weight"
        q: QuantWeight = ckpt.quantized[name]
        assert isinstance(q, Fp8Weight) and (q.n, q.k, q.block) == (64, 160, (128, 128))
        x = value("x", [1, 2, q.k])
        graph = ir.Graph([x], [], nodes=[], name="g", opset_imports={"": 18})
        init = constant(graph, name, q.dequantize(ckpt).T.contiguous().numpy())
        bindings = {name: WeightRef(name, transpose=True)}
        graph.outputs.append(add(graph, "MatMul", [x, init], "/model/layers.0/mlp/down_proj/MatMul", out="y",
                                 shape=[1, 2, q.n]))
        model = ir.Model(graph, ir_version=8)
        feed = {"x": np.random.default_rng(1).standard_normal((1, 2, q.k), dtype=np.float32)}
        expected = run(model, feed)[0]
        state = ConvertState(checkpoint=ckpt, weights=lazy_weights(), bindings=bindings, graphs={"decode": model},
                             facts={"graphs_legal"})
        assert LowerFp8()(state, context(tmp_path)).stats == {"lowered": 1, "expert_stacks": 0, "storage": "float8"}
        assert list(graph.initializers[q.base + FP8_SCALE].shape) == [1, 2]  # type: ignore[arg-type]
        np.testing.assert_allclose(run(model, feed, state.weights, bindings)[0], expected, rtol=1e-6, atol=1e-6)
    finally:
        ckpt.close()


# -- what the passes report on a second run ---------------------------------------------------------------
@pytest.mark.parametrize("lower", ["int4", "fp8"])
def test_second_run_reports_no_change(tmp_path: Path, lower: str) -> None:
    """They said modified=True whenever the checkpoint had weights of their kind, lowered or not."""
    ckpt = int4_checkpoint(16, True) if lower == "int4" else fp8_checkpoint((16, 16))
    state = state_of(ckpt)
    make = LowerInt4 if lower == "int4" else LowerFp8
    assert make()(state, context(tmp_path)).modified
    assert not make()(state, context(tmp_path)).modified
