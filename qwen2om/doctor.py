"""`qwen2om doctor`: what this machine can do, and which installs contradict each other.

Every check reads metadata, the environment or PATH; nothing heavy is imported (no torch_npu, no
acl: with torch-npu installed but no CANN, importing either fails, which is one of the things this
reports). A missing tool is `missing` (some commands will not work, and the line says which); an
install that breaks something else is a `problem`, and only problems make the exit code 1.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

OK, MISSING, PROBLEM = "ok", "missing", "problem"
CANN_VARS = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")
VERSION_TIMEOUT_S = 10.0
# Chip names `npu-smi info` prints; "Ascend" + the name is ATC's --soc_version.
CHIP = re.compile(r"\b(910B\d|910_93\d*|310P\d|310B\d)\b")


@dataclasses.dataclass(frozen=True)
class Check:
    """One line of the report: what was looked at, what was found, and what it is needed for."""

    name: str
    status: str  # ok | missing | problem
    detail: str
    needed_for: str


@dataclasses.dataclass(frozen=True)
class Report:
    checks: tuple[Check, ...]

    @property
    def problems(self) -> list[Check]:
        return [c for c in self.checks if c.status == PROBLEM]

    @property
    def exit_code(self) -> int:
        return 1 if self.problems else 0

    def to_dict(self) -> dict[str, object]:
        return {"checks": [dataclasses.asdict(c) for c in self.checks], "problems": len(self.problems),
                "exit_code": self.exit_code}


def dist_version(dist: str) -> str | None:
    """An installed distribution's version from its metadata (nothing imported), or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def tool_output(argv: Sequence[str]) -> str | None:
    """The first non-empty output line of a short command (stdout, else stderr), or None if it fails."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=VERSION_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    lines = [ln.strip() for ln in (proc.stdout or proc.stderr).splitlines() if ln.strip()]
    return lines[0] if lines else None


def cann_home() -> tuple[str | None, Path | None]:
    """The first CANN variable set and its path (ASCEND_HOME_PATH, else ASCEND_TOOLKIT_HOME)."""
    for var in CANN_VARS:
        if value := os.environ.get(var):
            return var, Path(value)
    return None, None


def package(dist: str, needed_for: str) -> Check:
    version = dist_version(dist)
    return Check(dist, OK if version else MISSING, version or "not installed", needed_for)


def check_cann() -> Check:
    var, home = cann_home()
    need = "atc and pyACL; set by CANN's set_env.sh (source /usr/local/Ascend/ascend-toolkit/set_env.sh)"
    if var is None:
        return Check("CANN", MISSING, f"{' and '.join(CANN_VARS)} unset", need)
    if not home or not home.is_dir():
        return Check("CANN", PROBLEM, f"{var}={home} does not exist: a stale set_env.sh or a removed toolkit", need)
    return Check("CANN", OK, f"{var}={home}", need)


def check_atc(cann: Check) -> Check:
    need = ("compiling OUT/ascend/ into model.<kind>.om; without it `convert --target ascend` writes the "
            "command only (dry run)")
    path = shutil.which("atc")
    if path is None:
        return Check("atc", MISSING, "not on PATH", need)
    version = tool_output([path, "--version"]) or "version unknown (`atc --version` printed none)"
    if cann.status != OK:
        return Check("atc", PROBLEM, f"{path} ({version}) but CANN is not set up ({cann.detail}): atc needs the "
                     "environment set_env.sh provides", need)
    return Check("atc", OK, f"{path} ({version})", need)


def check_acl(cann: Check) -> Check:
    need = "`run OUT --backend acl` and `run.py --backend acl` (the .om on an Ascend NPU)"
    if importlib.util.find_spec("acl") is None:  # finds the module without importing it
        return Check("acl (pyACL)", MISSING, "not importable", need)
    if cann.status != OK:
        return Check("acl (pyACL)", PROBLEM, f"importable, but CANN is not set up ({cann.detail}): loading it "
                     "will fail to find libascendcl.so", need)
    return Check("acl (pyACL)", OK, "importable", need)


def check_npu_smi() -> Check:
    need = "seeing the NPUs and the chip name (`Ascend` + name is --soc-version); comes with the Ascend driver"
    path = shutil.which("npu-smi")
    if path is None:
        return Check("npu-smi", MISSING, "not on PATH (no Ascend driver: no NPU to run on)", need)
    try:
        info = subprocess.run([path, "info"], capture_output=True, text=True, timeout=VERSION_TIMEOUT_S).stdout
    except (OSError, subprocess.SubprocessError):
        info = ""
    chips = sorted(set(CHIP.findall(info)))
    found = f"chips: {', '.join(chips)} (--soc-version Ascend{chips[0]})" if chips else "no chip name recognised"
    return Check("npu-smi", OK, f"{path}; {found}", need)


def check_torch_npu(cann: Check) -> Check:
    need = "nothing in qwen2om (ATC and pyACL do not use it); only PyTorch on the NPU"
    version = dist_version("torch-npu")
    if version is None:
        return Check("torch-npu", MISSING, "not installed (fine: qwen2om does not need it)", need)
    if cann.status != OK:
        return Check("torch-npu", PROBLEM, f"{version} installed without CANN ({cann.detail}): `import torch` "
                     "fails loading libhccl.so. Source CANN's set_env.sh, or `pip uninstall torch-npu`", need)
    return Check("torch-npu", OK, version, need)


def check_dot() -> Check:
    need = "rendering Graphviz drawings of graphs (optional; apt-get install graphviz)"
    path = shutil.which("dot")
    if path is None:
        return Check("graphviz dot", MISSING, "not on PATH", need)
    return Check("graphviz dot", OK, f"{path} ({tool_output([path, '-V']) or 'version unknown'})", need)


def diagnose() -> Report:
    """Every check, in the order a user reads them: Python stack, then the Ascend toolchain."""
    cann = check_cann()
    checks = [
        Check("python", OK, f"{sys.version.split()[0]} ({sys.executable})", "everything (3.10+)"),
        package("torch", "convert, calibrate, verify (export and the reference model)"),
        package("onnxruntime", "run, verify, eval (the graphs on CPU)"),
        package("onnx", "convert, inspect"),
        package("transformers", "convert, calibrate, verify (the Hugging Face model classes)"),
        cann,
        check_atc(cann),
        check_acl(cann),
        check_npu_smi(),
        check_torch_npu(cann),
        check_dot(),
    ]
    return Report(tuple(checks))
