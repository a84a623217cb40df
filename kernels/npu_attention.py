"""Reference kernel of the NPU's attention op as qwen2om emits it: `npu::NPUPromptFlashAttention`.

`npu::NPUPromptFlashAttention(query, key, value, pse_shift, atten_mask, actual_seq_lengths,
                              actual_seq_lengths_kv; num_heads, input_layout, scale_value, pre_tokens,
                              next_tokens, num_key_value_heads, sparse_mode, inner_precise)` → attention_out
(GE PromptFlashAttention; the parser plugin wires inputs in groups, so 7 are given, pse_shift empty)

    layout "BNSD": query [B, N, Sq, D], key / value [B, Nkv, Skv, D], out [B, N, Sq, D]
    query head h reads key/value head h // (N / Nkv)             (num_key_value_heads = Nkv; 0 means N)
    score[b, h, i, j] = scale_value · q[b, h, i] · k[b, h', j]    for key slots j < actual_seq_lengths_kv[b] only
    atten_mask[b, 0, i, j] true = masked: such scores become a large negative value before the softmax
    out[b, h, i] = softmax_j(score) · v[b, h', j], computed in float32, returned in query's dtype
    query rows i ≥ actual_seq_lengths[b] are not computed (zeros here)

Only `sparse_mode` 0 with `pre_tokens` / `next_tokens` at 2147483647 (the full mask applies; the
plugin's own default for an absent pre_tokens is 0, so qwen2om always writes both) is modelled, and
the BNSD layout. Key slots past the actual length are never read: that is what makes the kernel's
cost follow the filled cache, not its capacity. A fully masked row gets equal weights over the slots
read (every score the same large negative value), as the kernel's select-then-softmax does.
Sources: the table's `_constraints.ops.NPUPromptFlashAttention` (plugin, proto and op-info lines).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import TensorProto

from qwen2om.kernels.builder import Builder, attrs

DOMAIN = "npu"
PFA = "NPUPromptFlashAttention"
NO_LIMIT = 2147483647  # pre_tokens / next_tokens: the whole mask applies
MASKED = np.finfo(np.float32).min  # the select's "large negative value"


def prompt_flash_attention(query: np.ndarray, key: np.ndarray, value: np.ndarray, atten_mask: np.ndarray | None,
                           actual_seq_lengths: np.ndarray | None, actual_seq_lengths_kv: np.ndarray | None, *,
                           num_heads: int, scale_value: float = 1.0, input_layout: str = "BNSD",
                           num_key_value_heads: int = 0, sparse_mode: int = 0,
                           pre_tokens: int = NO_LIMIT, next_tokens: int = NO_LIMIT) -> np.ndarray:
    """attention_out [B, N, Sq, D] in query's dtype (layout BNSD, sparse_mode 0, no band)."""
    if input_layout != "BNSD" or sparse_mode != 0 or pre_tokens != NO_LIMIT or next_tokens != NO_LIMIT:
        raise NotImplementedError("only BNSD, sparse_mode 0 and pre/next_tokens 2147483647 are modelled")
    b, n, sq, d = query.shape
    nkv = num_key_value_heads or num_heads
    if n != num_heads or key.shape[1] != nkv or num_heads % nkv:
        raise ValueError(f"query has {n} heads, key {key.shape[1]}: num_heads {num_heads}, num_key_value_heads {nkv}")
    group = num_heads // nkv
    q = query.astype(np.float32)
    k = np.repeat(key.astype(np.float32), group, axis=1)
    v = np.repeat(value.astype(np.float32), group, axis=1)
    out = np.zeros((b, n, sq, d), np.float32)
    for i in range(b):
        kv_len = int(actual_seq_lengths_kv[i]) if actual_seq_lengths_kv is not None else key.shape[2]
        q_len = int(actual_seq_lengths[i]) if actual_seq_lengths is not None else sq
        if kv_len == 0:
            continue
        scores = np.float32(scale_value) * (q[i, :, :q_len] @ k[i, :, :kv_len].transpose(0, 2, 1))
        if atten_mask is not None:
            masked = np.broadcast_to(atten_mask[i if atten_mask.shape[0] > 1 else 0, 0, :q_len, :kv_len].astype(bool),
                                     scores.shape)
            scores = np.where(masked, MASKED, scores)
        scores = scores - scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        out[i, :, :q_len] = probs @ v[i, :, :kv_len]
    return out.astype(query.dtype)


