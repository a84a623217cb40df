"""The NPU attention kernel qwen2om emits (npu::NPUPromptFlashAttention): its NumPy reference against
the unfused subgraph it replaces (static_model.CacheAttention), its ONNX decomposition against the
reference, and the pass's construction (new tokens first, lengths from the mask) on small graphs."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from qwen2om.arch import ModelDims
from qwen2om.kernels.ascend import decompose
from qwen2om.kernels.npu_attention import NO_LIMIT, PFA, prompt_flash_attention
from qwen2om.static_model import CacheAttention

MIN16 = float(np.finfo(np.float16).min)


def dims(heads: int, kv_heads: int, d: int) -> ModelDims:
    """Only what CacheAttention reads."""
    return ModelDims(hidden=heads * d, layers=1, heads=heads, kv_heads=kv_heads, head_dim=d, intermediate=1, vocab=1,
                     rms_eps=1e-6, tied=False, max_positions=1)


def case(b: int, heads: int, kv_heads: int, t: int, p: int, d: int, filled: list[int], seed: int,
         holes: bool = False) -> dict[str, np.ndarray]:
    """Random q/k/v/cache and the graph's additive mask: row i has `filled[i]` cache slots (some of them
    masked when `holes`) and causal attention inside the chunk."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, heads, t, d)).astype(np.float32)
    k, v = (rng.standard_normal((b, kv_heads, t, d)).astype(np.float32) for _ in range(2))
    past_k, past_v = (rng.standard_normal((b, kv_heads, p, d)).astype(np.float32) for _ in range(2))
    mask = np.full((b, 1, t, p + t), MIN16, np.float32)
    for i, n in enumerate(filled):
        mask[i, 0, :, :n] = 0.0
        if holes and n > 2:
            mask[i, 0, :, rng.choice(n - 1, size=max(1, n // 3), replace=False)] = MIN16
        for j in range(t):
            mask[i, 0, j, p:p + j + 1] = 0.0
    return {"q": q, "k": k, "v": v, "past_k": past_k, "past_v": past_v, "mask": mask}


def fused_inputs(c: dict[str, np.ndarray], filled: list[int]) -> tuple[np.ndarray, ...]:
    """What fuse_attention_ascend hands the kernel: K/V with the new tokens first, mask′ in that column
    order as booleans, query lengths T and key lengths L + T."""
    t, p = c["q"].shape[2], c["past_k"].shape[2]
    key = np.concatenate([c["k"], c["past_k"]], axis=2)
    value = np.concatenate([c["v"], c["past_v"]], axis=2)
    columns = np.concatenate([c["mask"][..., p:], c["mask"][..., :p]], axis=3)
    masked = columns <= MIN16 / 2
    b = key.shape[0]
    return key, value, masked, np.full(b, t, np.int64), np.array(filled, np.int64) + t


def unfused(c: dict[str, np.ndarray], heads: int, kv_heads: int) -> np.ndarray:
    """The portable form, [B, T, N·D] → [B, N, T, D]."""
    d = c["q"].shape[3]
    out = CacheAttention(dims(heads, kv_heads, d))(*(torch.from_numpy(c[n]) for n in
                                                       ("q", "k", "v", "mask", "past_k", "past_v")))
    b, t = c["q"].shape[0], c["q"].shape[2]
    return out.reshape(b, t, heads, d).transpose(1, 2).numpy()


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (8, 1), (16, 2)])
@pytest.mark.parametrize(("t", "filled", "holes"), [(1, [5], False), (1, [9, 3], True), (6, [0], False),
                                                    (6, [7, 12], True)])
def test_reference_equals_the_unfused_subgraph(heads: int, kv_heads: int, t: int, filled: list[int],
                                               holes: bool) -> None:
    """GQA ratios 1, 2, 8, 8; decode and a chunk with a cache; rows of different lengths; holes."""
    c = case(len(filled), heads, kv_heads, t, p=16, d=8, filled=filled, seed=heads * 10 + t, holes=holes)
    key, value, masked, q_len, kv_len = fused_inputs(c, filled)
    got = prompt_flash_attention(c["q"], key, value, masked, q_len, kv_len, num_heads=heads,
                                 scale_value=8 ** -0.5, num_key_value_heads=kv_heads)
    np.testing.assert_allclose(got, unfused(c, heads, kv_heads), rtol=1e-5, atol=1e-5)


def test_slots_past_the_length_are_never_read() -> None:
    """What the fused form buys: cache slots at L and beyond do not change the result (NaN there too)."""
    c = case(1, 4, 2, 1, p=16, d=8, filled=[5], seed=1)
    key, value, masked, q_len, kv_len = fused_inputs(c, [5])
    before = prompt_flash_attention(c["q"], key, value, masked, q_len, kv_len, num_heads=4, num_key_value_heads=2)
    key[:, :, 1 + 5:], value[:, :, 1 + 5:] = np.nan, np.nan
    after = prompt_flash_attention(c["q"], key, value, masked, q_len, kv_len, num_heads=4, num_key_value_heads=2)
    np.testing.assert_array_equal(before, after)


def pfa_model(b: int, heads: int, kv_heads: int, t: int, s: int, d: int, dtype: int) -> onnx.ModelProto:
    node = helper.make_node(PFA, ["q", "k", "v", "", "mask", "q_len", "kv_len"], ["out"], domain="npu", name="pfa",
                            num_heads=heads, input_layout="BNSD", scale_value=d ** -0.5, pre_tokens=NO_LIMIT,
                            next_tokens=NO_LIMIT, num_key_value_heads=kv_heads, sparse_mode=0, inner_precise=0)
    inputs = [helper.make_tensor_value_info("q", dtype, [b, heads, t, d]),
              helper.make_tensor_value_info("k", dtype, [b, kv_heads, s, d]),
              helper.make_tensor_value_info("v", dtype, [b, kv_heads, s, d]),
              helper.make_tensor_value_info("mask", TensorProto.BOOL, [b, 1, t, s]),
              helper.make_tensor_value_info("q_len", TensorProto.INT64, [b]),
              helper.make_tensor_value_info("kv_len", TensorProto.INT64, [b])]
    graph = helper.make_graph([node], "pfa", inputs, [helper.make_tensor_value_info("out", dtype, [b, heads, t, d])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("npu", 1)],
                             ir_version=8)


@pytest.mark.parametrize(("dtype", "np_dtype", "tol"), [(TensorProto.FLOAT, np.float32, 1e-6),
                                                        (TensorProto.FLOAT16, np.float16, 2e-3)])
@pytest.mark.parametrize(("heads", "kv_heads", "t", "filled"), [(4, 2, 1, [3, 9]), (8, 1, 5, [0, 11]),
                                                                (4, 4, 5, [6])])
def test_decomposition_equals_the_reference(dtype: int, np_dtype: type, tol: float, heads: int, kv_heads: int,
                                            t: int, filled: list[int]) -> None:
    """How verify runs the fused graph on CPU: the decomposition in ONNX Runtime, against the reference."""
    c = case(len(filled), heads, kv_heads, t, p=12, d=8, filled=filled, seed=7, holes=True)
    key, value, masked, q_len, kv_len = fused_inputs(c, filled)
    q, key, value = (x.astype(np_dtype) for x in (c["q"], key, value))
    model = pfa_model(len(filled), heads, kv_heads, t, key.shape[2], 8, dtype)
    assert decompose(model) == 1 and not any(n.domain == "npu" for n in model.graph.node)
    onnx.checker.check_model(model)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"q": q, "k": key, "v": value, "mask": masked, "q_len": q_len, "kv_len": kv_len})[0]
    want = prompt_flash_attention(q, key, value, masked, q_len, kv_len, num_heads=heads, scale_value=8 ** -0.5,
                                  num_key_value_heads=kv_heads)
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=tol, atol=tol)
