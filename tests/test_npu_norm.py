"""The NPU's RMSNorm kernels as qwen2om emits them (npu::NPURmsNorm, npu::NPUAddRmsNorm): the NumPy
references against transformers' own Qwen norms (the unfused forms they replace), and the ONNX
decompositions verify runs on CPU against the references."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

from qwen2om.kernels.ascend import decompose
from qwen2om.kernels.npu_norm import EPSILON, add_rms_norm, rms_norm

H = 64


def data(dtype: type, seed: int, shape: tuple[int, ...] = (2, 3, H)) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x1 = (3 * rng.standard_normal(shape)).astype(dtype)
    x2 = rng.standard_normal(shape).astype(dtype)
    w = (1 + 0.2 * rng.standard_normal(shape[-1])).astype(dtype)
    return x1, x2, w


def hf_qwen3(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    norm = Qwen3RMSNorm(w.shape[-1], eps=EPSILON).to(torch.float16 if w.dtype == np.float16 else torch.float32)
    norm.weight.data = torch.from_numpy(w)
    return norm(torch.from_numpy(x)).detach().numpy()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_add_rms_norm_is_transformers_residual_then_norm(dtype: type) -> None:
    """AddRmsNorm rounds as Hugging Face's Qwen3RMSNorm does (x·rstd to x's dtype, then · w): in fp16
    the fused op and the unfused pair agree to the last bit but for rsqrt's own rounding."""
    x1, x2, w = data(dtype, 0)
    y, rstd, x = add_rms_norm(x1, x2, w)
    np.testing.assert_array_equal(x, (x1.astype(np.float32) + x2.astype(np.float32)).astype(dtype))
    want = hf_qwen3(x, w)
    ulp = 1e-3 if dtype == np.float16 else 1e-6  # one fp16 ulp at |y| ≲ 4, from rsqrt vs 1/sqrt
    np.testing.assert_allclose(y.astype(np.float32), want.astype(np.float32), rtol=ulp, atol=ulp * 4)
    assert rstd.dtype == np.float32 and rstd.shape == (*x.shape[:-1], 1)


def test_rms_norm_rounds_once() -> None:
    """RmsNorm multiplies by gamma in float32 before its one rounding: within one fp16 ulp of
    transformers' two roundings, and exactly the float32 result rounded."""
    x, _, w = data(np.float16, 1)
    y, rstd = rms_norm(x, w)
    xf = x.astype(np.float64)
    exact = xf / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + EPSILON) * w.astype(np.float64)
    np.testing.assert_allclose(y.astype(np.float64), exact, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(y.astype(np.float32), hf_qwen3(x, w).astype(np.float32), rtol=2e-3, atol=4e-3)


def test_zero_centred_norm_with_a_float32_gamma_is_the_hybrids_norm() -> None:
    """Qwen3.5 / Qwen3-Next compute x·rstd·(1 + w) in float32 and round once: RmsNorm with gamma = 1 + w
    in float32 (which 910B's kernel takes with fp16 x) is the same computation."""
    x, _, w = data(np.float16, 2)
    w = (0.1 * w).astype(np.float32)
    norm = Qwen3NextRMSNorm(H, eps=EPSILON).to(torch.float32)
    norm.weight.data = torch.from_numpy(w)
    want = norm(torch.from_numpy(x)).detach().numpy()
    y, _ = rms_norm(x, 1 + w)
    assert y.dtype == np.float16
    np.testing.assert_allclose(y.astype(np.float32), want.astype(np.float32), rtol=1e-3, atol=2e-3)


def norm_model(op: str, x_type: int, gamma_type: int, shape: list[int]) -> onnx.ModelProto:
    names = ["x1", "x2", "gamma"] if op == "NPUAddRmsNorm" else ["x1", "gamma"]
    outs = ["y", "rstd", "x"] if op == "NPUAddRmsNorm" else ["y", "rstd"]
    inputs = [helper.make_tensor_value_info(n, gamma_type if n == "gamma" else x_type,
                                            shape[-1:] if n == "gamma" else shape) for n in names]
    outputs = [helper.make_tensor_value_info(o, TensorProto.FLOAT if o == "rstd" else x_type, [None] * len(shape))
               for o in outs]
    node = helper.make_node(op, names, outs, domain="npu", name=op)
    graph = helper.make_graph([node], "norm", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("npu", 1)],
                             ir_version=8)


@pytest.mark.parametrize(("op", "x_type", "gamma_type"), [
    ("NPURmsNorm", TensorProto.FLOAT16, TensorProto.FLOAT16), ("NPURmsNorm", TensorProto.FLOAT16, TensorProto.FLOAT),
    ("NPURmsNorm", TensorProto.FLOAT, TensorProto.FLOAT), ("NPUAddRmsNorm", TensorProto.FLOAT16, TensorProto.FLOAT16),
    ("NPUAddRmsNorm", TensorProto.FLOAT, TensorProto.FLOAT)])
def test_decomposition_equals_the_reference(op: str, x_type: int, gamma_type: int) -> None:
    """How verify runs a fused graph on CPU: each decomposition in ONNX Runtime against the reference,
    the same roundings in the same order (q/k norms' [B, T, N, D] shape included). fp16 outputs may
    differ by one ulp: ONNX Runtime's ReduceMean and NumPy's mean sum in different orders, and an rstd
    one float32 ulp apart can round x·rstd to the neighbouring fp16 value before the · gamma. And
    ONNX Runtime's CPU runs an fp16 Add in float32 between Casts it inserts, then drops the Cast pair
    after it (even with graph optimisations off): AddRmsNorm's decomposition normalises the unrounded
    sum, so its fp16 rstd is compared at that rounding's size (2e-4 relative on these values)."""
    shape = [2, 3, 4, 32] if op == "NPURmsNorm" else [2, 5, H]
    np_x = np.float16 if x_type == TensorProto.FLOAT16 else np.float32
    x1, x2, w = data(np_x, 3, tuple(shape))
    w = w.astype(np.float32 if gamma_type == TensorProto.FLOAT else np_x)
    model = norm_model(op, x_type, gamma_type, shape)
    assert decompose(model) == 1
    onnx.checker.check_model(model)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"x1": x1, "x2": x2, "gamma": w} if op == "NPUAddRmsNorm" else {"x1": x1, "gamma": w}
    got = sess.run(None, feeds)
    want = add_rms_norm(x1, x2, w) if op == "NPUAddRmsNorm" else rms_norm(x1, w)
    for g, e in zip(got, want, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        fp16 = g.dtype == np.float16
        rtol = 1.5e-3 if fp16 else 2e-4 if x_type == TensorProto.FLOAT16 and g.shape[-1] == 1 else 1e-6
        np.testing.assert_allclose(g.astype(np.float32), e.astype(np.float32), rtol=rtol,
                                   atol=1e-3 if fp16 else 1e-6)
