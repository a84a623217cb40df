"""The conversion state: what passes read and fill, as typed fields and named facts.

A *field* holds a value a pass builds (the checkpoint, the graphs, their signatures…); it is empty
(None) until the pass that produces it has run. A *fact* is something established about the
state that no field shows: "the graphs are legal for the targets' opsets", "FP8 weights are in
their final form". Passes declare both in `requires` / `produces` (and the fields they change in
place in `modifies`); qwen2om/pipeline.py checks a plan against these declarations before any work.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from qwen2om.errors import PlanError

if TYPE_CHECKING:
    from pathlib import Path

    import onnx_ir as ir
    import torch

    from qwen2om.checkpoint import Checkpoint
    from qwen2om.signature import IOSpec
    from qwen2om.weights import WeightRef, Weights

Signatures = dict[str, tuple[list["IOSpec"], list["IOSpec"]]]

# Every fact a pass may require or produce, with what it promises. A declaration naming anything
# else is refused when the pass registers.
FACTS: dict[str, str] = {
    "weights_checked": "every tensor the config expects is in the checkpoint, with its shape and dtype",
    "scales_checked": "quantisation scales are finite, positive and in the target's range",
    "graphs_legal": "graphs are at the targets' IR version and opset, nodes named after modules, no bf16",
    "int4_lowered": "int4 weights are in their final graph form (their scales are initializers of the graph)",
    "fp8_lowered": "FP8 weights are in their final graph form (their block scales are initializers of the graph)",
    "topk_lowered": "MoE routing's TopK is in a form ATC takes",
    "moe_fused": "MoE routing / routed experts are the target's fused kernels (ONNX Runtime MoE; the NPU's "
                 "MoeGatingTopKSoftmax) where the pattern matched",
    "attention_fused": "attention is the target's fused kernel (ONNX Runtime GroupQueryAttention; the NPU's "
                       "PromptFlashAttention) where the pattern matched",
    "rope_fused": "RoPE is the target's rotary kernel where the pattern matched",
    "norms_fused": "residual Add + RMSNorm are the target's fused norm (ONNX Runtime SkipSimplifiedLayerNormalization; "
                   "the NPU's AddRmsNorm / RmsNorm) where matched",
    "int4_fused": "int4 MatMuls sharing an input are one MatMulNBits",
    "ascend_checked": "graphs pass the ATC legality checker",
    "outputs_checked": "the written graphs load in ONNX Runtime and match their signatures",
}


@dataclasses.dataclass
class ConvertState:
    """What a conversion has built so far; `facts` what has been established about it."""

    checkpoint: Checkpoint | None = None
    source_hashes: dict[str, str] | None = None  # checkpoint file → sha256, so the manifest does not re-read them
    static_model: torch.nn.Module | None = None
    template_model: torch.nn.Module | None = None  # the first layers, which export traces
    weights: Weights | None = None
    bindings: dict[str, WeightRef] | None = None  # initializer name → where its value comes from
    graphs: dict[str, ir.Model] | None = None  # graph kind (decode, prefill) → graph
    signatures: Signatures | None = None
    graph_gears: dict[str, tuple[int, ...]] | None = None  # kind → token counts of a symbolic-T graph
    # MoE: one [E, ...] scale per layer and projection, lowered from the experts' own scales
    stacked_scales: dict[str, dict[str, Any]] | None = None
    scale_map: dict[str, dict[str, Any]] | None = None  # scale input name → its scale_map.json entry
    onnx_files: dict[str, Path] | None = None  # graph kind → its ONNX file in the staging directory
    package_files: list[Path] | None = None  # the tokenizer, config files and run.py it copied or wrote
    ascend_files: list[str] | None = None
    facts: set[str] = dataclasses.field(default_factory=set)

    def start_scale_stacks(self) -> dict[str, dict[str, Any]]:
        """`stacked_scales`, started by the first lowering pass; the others add to it."""
        if self.stacked_scales is None:
            self.stacked_scales = {}
        return self.stacked_scales

    def filled(self) -> set[str]:
        """Names of the non-empty fields and of the facts: what a plan may start from."""
        return {f.name for f in dataclasses.fields(self) if f.name != "facts" and getattr(self, f.name) is not None} \
            | self.facts

    def has(self, name: str) -> bool:
        return name in self.facts if name in FACTS else getattr(self, name) is not None


FIELDS = tuple(f.name for f in dataclasses.fields(ConvertState) if f.name != "facts")


def check_names(owner: str, names: tuple[str, ...], *, fields_only: bool = False) -> None:
    """A pass's declaration names only fields of ConvertState (and, unless `fields_only`, facts)."""
    known = FIELDS if fields_only else (*FIELDS, *FACTS)
    if unknown := [n for n in names if n not in known]:
        what = "fields" if fields_only else "fields or facts"
        raise PlanError(f"{owner} declares {unknown}, which are not ConvertState {what} (known: {', '.join(known)})")
