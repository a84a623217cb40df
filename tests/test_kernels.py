"""Reference kernels for the Ascend ops (kernels/ascend.py): the documented formulas, and the
standard-op decompositions that run Ascend-bound graphs on ONNX Runtime, checked against them."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qwen2om.kernels.ascend import (
    NPU_DOMAIN,
    ascend_anti_quant,
    ascend_quant,
    decompose,
    pack_int4_int32,
    unpack_int4_int32,
    weight_quant_batch_matmul_v2,
)

RNG = np.random.default_rng(0)


def test_int4_packing_round_trips_and_orders_nibbles() -> None:
    q = np.array([[1, -1, 7, -8, 0, 2, -3, 4, 5]], dtype=np.int8)  # N = 9: a second, padded word
    packed = pack_int4_int32(q)
    assert packed.dtype == np.int32 and packed.shape == (1, 2)
    # value j in bits 4j..4j+3, two's complement nibbles: 1, 0xF, 7, 8, 0, 2, 0xD, 4
    assert packed[0, 0].view(np.uint32) == 0x4D2087F1 and packed[0, 1] == 5
    assert np.array_equal(unpack_int4_int32(packed, 9), q)
    big = RNG.integers(-8, 8, (5, 24)).astype(np.int8)
    assert np.array_equal(unpack_int4_int32(pack_int4_int32(big), 24), big)
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4_int32(np.array([[8]]))


def test_weight_quant_batch_matmul_formula_by_hand() -> None:
    """y = x @ ((w + offset) · scale): K = 3 in groups of 2 (the last group partial), offsets negative."""
    w = np.array([[1, -2], [3, 4], [-5, 6]], dtype=np.int8)  # [K=3, N=2]
    scale = np.array([[0.5, 2.0], [0.25, 1.0]], dtype=np.float16)  # [⌈3/2⌉, N]
    offset = np.array([[-1, 0], [-2, 3]], dtype=np.float16)
    x = np.array([[1.0, 2.0, 3.0]], dtype=np.float16)
    # dequantised: rows 0-1 use group 0, row 2 group 1
    deq = np.array([[(1 - 1) * 0.5, (-2 + 0) * 2.0], [(3 - 1) * 0.5, (4 + 0) * 2.0], [(-5 - 2) * 0.25, (6 + 3) * 1.0]])
    want = x.astype(np.float32) @ deq
    for weight, n in ((w, None), (pack_int4_int32(w), 2)):
        y = weight_quant_batch_matmul_v2(x, weight, scale, offset, antiquant_group_size=2, n=n)
        assert y.dtype == np.float16 and np.allclose(y.astype(np.float32), want, atol=1e-3)
    per_channel = weight_quant_batch_matmul_v2(x, w, np.array([2.0, 0.5], np.float16), bias=np.array([1.0, -1.0]))
    assert np.allclose(per_channel.astype(np.float32), x.astype(np.float32) @ (w * [2.0, 0.5]) + [1.0, -1.0])


def ascend_model(node: onnx.NodeProto, inputs: list[onnx.ValueInfoProto], out_type: int, out_shape: list[int],
                 inits: dict[str, np.ndarray]) -> onnx.ModelProto:
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", out_type, out_shape)],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(NPU_DOMAIN, 1)],
                             ir_version=8)


def run_decomposed(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    assert decompose(model) == 1
    assert not {n.op_type for n in model.graph.node} & {"WeightQuantBatchMatmulV2", "AscendAntiQuant"}
    onnx.checker.check_model(model, full_check=True)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


@pytest.mark.parametrize(("k", "n", "group", "packed", "with_offset"), [
    (64, 16, 32, True, False),   # symmetric int4, per group
    (70, 24, 16, True, True),    # K not a multiple of the group: the last group partial; negative offsets
    (21, 8, 7, False, True),     # odd group size, int8 storage
    (32, 12, 0, True, True),     # per channel (group 0); N not a multiple of 8: the last word padded
])
@pytest.mark.numerics
def test_wqbmm_decomposition_matches_reference(k: int, n: int, group: int, packed: bool, with_offset: bool) -> None:
    q = RNG.integers(-8, 8, (k, n)).astype(np.int8)
    groups = 1 if group == 0 else -(-k // group)
    scale = (RNG.random((groups, n)) * 0.1 + 0.01).astype(np.float16)
    offset = RNG.integers(-8, 8, (groups, n)).astype(np.float16) if with_offset else None
    bias = RNG.standard_normal(n).astype(np.float16)
    x = RNG.standard_normal((1, 3, k)).astype(np.float16)
    weight = pack_int4_int32(q) if packed else q
    inits = {"w": weight, "s": scale, "b": bias} | ({"o": offset} if offset is not None else {})
    node = helper.make_node("WeightQuantBatchMatmulV2", ["x", "w", "s", "o" if with_offset else "", "", "", "b"],
                            ["y"], domain=NPU_DOMAIN, antiquant_group_size=group, dtype=-1, name="mm")
    model = ascend_model(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 3, k])],
                         TensorProto.FLOAT16, [1, 3, n], inits)
    got = run_decomposed(model, {"x": x})
    want = weight_quant_batch_matmul_v2(x, weight, scale, offset, bias=bias, antiquant_group_size=group, n=n)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize(("offset", "sqrt_mode", "dtype"), [(0.0, False, 1), (-3.0, False, 0), (2.0, True, 1)])
def test_antiquant(offset: float, sqrt_mode: bool, dtype: int) -> None:
    x = np.arange(-128, 128, dtype=np.int8).reshape(16, 16)
    y = ascend_anti_quant(x, scale=0.5, offset=offset, dtype=dtype, sqrt_mode=sqrt_mode)
    s = 0.25 if sqrt_mode else 0.5
    assert np.array_equal(y, ((x.astype(np.float32) - offset) * s).astype(y.dtype))
    node = helper.make_node("AscendAntiQuant", ["x"], ["y"], scale=0.5, offset=offset, dtype=dtype,
                            sqrt_mode=int(sqrt_mode), name="aq")
    out_type = TensorProto.FLOAT16 if dtype == 1 else TensorProto.FLOAT
    model = ascend_model(node, [helper.make_tensor_value_info("x", TensorProto.INT8, [16, 16])], out_type, [16, 16], {})
    assert np.array_equal(run_decomposed(model, {"x": x}), y)


@pytest.mark.numerics
def test_quant_rounds_half_even_and_saturates() -> None:
    x = np.array([0.5, 1.5, -2.5, 1000.0, -1000.0, 3.2], dtype=np.float32)
    assert ascend_quant(x, scale=1.0).tolist() == [0, 2, -2, 127, -128, 3]
    assert ascend_quant(x[:1], scale=2.0, offset=1.0, sqrt_mode=True).tolist() == [3]
