"""Checks on the Python environment that users otherwise discover as cryptic import errors."""

from __future__ import annotations

import importlib.util
import os


def torch_npu_without_cann() -> str | None:
    """torch-npu installed but no CANN toolkit: `import torch` would fail loading libhccl.so."""
    if importlib.util.find_spec("torch_npu") is None:  # find_spec imports nothing
        return None
    if any(os.environ.get(v) for v in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH")):
        return None
    return ("torch-npu is installed but no CANN toolkit is set up (ASCEND_HOME_PATH is unset): `import torch` "
            "will fail. Source CANN's set_env.sh, or `pip uninstall torch-npu` on machines without an NPU.")
