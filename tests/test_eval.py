"""`qwen2om eval`: the same numbers through transformers and through a converted model."""

from __future__ import annotations

import math

from qwen2om.evaluate import agreement, perplexity


def test_perplexity_is_the_same_through_transformers_and_the_runtime(converted) -> None:
    out = converted("tiny-qwen3", "fp32")
    hf = perplexity("builtin:tiny-qwen3", "builtin:prose", window=48, max_windows=3)
    rt = perplexity(str(out), "builtin:prose", window=48, max_windows=3)
    assert hf.tokens == rt.tokens == 3 * 47 and hf.windows == 3
    assert math.isclose(hf.ppl, rt.ppl, rel_tol=1e-4)


def test_a_model_agrees_with_itself_and_not_with_another(converted) -> None:
    same = agreement(str(converted("tiny-qwen3", "fp32")), "builtin:tiny-qwen3", "builtin:code",
                     window=32, max_windows=2)
    assert same.top1_agreement == 1.0 and same.mean_kl < 1e-6
    other = agreement("builtin:tiny-qwen3-untied", "builtin:tiny-qwen3", "builtin:code", window=32, max_windows=2)
    assert other.top1_agreement < 0.5 and other.mean_kl > 0.01


def test_eval_cli_names_a_bad_path(cli, tmp_path) -> None:
    code, _, err = cli("eval", "ppl", tmp_path)
    assert code == 2 and "neither a qwen2om output directory nor a checkpoint directory" in err
