"""Every adjacent swap and every single omission of every bundled pipeline is refused before any
work, or converts to output that verifies against transformers.

Two checkpoints per pipeline make every pass act: a W4A16 MoE (lower_int4 / lower_int4_ascend,
fuse_moe, fuse_int4, attention and norms) and an FP8 MoE (lower_fp8, scale inputs). A variant whose
graphs come out byte-identical to the unchanged pipeline's verifies as that one does; the others
are verified one by one.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml

import qwen2om.passes  # noqa: F401  (registers the passes)
from qwen2om.convert import convert
from qwen2om.errors import PlanError, RecipeError
from qwen2om.quant.calibrate import CalibrationConfig, calibrate
from qwen2om.recipe import bundled_recipes, load_recipe
from qwen2om.verify import verify

pytestmark = pytest.mark.slow

# ort at fp32: fuse_norm acts only there; ascend at fp16 for 910B3: the int4 kernel path.
TARGETS = {"ort": ["dtype=fp32"], "ascend": ["dtype=fp16", "soc_version=Ascend910B3"]}
SMALL = ["max_seq_len=32", "prefill_chunk=8"]
PROMPTS = ["The quick brown fox"]


def pipelines() -> dict[str, list]:
    found: dict[str, list] = {}
    for name in bundled_recipes():
        r = load_recipe(name)
        found.setdefault(r.target, [{n: a} if a else n for n, a in r.pipeline])
    return found


def variants() -> list[tuple[str, str, list]]:
    cases = []
    for target, steps in pipelines().items():
        names = [s if isinstance(s, str) else next(iter(s)) for s in steps]
        for i in range(len(steps) - 1):
            v = list(steps)
            v[i], v[i + 1] = v[i + 1], v[i]
            cases.append((target, f"swap-{names[i]}-{names[i + 1]}", v))
        for i in range(len(steps)):
            cases.append((target, f"omit-{names[i]}", steps[:i] + steps[i + 1:]))
    return cases


@pytest.fixture(scope="module")
def w4_moe(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("w4") / "tiny-qwen3-moe-w4a16"
    calibrate("builtin:tiny-qwen3-moe", out, CalibrationConfig(method="rtn", group_size=32))
    return out


def graph_digest(out: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(out.glob("model.*")):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def baselines(tmp_path_factory, w4_moe) -> dict[tuple[str, str], str]:
    """(target, model) → the unchanged pipeline's graph digest; each verified once here."""
    found = {}
    for target, steps in pipelines().items():
        for model in (str(w4_moe), "builtin:tiny-qwen3-moe-fp8"):
            out = tmp_path_factory.mktemp("base") / "out"
            recipe = recipe_file(out.parent, target, steps)
            convert(model, out, recipe=str(recipe), overrides=[*SMALL, *TARGETS[target]])
            report = verify(out, model, tokens=8, prompts=PROMPTS)
            assert report.passed, (target, model, report)
            found[target, model] = graph_digest(out)
    return found


def recipe_file(where: Path, target: str, steps: list) -> Path:
    r = load_recipe(next(n for n in bundled_recipes() if load_recipe(n).target == target))
    data = r.to_dict() | {"family": "qwen3", "pipeline": steps}
    data.pop("name", None)
    path = where / "recipe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize(("target", "change", "steps"), variants(), ids=[f"{t}-{c}" for t, c, _ in variants()])
def test_a_reordered_or_shortened_pipeline_is_refused_or_verifies(tmp_path, target, change, steps, w4_moe,
                                                                   baselines) -> None:
    recipe = recipe_file(tmp_path, target, steps)
    for model in (str(w4_moe), "builtin:tiny-qwen3-moe-fp8"):
        out = tmp_path / "out"
        try:
            convert(model, out, recipe=str(recipe), overrides=[*SMALL, *TARGETS[target]], force=True)
        except (PlanError, RecipeError) as e:
            assert "pass" in str(e) and not out.exists(), e  # refused before any work, naming the passes
            return
        if graph_digest(out) == baselines[target, model]:
            continue
        report = verify(out, model, tokens=8, prompts=PROMPTS)
        assert report.passed, (change, model, report.max_abs)
