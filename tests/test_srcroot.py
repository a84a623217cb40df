"""`python -m` from the repository root: the checkout's top-level kernels/ (installed as qwen2om.kernels)
must not stand in for Hugging Face's `kernels`, which transformers imports while building a model."""

from __future__ import annotations

import subprocess
import sys
import sysconfig

from qwen2om.srcroot import ROOT, is_source_root

SHAPE = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
             head_dim=8, vocab_size=64)
BUILD = ("from transformers import Qwen3Config, Qwen3ForCausalLM; "
         f"Qwen3ForCausalLM(Qwen3Config(**{SHAPE!r})); print('built')")


def test_the_root_is_recognised_and_site_packages_is_not(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert is_source_root("") and is_source_root(str(ROOT))
    assert not is_source_root(sysconfig.get_paths()["purelib"])
    assert not is_source_root(str(ROOT / "tests"))


def test_an_entry_point_run_from_the_root_builds_a_qwen3_model():
    """What `python -m qwen2om …` does first (qwen2om/__main__.py), then a model build, with the root on
    sys.path exactly as `python -c` / `python -m` from the root puts it."""
    code = f"from qwen2om.srcroot import leave_source_root; leave_source_root(); {BUILD}"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("built"), run.stderr[-2000:]


def test_python_m_qwen2om_leaves_the_root():
    run = subprocess.run([sys.executable, "-m", "qwen2om", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    main = (ROOT / "qwen2om" / "__main__.py").read_text()
    assert main.index("leave_source_root()") < main.index("from qwen2om.cli import main")


def test_python_m_pytest_from_the_root_builds_models():
    """tests/conftest.py leaves the root too: a test that builds a Qwen3 model under `python -m pytest`."""
    probe = ROOT / "tests" / "test_srcroot.py"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          f"{probe}::test_the_model_builds_in_process"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


def test_the_model_builds_in_process():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    assert Qwen3ForCausalLM(Qwen3Config(**SHAPE)).config.num_hidden_layers == 1
