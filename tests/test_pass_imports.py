"""No pass imports another pass: what passes share lives outside passes/ (qwen2om/graph_rewrite.py,
qwen2om/output.py, ...), so each pass can be read, tested and reordered on its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PASSES = Path(__file__).resolve().parents[1] / "passes"
PACKAGES = ("qwen2om.passes", "passes")  # installed name, and the source folder's


def pass_imports(source: str) -> list[tuple[int, str]]:
    """(line, what) of each import in `source` that reaches into the passes package: absolute
    (`qwen2om.passes.x`, `passes.x`, `from qwen2om import passes`) or relative (`from . import x`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # within passes/, any relative import names a sibling pass
                found.append((node.lineno, "." * node.level + (node.module or "")))
                continue
            names = [node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        hits = [n for n in names if n in PACKAGES or n.startswith(tuple(f"{p}." for p in PACKAGES))]
        if hits:
            found.append((node.lineno, hits[0]))
    return found


def test_no_pass_imports_another_pass() -> None:
    modules = sorted(p for p in PASSES.glob("*.py") if p.name != "__init__.py")  # the package registers them all
    assert len(modules) > 10, f"expected the pass modules under {PASSES}"
    bad = [f"passes/{p.name}:{line}: imports {what}"
           for p in modules for line, what in pass_imports(p.read_text(encoding="utf-8"))]
    assert not bad, "a pass imports another pass; move what they share to a non-pass module " \
                    "(qwen2om/graph_rewrite.py):\n" + "\n".join(bad)


@pytest.mark.parametrize("source", [
    "from qwen2om.passes.lower_fp8 import const",
    "from qwen2om.passes import lower_fp8",
    "from qwen2om import passes",
    "import qwen2om.passes.fuse_moe",
    "import qwen2om.passes",
    "from passes.lower_int4 import MS_DOMAIN",
    "import passes.write_onnx as w",
    "from . import lower_fp8",
    "from .lower_fp8 import const",
    "def f():\n    from qwen2om.passes.write_onnx import DATA_FILE\n",
])
def test_checker_catches(source: str) -> None:
    assert pass_imports(source)


@pytest.mark.parametrize("source", [
    "from qwen2om.graph_rewrite import const",
    "from qwen2om.pipeline import PassResult, register",
    "import qwen2om.passes_extra",
    "from qwen2om.output import graph_file",
])
def test_checker_allows(source: str) -> None:
    assert not pass_imports(source)