def decompose_pfa(b: Builder, node: onnx.NodeProto, types: Mapping[str, int]) -> None:
    """Standard ops: every key slot is scored (a CPU needs no savings), the ones past the actual
    length masked like the mask's own, which gives the kernel's result on the slots it reads."""
    a = attrs(node)
    if a.get("input_layout", b"BNSD") not in (b"BNSD", "BNSD") or int(a.get("sparse_mode", 0)):  # type: ignore[call-overload]
        raise NotImplementedError(f"{node.name}: only the BNSD layout with sparse_mode 0 has a decomposition")
    heads = int(a["num_heads"])  # type: ignore[call-overload]
    kv_heads = int(a.get("num_key_value_heads", 0)) or heads  # type: ignore[call-overload]
    scale = float(a.get("scale_value", 1.0))  # type: ignore[arg-type]
    query, key, value, _pse, mask, q_lens, kv_lens = [*node.input, *[""] * 7][:7]
    out_type = types.get(query, TensorProto.FLOAT16)
    group = heads // kv_heads

    def heads_of(x: str) -> str:  # [B, Nkv, S, D] → [B, N, S, D], head h reading h // group
        x = b.op("Cast", x, to=TensorProto.FLOAT)
        if group == 1:
            return x
        x = b.op("Unsqueeze", x, b.const(np.array([2])))
        x = b.op("Expand", x, b.const(np.array([1, 1, group, 1, 1])))
        d = b.op("Slice", b.op("Shape", key), b.const(np.array([3])), b.const(np.array([4])))
        return b.op("Reshape", x, b.op("Concat", b.const(np.array([0, heads, -1])), d, axis=0))

    k, v = heads_of(key), heads_of(value)
    q = b.op("Cast", query, to=TensorProto.FLOAT)
    scores = b.op("MatMul", q, b.op("Transpose", k, perm=[0, 1, 3, 2]))
    scores = b.op("Mul", scores, b.const(np.array(scale, np.float32)))
    # key slots j ≥ actual_seq_lengths_kv[b] are not read: masked here
    slots = b.op("Range", b.const(np.array(0)), b.op("Gather", b.op("Shape", k), b.const(np.array(2))),
                 b.const(np.array(1)))
    unread = b.op("GreaterOrEqual", b.op("Reshape", slots, b.const(np.array([1, 1, 1, -1]))),
                  b.op("Reshape", kv_lens, b.const(np.array([-1, 1, 1, 1]))))
    if mask:
        scores = b.op("Where", b.op("Cast", mask, to=TensorProto.BOOL), b.const(np.array(MASKED, np.float32)), scores)
    # −inf, not MASKED: a fully masked row spreads over the slots read, as the kernel's does (a row
    # with no slot read at all, actual length 0, would be NaN here; qwen2om's lengths are ≥ 1)
    scores = b.op("Where", unread, b.const(np.array(-np.inf, np.float32)), scores)
    out = b.op("MatMul", b.op("Softmax", scores, axis=-1), v)
    if q_lens:  # rows past the query's actual length are not computed
        rows = b.op("Range", b.const(np.array(0)), b.op("Gather", b.op("Shape", q), b.const(np.array(2))),
                    b.const(np.array(1)))
        live = b.op("Less", b.op("Reshape", rows, b.const(np.array([1, 1, -1, 1]))),
                    b.op("Reshape", q_lens, b.const(np.array([-1, 1, 1, 1]))))
        out = b.op("Where", live, out, b.const(np.array(0, np.float32)))
    b.op("Cast", out, out=node.output[0], to=out_type)


DECOMPOSE = {(DOMAIN, PFA): decompose_pfa}
