"""Load every written graph in ONNX Runtime and check it against the declared signature."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import onnxruntime as ort

from qwen2om.errors import Qwen2omError
from qwen2om.pipeline import PassResult, RunContext, Workspace, register

ORT_TYPES = {"int64": "tensor(int64)", "float32": "tensor(float)", "float16": "tensor(float16)"}


@register
class CheckOutputs:
    """Each graph loads in ONNX Runtime, has exactly the signature's I/O, and returns finite logits."""

    name: ClassVar[str] = "check_outputs"
    requires: ClassVar[tuple[str, ...]] = ("onnx_files", "signatures")
    produces: ClassVar[tuple[str, ...]] = ("checked",)

    def __call__(self, ws: Workspace, ctx: RunContext) -> PassResult:
        files, sigs = ws.need("onnx_files"), ws.need("signatures")
        for kind, (inputs, outputs) in sigs.items():
            path = files[kind]
            try:
                options = ort.SessionOptions()
                options.add_session_config_entry("session.disable_prepacking", "1")  # no second weight copy
                sess = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            except Exception as e:
                raise Qwen2omError(f"{path.name}: ONNX Runtime cannot load the graph ({e})") from None
            for what, got, want in (("input", sess.get_inputs(), inputs), ("output", sess.get_outputs(), outputs)):
                got_sig = [(a.name, a.type, list(a.shape)) for a in got]
                want_sig = [(s.name, ORT_TYPES[s.dtype], list(s.shape)) for s in want]
                if got_sig != want_sig:
                    got_only = [g for g in got_sig if g not in want_sig]
                    want_only = [w for w in want_sig if w not in got_sig]
                    raise Qwen2omError(f"{path.name}: {what} signature differs from the contract: "
                                       f"unexpected {got_only[:3]}, missing {want_only[:3]}")
            feeds = {s.name: np.zeros(s.shape, dtype=s.dtype) for s in inputs}
            logits = sess.run(["logits"], feeds)[0]
            if not np.isfinite(logits).all():
                raise Qwen2omError(f"{path.name}: logits are not finite on an all-zero input")
        ws["checked"] = True
        return PassResult(False, {"graphs_checked": len(sigs)})
