"""`qwen2om eval`: the same numbers through transformers and through a converted model."""

from __future__ import annotations

import json
import math

import pytest

from qwen2om.evaluate import agreement, perplexity


@pytest.mark.numerics
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


def test_eval_agree_prints_a_small_kl_with_its_digits(cli, converted) -> None:
    """fp16 against its fp32 reference: a KL of ~1e-6 nats, which four decimals printed as 0.0000."""
    args = ("eval", "agree", converted("tiny-qwen3", "fp16"), "--reference", "builtin:tiny-qwen3",
            "--dataset", "builtin:code", "--window", "32", "--max-windows", "2")
    code, stdout, err = cli(*args, "--json")
    assert code == 0, err
    kl = json.loads(stdout)["mean_kl"]
    code, stdout, err = cli(*args)
    assert code == 0 and 0 < kl < 1e-3, err
    assert math.isclose(float(stdout.split("mean KL ")[1].split()[0]), kl, rel_tol=1e-2), (stdout, kl)


def test_eval_cli_names_a_bad_path(cli, tmp_path) -> None:
    code, _, err = cli("eval", "ppl", tmp_path)
    assert code == 2 and "neither a qwen2om output directory nor a checkpoint directory" in err


@pytest.mark.slow
def test_eval_notes_a_short_dataset_and_a_window_past_the_trained_positions(cli, tmp_path) -> None:
    # tiny-qwen3-trained was trained with max_position_embeddings 1024; the text gives one 1100-token window.
    from qwen2om.fixtures.trained import heldout_text

    text = tmp_path / "held.txt"
    text.write_text(heldout_text(), encoding="utf-8")
    code, out, err = cli("eval", "ppl", "builtin:tiny-qwen3-trained", "--dataset", text, "--window", "1100",
                         "--max-windows", "50")
    assert code == 0, err
    assert "sample of 1100 tokens, not the 50 asked for" not in err  # several windows fit: plural
    assert "samples of 1100 tokens, not the 50 asked for" in err
    assert "a window of 1100 tokens exceeds its max_position_embeddings 1024" in err
    code, out, err = cli("eval", "ppl", "builtin:tiny-qwen3-trained", "--dataset", text, "--window", "64",
                         "--max-windows", "2", "--json")
    assert code == 0 and json.loads(out)["notes"] == [] and "note:" not in err
