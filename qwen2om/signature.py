"""Names, shapes and roles of the static graph's inputs and outputs (the DESIGN.md contract)."""

from __future__ import annotations

import dataclasses

from qwen2om.arch import ModelDims
from qwen2om.stages import Stage

# Roles a runtime (or `inspect`) keys on; never rename these, run.py reads them from the manifest.
ROLE_IDS, ROLE_MASK, ROLE_POSITIONS = "ids", "mask", "positions"
ROLE_PAST_KEY, ROLE_PAST_VALUE = "past_key", "past_value"
ROLE_LOGITS, ROLE_PRESENT_KEY, ROLE_PRESENT_VALUE = "logits", "present_key", "present_value"
# Hybrids' linear-attention layers: the whole state in, the whole updated state out.
ROLE_CONV_STATE, ROLE_RECURRENT_STATE = "conv_state", "recurrent_state"
ROLE_PRESENT_CONV_STATE, ROLE_PRESENT_RECURRENT_STATE = "present_conv_state", "present_recurrent_state"
ROLE_SCALE = "scale"  # a quantisation scale fed as an input (`scales: inputs`), values in scales.safetensors
# ONNX Runtime decode graphs (fuse_attention): the attention kernel's whole cache out, [B, H, P, D]. The runtime
# binds it to the same buffer as the past input, so the kernel reads the cache in place and writes only the
# new token's slot; the new K/V still come out as present_key/value and the runtime still owns the slots.
ROLE_CACHE_KEY, ROLE_CACHE_VALUE = "cache_key", "cache_value"
# Pipeline stages (qwen2om/stages.py): a stage after the first takes the hidden states [B, T, hidden] the
# stage before it returns, in place of the ids; a stage before the last returns them in place of logits.
ROLE_HIDDEN_IN, ROLE_HIDDEN_OUT = "hidden_in", "hidden_out"
HIDDEN_IN, HIDDEN_OUT = "hidden_in", "hidden_out"  # their names in the graphs


@dataclasses.dataclass(frozen=True)
class IOSpec:
    name: str
    dtype: str  # numpy dtype name
    shape: tuple[int, ...]
    role: str
    layer: int | None = None

    def to_dict(self) -> dict[str, object]:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        return {k: v for k, v in d.items() if v is not None}


def token_axes(role: str, shape: tuple[int, ...] | list[int], tokens: int) -> dict[int, int]:
    """The axes of an input or output that grow with the call's token count T, each as axis → offset
    (the axis holds T + offset): ids and positions [B, T], the mask [B, 1, T, P + T], the new K/V
    [B, H, T, D], and logits when all T positions are returned. A graph exported for prefill gears
    has these axes symbolic, ATC's --input_shape writes them as -1 and each --dynamic_dims gear lists
    their values in input order (run.py's `shape_at` applies the same rule)."""
    if role in (ROLE_IDS, ROLE_POSITIONS, ROLE_HIDDEN_IN, ROLE_HIDDEN_OUT):
        return {1: 0}
    if role == ROLE_MASK:
        return {2: 0, 3: int(shape[3]) - tokens}
    if role in (ROLE_PRESENT_KEY, ROLE_PRESENT_VALUE):
        return {2: 0}
    if role == ROLE_LOGITS and tokens > 1 and int(shape[1]) == tokens:
        return {1: 0}
    return {}


def graph_io(d: ModelDims, *, batch: int, t: int, capacity: int, dtype: str,
             logits_t: int, stage: Stage | None = None) -> tuple[list[IOSpec], list[IOSpec]]:
    """Inputs and outputs of one call shape: T new tokens into a cache of capacity P (BNSD).

    With a `stage` (qwen2om/stages.py), only its layers' caches and states; a stage after the first takes
    `hidden_in` [B, T, hidden] (compute dtype) in place of the ids, and a stage before the last returns
    `hidden_out` [B, T, hidden] (all T: the next stage needs every position) in place of the logits.

    A hybrid's linear-attention layer takes `conv_state.{i}` [B, K-1, conv_dim] (compute dtype) and
    `recurrent_state.{i}` [B, Hv, dk, dv] (float32) where a full-attention layer takes its K/V, and
    returns their updated values, `present_conv_state.{i}` / `present_recurrent_state.{i}`, whole."""
    kv = (batch, d.kv_heads, capacity, d.head_dim)
    new_kv = (batch, d.kv_heads, t, d.head_dim)
    stage = stage or Stage.whole(d.layers)
    inputs = [
        IOSpec("input_ids", "int64", (batch, t), ROLE_IDS) if stage.first else
        IOSpec(HIDDEN_IN, dtype, (batch, t, d.hidden), ROLE_HIDDEN_IN),
        IOSpec("attention_mask", dtype, (batch, 1, t, capacity + t), ROLE_MASK),
        IOSpec("position_ids", "int64", (batch, t), ROLE_POSITIONS),
    ]
    outputs = [IOSpec("logits", "float32", (batch, logits_t, d.vocab), ROLE_LOGITS) if stage.last else
               IOSpec(HIDDEN_OUT, dtype, (batch, t, d.hidden), ROLE_HIDDEN_OUT)]
    for i in stage.layers:
        if d.is_linear(i):
            conv = (batch, d.conv_kernel - 1, d.conv_dim)
            rec = (batch, d.lin_v_heads, d.lin_k_dim, d.lin_v_dim)
            inputs += [IOSpec(f"conv_state.{i}", dtype, conv, ROLE_CONV_STATE, i),
                       IOSpec(f"recurrent_state.{i}", "float32", rec, ROLE_RECURRENT_STATE, i)]
            outputs += [IOSpec(f"present_conv_state.{i}", dtype, conv, ROLE_PRESENT_CONV_STATE, i),
                        IOSpec(f"present_recurrent_state.{i}", "float32", rec, ROLE_PRESENT_RECURRENT_STATE, i)]
            continue
        inputs += [IOSpec(f"past_key.{i}", dtype, kv, ROLE_PAST_KEY, i),
                   IOSpec(f"past_value.{i}", dtype, kv, ROLE_PAST_VALUE, i)]
        outputs += [IOSpec(f"present_key.{i}", dtype, new_kv, ROLE_PRESENT_KEY, i),
                    IOSpec(f"present_value.{i}", dtype, new_kv, ROLE_PRESENT_VALUE, i)]
    return inputs, outputs
