"""`calibrate --device`: where the layers' forward passes and the GPTQ/AWQ arithmetic run.

cpu (the default), cuda[:i] (a CUDA build of torch and a GPU), npu[:i] (Ascend: torch-npu, which is
imported only when asked for, and CANN set up as `qwen2om doctor` checks it). A device that is not
there is refused before any data or weight is read, saying what is missing.
"""

from __future__ import annotations

import re

import torch

from qwen2om.quant.schemes import CalibrationError

SPELLING = re.compile(r"(cpu|cuda|npu)(?::(\d+))?")
KINDS = "cpu, cuda[:i] or npu[:i]"


def check_spelling(device: str) -> None:
    if not isinstance(device, str) or not SPELLING.fullmatch(device) or device.startswith("cpu:"):
        raise CalibrationError(f"--device {device!r} is not one of {KINDS}")


def torch_device(device: str) -> torch.device:
    """The torch device `device` names, checked to be present here."""
    check_spelling(device)
    kind, _, index = device.partition(":")
    i = int(index or 0)
    if kind == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only torch build" if torch.version.cuda is None else f"CUDA {torch.version.cuda} build"
            raise CalibrationError(f"--device {device}: no CUDA GPU is usable here ({build} of torch "
                                   f"{torch.__version__}); use --device cpu, or install a CUDA torch where a GPU is")
        if i >= torch.cuda.device_count():
            raise CalibrationError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s) "
                                   f"(cuda:0-{torch.cuda.device_count() - 1})")
    elif kind == "npu":
        npu_available(device, i)
    return torch.device(device)


def npu_available(device: str, i: int) -> None:
    from qwen2om.doctor import OK, check_cann, dist_version

    if dist_version("torch-npu") is None:
        raise CalibrationError(f"--device {device}: torch-npu is not installed (pip install 'qwen2om[npu]', "
                               "pinned to this torch's minor version, on a machine with CANN)")
    cann = check_cann()
    if cann.status != OK:
        raise CalibrationError(f"--device {device}: CANN is not set up ({cann.detail}); {cann.needed_for}")
    try:
        import torch_npu  # noqa: F401  (registers the npu device with torch)
    except Exception as e:  # a broken CANN raises anything from ImportError to OSError
        raise CalibrationError(f"--device {device}: importing torch-npu failed ({e})") from None
    count = torch.npu.device_count()  # type: ignore[attr-defined]
    if i >= count:
        raise CalibrationError(f"--device {device}: {count} NPU(s) are visible here")
