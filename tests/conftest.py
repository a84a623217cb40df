"""Shared fixtures: builtin checkpoints and conversions, built once per test session."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

SMALL = ["max_seq_len=256", "prefill_chunk=32"]

# Fixtures that convert or calibrate a whole model: a test that takes one belongs to the full lane
# (`slow`), whatever its own body costs, because in `make test-fast` it would pay for the fixture.
WHOLE_MODEL_FIXTURES = {"converted", "tiny", "fp8", "engine", "out", "outs", "moe_out", "fp8_out", "reference",
                        "calibrated", "w4", "qwen2_quantized", "ascend_out", "llmcompressor_ckpt"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The unit lane (`make test-fast`, `-m "not slow"`) drives one pass or one module on small
    states; everything needing a whole conversion is `slow`, by fixture here or marked by hand."""
    for item in items:
        if WHOLE_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def builtin_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Builtin models are cached under QWEN2OM_CACHE; tests use a private one unless CI set it."""
    if "QWEN2OM_CACHE" not in os.environ:
        os.environ["QWEN2OM_CACHE"] = str(tmp_path_factory.mktemp("qwen2om-cache"))
    return Path(os.environ["QWEN2OM_CACHE"])


@pytest.fixture(scope="session")
def checkpoint() -> Callable[[str], Path]:
    from qwen2om.builtin import resolve_model

    return lambda name: resolve_model(f"builtin:{name}")


@pytest.fixture(scope="session")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`converted("tiny-qwen3", "fp32")` → an output directory, converted once per session."""
    from qwen2om.convert import convert

    done: dict[tuple[str, ...], Path] = {}

    def get(name: str, dtype: str = "fp32", *extra: str) -> Path:
        key = (name, dtype, *extra)
        if key not in done:
            out = tmp_path_factory.mktemp("out") / f"{name}-{dtype}"
            convert(f"builtin:{name}", out, overrides=[*SMALL, f"dtype={dtype}", *extra])
            done[key] = out
        return done[key]

    return get


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    """Run `qwen2om ARGS` in-process through the real entry point; returns (exit code, stdout, stderr)."""
    from qwen2om.cli import main

    def invoke(*args: str) -> tuple[int, str, str]:
        old = sys.argv
        sys.argv = ["qwen2om", *map(str, args)]
        code = 0
        try:
            main()
        except SystemExit as e:
            code = int(e.code or 0)
        finally:
            sys.argv = old
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return invoke
