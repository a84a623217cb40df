"""Names, shapes and roles of the static graph's inputs and outputs (the DESIGN.md contract)."""

from __future__ import annotations

import dataclasses

from qwen2om.arch import ModelDims

# Roles a runtime (or `inspect`) keys on; never rename these, run.py reads them from the manifest.
ROLE_IDS, ROLE_MASK, ROLE_POSITIONS = "ids", "mask", "positions"
ROLE_PAST_KEY, ROLE_PAST_VALUE = "past_key", "past_value"
ROLE_LOGITS, ROLE_PRESENT_KEY, ROLE_PRESENT_VALUE = "logits", "present_key", "present_value"
ROLE_SCALE = "scale"  # a quantisation scale fed as an input (`scales: inputs`), values in scales.safetensors


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


def graph_io(d: ModelDims, *, batch: int, t: int, capacity: int, dtype: str,
             logits_t: int) -> tuple[list[IOSpec], list[IOSpec]]:
    """Inputs and outputs of one call shape: T new tokens into a cache of capacity P (BNSD)."""
    kv = (batch, d.kv_heads, capacity, d.head_dim)
    new_kv = (batch, d.kv_heads, t, d.head_dim)
    inputs = [
        IOSpec("input_ids", "int64", (batch, t), ROLE_IDS),
        IOSpec("attention_mask", dtype, (batch, 1, t, capacity + t), ROLE_MASK),
        IOSpec("position_ids", "int64", (batch, t), ROLE_POSITIONS),
    ]
    outputs = [IOSpec("logits", "float32", (batch, logits_t, d.vocab), ROLE_LOGITS)]
    for i in range(d.layers):
        inputs += [IOSpec(f"past_key.{i}", dtype, kv, ROLE_PAST_KEY, i),
                   IOSpec(f"past_value.{i}", dtype, kv, ROLE_PAST_VALUE, i)]
        outputs += [IOSpec(f"present_key.{i}", dtype, new_kv, ROLE_PRESENT_KEY, i),
                    IOSpec(f"present_value.{i}", dtype, new_kv, ROLE_PRESENT_VALUE, i)]
    return inputs, outputs
