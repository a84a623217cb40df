"""Environment checks: torch-npu without CANN is reported before it breaks `import torch`."""

from __future__ import annotations

import importlib.util

import pytest

from qwen2om import environment


def test_torch_npu_without_cann_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(environment.importlib.util, "find_spec",
                        lambda name: object() if name == "torch_npu" else real(name))
    for var in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH"):
        monkeypatch.delenv(var, raising=False)
    assert "CANN" in (environment.torch_npu_without_cann() or "")
    monkeypatch.setenv("ASCEND_HOME_PATH", "/usr/local/Ascend/ascend-toolkit/latest")
    assert environment.torch_npu_without_cann() is None


def test_no_torch_npu_no_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(environment.importlib.util, "find_spec", lambda name: None)
    assert environment.torch_npu_without_cann() is None
