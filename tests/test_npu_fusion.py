"""The Ascend fusion passes on whole conversions (issue 25): where the SoC has the kernels the fused
ops are there and the output verifies through the reference kernels; where it has none, or the
model is outside what a kernel takes, the portable form stays and the log says why.

(The matrix of every architecture × scheme × SoC, checked and verified, is tests/test_ascend_matrix.py.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from qwen2om.convert import convert
from qwen2om.inspect import check_graphs
from qwen2om.verify import verify

pytestmark = pytest.mark.slow

SMALL = ["max_seq_len=256", "prefill_chunk=32"]
PROMPTS = ["The tiny model", "A prompt long enough for two chunks of the prefill graph, which takes thirty-two "
                             "tokens at most per call, and then some."]
RECIPE = Path(__file__).parent.parent / "recipes" / "ascend.yaml"


def npu_ops(out: Path, kind: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in onnx.load(out / f"model.{kind}.onnx", load_external_data=False).graph.node:
        if n.domain == "npu":
            counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return counts


def test_a_soc_without_kernels_keeps_the_portable_form_and_says_why(tmp_path: Path) -> None:
    notes: list[str] = []
    out = tmp_path / "b1"
    convert("builtin:tiny-qwen3-moe", out, overrides=[*SMALL, "target=ascend", "soc_version=Ascend310B1"],
            log=notes.append)
    assert npu_ops(out, "decode") == npu_ops(out, "prefill") == {}
    said = "\n".join(notes)
    for op in ("NPURmsNorm", "NPURotaryPositionEmbedding", "NPUMoeGatingTopKSoftmax", "NPUPromptFlashAttention"):
        assert f"(310B) has no {op} kernel" in said, (op, said)


def test_a_norm_whose_epsilon_the_plugin_cannot_carry_stays(checkpoint, tmp_path: Path) -> None:
    """CANN's RmsNorm plugins fix ε at 1e-6: a model with another ε keeps its norms in standard ops
    (and still verifies); its attention and RoPE are fused as usual."""
    source = tmp_path / "eps"
    shutil.copytree(checkpoint("tiny-qwen3"), source)
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    config["rms_norm_eps"] = 1e-5
    (source / "config.json").write_text(json.dumps(config), encoding="utf-8")
    notes: list[str] = []
    out = tmp_path / "out"
    convert(source, out, overrides=[*SMALL, "target=ascend", "soc_version=Ascend910B3"], log=notes.append)
    ops = npu_ops(out, "prefill")
    assert "NPURmsNorm" not in ops and "NPUAddRmsNorm" not in ops and ops.get("NPUPromptFlashAttention") == 4, ops
    assert any("its ε is 1e-05" in n for n in notes), notes
    assert verify(out, str(source), tokens=4, prompts=PROMPTS).passed


@pytest.mark.parametrize("arch", ["tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen3-5", "tiny-qwen3-next"])
def test_fused_decode_attention_on_request(arch: str, tmp_path: Path) -> None:
    """`fuse_attention_ascend: {decode: true}`: the decode graph's attention is the kernel too (new K/V
    concatenated in front of the cache), checked and verified like the default."""
    recipe = tmp_path / "decode.yaml"
    text = RECIPE.read_text(encoding="utf-8")
    lines = ["  - fuse_attention_ascend: {decode: true}" if line.strip().startswith("- fuse_attention_ascend")
             else line for line in text.splitlines()]
    recipe.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / arch
    convert(f"builtin:{arch}", out, recipe=str(recipe), overrides=[*SMALL, "soc_version=Ascend910B3"])
    full_attention_layers = npu_ops(out, "prefill")["NPUPromptFlashAttention"]
    assert npu_ops(out, "decode")["NPUPromptFlashAttention"] == full_attention_layers
    assert check_graphs(out, "ascend", "Ascend910B3") == {"decode": [], "prefill": []}
    report = verify(out, f"builtin:{arch}", tokens=4, prompts=PROMPTS)
    assert report.passed and report.agreement >= 0.99, report


@pytest.mark.ascend
@pytest.mark.skipif(importlib.util.find_spec("acl") is None,
                    reason="needs CANN's pyACL, atc and an Ascend NPU: what the fused kernels buy, and their numerics "
                           "on the NPU, can only be measured there")
def test_fused_against_portable_on_the_npu(tmp_path: Path) -> None:
    """On an Ascend host (QWEN2OM_SOC_VERSION, CANN's atc on PATH): the bundled recipe and one without the
    fusion passes, both compiled by ATC and run with pyACL; greedy tokens equal to ONNX Runtime's for
    both, and the decode tok/s and prefill ms of each printed (timings are reported, never asserted)."""
    from qwen2om.runtime.standalone import Engine, Sampling

    soc = os.environ.get("QWEN2OM_SOC_VERSION")
    if not soc or shutil.which("atc") is None:
        pytest.skip("set QWEN2OM_SOC_VERSION (see `npu-smi info`) and put CANN's atc on PATH")
    unfused = tmp_path / "unfused.yaml"
    unfused.write_text("\n".join(line for line in RECIPE.read_text(encoding="utf-8").splitlines()
                                 if "fuse_" not in line) + "\n", encoding="utf-8")
    outs = {"fused": tmp_path / "fused", "portable": tmp_path / "portable"}
    convert("builtin:tiny-qwen3-moe", outs["fused"], overrides=["target=ascend", f"soc_version={soc}"])
    convert("builtin:tiny-qwen3-moe", outs["portable"], recipe=str(unfused), overrides=[f"soc_version={soc}"])
    cpu = Engine(outs["portable"])
    ids = cpu.encode(PROMPTS[1] * 8)
    want = cpu.generate(ids, max_new_tokens=64, sampling=Sampling(0.0), ignore_eos=True)[0]
    for name, out in outs.items():
        with Engine(out, backend="acl") as npu:
            start = time.perf_counter()
            npu.prefill([ids])
            prefill_ms = 1e3 * (time.perf_counter() - start)
            start = time.perf_counter()
            got = npu.generate(ids, max_new_tokens=64, sampling=Sampling(0.0), ignore_eos=True)[0]
            seconds = time.perf_counter() - start
        print(f"{soc} {name}: prefill {prefill_ms:.1f} ms, generate 64 tokens {64 / seconds:.1f} tok/s")
        assert np.mean(np.array(got) == np.array(want)) >= 0.9, (name, got, want)
