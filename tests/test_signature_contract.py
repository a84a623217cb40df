"""run.py keeps its own copy of the I/O contract (it may not import qwen2om): the roles it reads and
`shape_at`, which must grow the same axes with T as signature.token_axes (ATC's --dynamic_dims are
written from the latter, the runtime binds buffers with the former). Issue 24, item 8."""

from __future__ import annotations

import json

import pytest

from qwen2om import signature
from qwen2om.arch import ModelDims
from qwen2om.runtime import standalone
from qwen2om.stages import Stage

RUNTIME_ROLES = {*standalone.PAST_ROLES, *standalone.PRESENT_ROLES, *standalone.CACHE_ROLES,
                 *standalone.STATE_ROLES, *standalone.PRESENT_STATE_ROLES, *standalone.HIDDEN_ROLES, "ids", "mask",
                 "positions", "logits", "scale"}


def test_the_runtime_knows_every_role_and_no_other() -> None:
    roles = {v for k, v in vars(signature).items() if k.startswith("ROLE_")}
    assert RUNTIME_ROLES == roles


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3-5"])
@pytest.mark.parametrize(("tokens", "logits_t"), [(1, 1), (16, 1), (16, 16)])
@pytest.mark.parametrize("stage", [None, Stage(1, 3, 1, 2)], ids=["whole", "middle-stage"])
def test_shape_at_grows_the_axes_token_axes_names(checkpoint, name: str, tokens: int, logits_t: int,
                                                  stage: Stage | None) -> None:
    dims = ModelDims.from_config(json.loads((checkpoint(name) / "config.json").read_text()))
    inputs, outputs = signature.graph_io(dims, batch=2, t=tokens, capacity=64, dtype="float16", logits_t=logits_t,
                                         stage=stage)
    for spec in inputs + outputs:
        io = spec.to_dict()
        axes = signature.token_axes(spec.role, spec.shape, tokens)
        for t in sorted({1, max(1, tokens // 2), tokens}):
            want = [t + axes[a] if a in axes else n for a, n in enumerate(spec.shape)]
            assert standalone.shape_at(io, t, tokens) == want, (name, spec.name, t)
