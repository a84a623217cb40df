"""Shared fixtures: builtin checkpoints and conversions, built once per test session."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from qwen2om.srcroot import leave_source_root

# `python -m pytest` from the repository root puts the root on sys.path, where kernels/ would stand in
# for Hugging Face's `kernels` package (qwen2om/srcroot.py); `pytest` alone does not.
leave_source_root()
# pytest-xdist starts its workers with COLUMNS=80 set. rich fixes a Console's width when it is made with
# COLUMNS set, so qwen2om.cli's consoles would stay 80 wide and the tests that widen them
# (monkeypatch.setenv("COLUMNS", ...)) would see their tables wrapped. A plain run has no COLUMNS.
os.environ.pop("COLUMNS", None)

SMALL = ["max_seq_len=256", "prefill_chunk=32"]
# llm-compressor's W4A16 output for builtin:tiny-qwen3 (bench/llmcompressor_w4a16.py), embedding left out.
LLMCOMPRESSOR_W4A16 = Path(__file__).resolve().parent.parent / "fixtures" / "data" / "llmcompressor-tiny-qwen3-w4a16"

# Fixtures that convert or calibrate a whole model: a test that takes one belongs to the full lane
# (`slow`), whatever its own body costs, because in `make test-fast` it would pay for the fixture.
WHOLE_MODEL_FIXTURES = {"converted", "tiny", "fp8", "engine", "out", "outs", "moe_out", "fp8_out", "reference",
                        "calibrated", "w4", "qwen2_quantized", "ascend_out", "llmcompressor_ckpt", "staged_outs"}


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


@pytest.fixture(scope="session")
def llmcompressor_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llm-compressor's output, with the embedding (left out of the repository) put back from the builtin."""
    from safetensors.torch import save_file

    from qwen2om.builtin import resolve_model
    from qwen2om.checkpoint import Checkpoint

    src = resolve_model("builtin:tiny-qwen3")
    out = tmp_path_factory.mktemp("llmc") / "ckpt"
    out.mkdir()
    for name in ("config.json", "layers.safetensors"):
        shutil.copyfile(LLMCOMPRESSOR_W4A16 / name, out / name)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(src / name, out / name)
    save_file({"model.embed_tokens.weight": Checkpoint(src).get("model.embed_tokens.weight")},
              str(out / "embed.safetensors"), metadata={"format": "pt"})
    from qwen2om.safetensors_io import Shard

    weight_map = {n: "layers.safetensors" for n in Shard(out / "layers.safetensors").tensors}
    weight_map["model.embed_tokens.weight"] = "embed.safetensors"
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out



@pytest.fixture(scope="session")
def staged_outs(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`staged_outs(model, stages, *settings)` → an output directory of `convert --stages` (stages 0:
    unstaged) at capacity 64 and chunk 8, converted once per session (tests/test_stages.py and
    test_ray_stages.py share them). Tests copy before they change one."""
    from qwen2om.convert import ConvertOptions, convert

    done: dict[tuple[object, ...], Path] = {}

    def get(model: str, stages: int, *settings: str) -> Path:
        key = (model, stages, *settings)
        if key not in done:
            out = tmp_path_factory.mktemp("staged") / f"{Path(model.removeprefix('builtin:')).name}-{stages}"
            opts = ConvertOptions.from_overrides(["max_seq_len=64", "prefill_chunk=8", *settings],
                                                 stages=stages or None)
            convert(model, out, opts)
            done[key] = out
        return done[key]

    return get
