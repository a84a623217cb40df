"""Targets, architectures (Hugging Face model types) and model families are registry entries: no code
outside their registries compares against their names (the quantisation names: test_quant_registry.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from qwen2om.arch import ARCHS
from qwen2om.families import FAMILIES
from qwen2om.targets import TARGETS

ROOT = Path(__file__).resolve().parents[1]
# registry → (the names it owns, the modules that may spell them in a comparison)
OWNERS = {
    "targets": ([t.name for t in TARGETS], {"qwen2om/targets.py"}),
    "model types": (sorted({m for a in ARCHS for m in a.model_types}), {"qwen2om/arch.py"}),
    "families": ([f.name for f in FAMILIES], {"qwen2om/families.py", "qwen2om/arch.py"}),
}


def comparison(names: list[str]) -> re.Pattern[str]:
    literal = rf"""["'](?:{"|".join(map(re.escape, names))})["']"""
    # `x == "ascend"`, `"ascend" != x`, `x in ("ort", ...)`, `x not in ["qwen3_moe"]`
    return re.compile(rf"""(?:==|!=)\s*{literal}|{literal}\s*(?:==|!=)|\bin\s*[(\[{{][^)\]}}]*{literal}""")


@pytest.mark.parametrize("registry", OWNERS)
def test_no_name_comparisons_outside_the_registry(registry: str) -> None:
    names, allowed = OWNERS[registry]
    pattern, found = comparison(names), []
    for path in sorted([*ROOT.glob("qwen2om/**/*.py"), *ROOT.glob("passes/**/*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        if rel in allowed or rel.startswith("qwen2om/runtime/"):  # the runtime's backends are not targets
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if pattern.search(line.split("#")[0]):
                found.append(f"{rel}:{i}: {line.strip()}")
    assert not found, f"ask the {registry} registry instead:\n" + "\n".join(found)


def test_the_pattern_catches_what_it_should() -> None:
    pattern = comparison(["ascend", "qwen3_moe"])
    for line in ('if r.target == "ascend":', "if 'qwen3_moe' != t:", 'cfg["model_type"] in ("qwen3_moe", "x")'):
        assert pattern.search(line), line
    for line in ('target: str = "ascend"', 'TARGETS.get("ascend")', 'recipe="ascend"'):
        assert not pattern.search(line), line
