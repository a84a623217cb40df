"""`qwen2om doctor`: missing tools reported with what they are for (exit 0); contradicting installs
(torch-npu without CANN, atc or a stale CANN path without its environment) are problems (exit 1)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest

from qwen2om import doctor

TOOLS = ("atc", "npu-smi")


@pytest.fixture
def bare(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """This machine as the tests assume it: no CANN variables, a PATH dir of our own in front."""
    if any(shutil.which(t) for t in TOOLS) or importlib.util.find_spec("acl") is not None:
        pytest.skip("CANN tools are installed here; these tests simulate a machine without them")
    for var in doctor.CANN_VARS:
        monkeypatch.delenv(var, raising=False)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return bin_dir


def fake_tool(bin_dir: Path, name: str, output: str) -> Path:
    tool = bin_dir / name
    tool.write_text(f"#!/bin/sh\necho '{output}'\n")
    tool.chmod(0o755)
    return tool


def by_name(report: doctor.Report) -> dict[str, doctor.Check]:
    return {c.name: c for c in report.checks}


def test_this_machine_reports_missing_and_exits_0(bare: Path, cli) -> None:
    checks = by_name(doctor.diagnose())
    for name in ("atc", "acl (pyACL)", "npu-smi", "CANN"):
        assert checks[name].status == "missing", checks[name]
    assert "dry run" in checks["atc"].needed_for and "--backend acl" in checks["acl (pyACL)"].needed_for
    assert checks["python"].status == "ok" and checks["onnxruntime"].status == "ok"
    code, out, _ = cli("doctor")
    assert code == 0
    assert "atc" in out and "missing" in out and "problem" not in out


def test_json_lists_every_check_with_its_fields(bare: Path, cli) -> None:
    code, out, _ = cli("doctor", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["problems"] == 0 and data["exit_code"] == 0
    names = [c["name"] for c in data["checks"]]
    for name in ("python", "torch", "onnxruntime", "onnx", "transformers", "CANN", "atc", "acl (pyACL)", "npu-smi",
                 "torch-npu", "graphviz dot"):
        assert name in names
    for c in data["checks"]:
        assert set(c) == {"name", "status", "detail", "needed_for"}
        assert c["status"] in ("ok", "missing", "problem") and c["needed_for"]


def test_atc_with_cann_is_ok_with_its_version(bare: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              cli) -> None:
    fake_tool(bare, "atc", "ATC version 8.0.RC3 (fake)")
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path))
    atc = by_name(doctor.diagnose())["atc"]
    assert atc.status == "ok" and "8.0.RC3" in atc.detail
    code, out, _ = cli("doctor", "--json")
    assert code == 0
    assert any(c["name"] == "atc" and "8.0.RC3" in c["detail"] for c in json.loads(out)["checks"])


def test_atc_without_its_environment_is_a_problem(bare: Path, cli) -> None:
    fake_tool(bare, "atc", "ATC version 8.0.RC3 (fake)")
    code, out, _ = cli("doctor", "--json")
    assert code == 1
    atc = next(c for c in json.loads(out)["checks"] if c["name"] == "atc")
    assert atc["status"] == "problem" and "8.0.RC3" in atc["detail"] and "set_env.sh" in atc["detail"]


def test_torch_npu_without_cann_is_a_problem(bare: Path, monkeypatch: pytest.MonkeyPatch, cli) -> None:
    real = doctor.dist_version
    monkeypatch.setattr(doctor, "dist_version", lambda d: "2.13.0" if d == "torch-npu" else real(d))
    check = by_name(doctor.diagnose())["torch-npu"]
    assert check.status == "problem" and "import torch" in check.detail
    code, out, _ = cli("doctor")
    assert code == 1
    assert "torch-npu" in out and "problem" in out


def test_torch_npu_with_cann_is_fine(bare: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "dist_version", lambda d: "2.13.0")
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(tmp_path))
    report = doctor.diagnose()
    assert by_name(report)["torch-npu"].status == "ok" and report.exit_code == 0


def test_stale_cann_path_is_a_problem(bare: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path / "removed"))
    report = doctor.diagnose()
    assert by_name(report)["CANN"].status == "problem" and report.exit_code == 1


def test_npu_smi_names_the_soc_version(bare: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_tool(bare, "npu-smi", "| 0     910B3               | OK            | 93.1        45                0    / 0 |")
    check = by_name(doctor.diagnose())["npu-smi"]
    assert check.status == "ok" and "Ascend910B3" in check.detail
