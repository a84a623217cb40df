"""Acceptance: converted tiny models match transformers (the oracle) token for token."""

from __future__ import annotations

import pytest

from qwen2om.verify import verify

MODELS = ["tiny-qwen2", "tiny-qwen2-untied", "tiny-qwen3", "tiny-qwen3-untied"]


@pytest.mark.numerics
@pytest.mark.parametrize("name", MODELS)
def test_fp32_matches_transformers(converted, name: str) -> None:
    out = converted(name, "fp32")
    report = verify(out, f"builtin:{name}", tokens=32)
    # One default prompt is longer than the 32-token prefill chunk: chunked prefill is covered.
    assert max(p.prompt_tokens for p in report.prompts) > 32
    assert all(p.steps == 32 for p in report.prompts)
    assert report.max_abs <= 1e-4, report.to_dict()
    assert report.agreement == 1.0, report.to_dict()
    assert report.passed


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-qwen3-untied"])
def test_fp16_top1_agreement(converted, name: str) -> None:
    out = converted(name, "fp16")
    report = verify(out, f"builtin:{name}", tokens=32)
    assert report.dtype == "float16"
    assert report.agreement >= 0.99, report.to_dict()
    # fp16 is not bit-exact, but it must be close: a broken cast shows up as O(1) errors.
    assert report.max_abs < 0.1, report.to_dict()


@pytest.mark.numerics
def test_all_logits_prefill_matches(converted) -> None:
    """logits=all (every prefill position returned) gives the same parity."""
    out = converted("tiny-qwen3", "fp32", "logits=all")
    report = verify(out, "builtin:tiny-qwen3", tokens=8)
    assert report.passed and report.max_abs <= 1e-4


def test_verify_cli_passes_and_writes_json(converted, cli, tmp_path) -> None:
    """Without --reference, verify compares with the checkpoint the manifest says OUT came from."""
    out = converted("tiny-qwen3", "fp32")
    code, stdout, _ = cli("verify", out, "--tokens", "8", "--json", tmp_path / "v.json")
    assert code == 0, stdout
    assert "PASS" in stdout and "against builtin:tiny-qwen3 " in " ".join(stdout.split())
    import json

    data = json.loads((tmp_path / "v.json").read_text())
    assert data["passed"] is True and data["max_abs_logits"] <= 1e-4


def test_verify_cli_fails_against_a_different_model(converted, cli) -> None:
    """The check can fail: tiny-qwen3 compiled, tiny-qwen3-untied as reference (same shapes, other weights)."""
    out = converted("tiny-qwen3", "fp32")
    code, stdout, _ = cli("verify", out, "--reference", "builtin:tiny-qwen3-untied", "--tokens", "4")
    assert code == 1
    assert "FAIL" in stdout


def test_judge_step_counts_reference_ties_only() -> None:
    """A compiled argmax that differs from the reference's greedy token is a tie only when the
    reference itself scores the two within the tie gap: fp32's logits tolerance, 1e-2 without one."""
    import numpy as np

    from qwen2om.verify import judge_step, tie_gap

    ref = np.array([0.0, 5.0, 5.0 - 3e-5, 1.0], dtype=np.float32)  # tokens 1 and 2 tied to 3e-5
    compiled = np.array([0.0, 5.0 - 1e-6, 5.0, 1.0], dtype=np.float32)  # rounding flipped the tie
    assert judge_step(ref, ref, 1, 1e-4) == "agree"
    assert judge_step(compiled, ref, 1, 1e-4) == "tie"
    assert judge_step(compiled, ref, 1, 1e-5) is None  # 3e-5 apart: beyond this tolerance
    assert judge_step(compiled, ref, 1, 0.0) is None  # no tie gap: every argmax must match
    assert tie_gap({"max_abs": 1e-4}) == 1e-4 and tie_gap({"max_abs": None}) == 1e-2
    wrong = np.array([0.0, 1.0, 0.0, 9.0], dtype=np.float32)
    assert judge_step(wrong, ref, 1, 1e-4) is None  # token 3 is 4.0 below the greedy one
