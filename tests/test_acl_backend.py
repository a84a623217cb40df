"""The pyACL backend (issue 7): a clear failure without CANN; through a fake pyACL that runs the ONNX
graphs with onnxruntime (tests/fake_acl.py, a test double), the very tokens of the ONNX Runtime
backend, the KV cache and scale inputs fed once, gears, .om/manifest mismatches and teardown; and
a real-hardware run that skips without CANN and an NPU."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fake_acl import FakeAcl

from qwen2om.kernels.ascend import cpu_engine
from qwen2om.runtime.standalone import BackendError, Engine, RuntimeInputError, Sampling, pick_gear

HAVE_ACL = importlib.util.find_spec("acl") is not None
PROMPT = "A prompt long enough to need more than one prefill chunk of thirty-two tokens, then some more. " * 4


def with_om(src: Path, dst: Path, **per_kind: dict) -> Path:
    """`src` (a conversion) linked into `dst`, plus fake .om files in dst/ascend/ (see fake_acl)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "ascend":  # an --target ascend output's own ascend/ (ATC commands, no .om here)
            (dst / f.name).symlink_to(f)
    (dst / "ascend").mkdir()
    manifest = json.loads((src / "manifest.json").read_text())
    for kind, g in manifest["graphs"].items():
        om = {"onnx": str(src / g["file"]), **per_kind.get(kind, {})}
        (dst / "ascend" / f"model.{kind}.om").write_text(json.dumps(om))
    return dst


def staged_with_om(src: Path, dst: Path) -> Path:
    """A staged conversion `src` (convert --stages) linked into `dst`, each stage folder with_om's."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "stages":
            (dst / f.name).symlink_to(f)
    (dst / "stages").mkdir()
    for folder in sorted((src / "stages").iterdir()):
        with_om(folder, dst / "stages" / folder.name)
    return dst


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeAcl:
    acl = FakeAcl()
    monkeypatch.setitem(sys.modules, "acl", acl)
    return acl


def greedy(engine: Engine, ids: list[int], n: int = 20) -> list[int]:
    return engine.generate(ids, max_new_tokens=n, sampling=Sampling(0.0), ignore_eos=True)[0]


@pytest.mark.skipif(HAVE_ACL, reason="pyACL is installed here")
def test_without_pyacl_the_backend_fails_clearly(converted, cli, tmp_path: Path) -> None:
    out = converted("tiny-qwen3", "fp32")
    with pytest.raises(BackendError, match=r"pyACL \(the `acl` module from CANN\) is not installed"):
        Engine(out, backend="acl")
    code, stdout, err = cli("run", out, "--backend", "acl", "--max-new-tokens", "2")
    assert code == 2 and not stdout
    assert "pyACL (the `acl` module from CANN) is not installed" in err and "ORT backend" in err
    assert "Traceback" not in err
    proc = subprocess.run([sys.executable, str(out / "run.py"), "--backend", "acl"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "pyACL (the `acl` module from CANN) is not installed" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("model,extra,om", [
    ("tiny-qwen3", (), {}),
    ("tiny-qwen3", (), {"prefill": {"gears": [1, 2, 4, 8, 16, 32]}}),
    ("tiny-qwen3", (), {"prefill": {"gears": [4, 16, 32], "gear_format": "all"}}),
    ("tiny-qwen3-fp8", (), {}),  # 28 scale inputs, uploaded once
    ("tiny-qwen3", ("target=ascend", "soc_version=Ascend910B3"), {}),  # what `convert --target ascend` writes
    # `convert --gears`: a symbolic-T prefill graph, "compiled" for the gears its --dynamic_dims lists
    ("tiny-qwen3", ("target=ascend", "soc_version=Ascend910B3", "gears=8,16,32"), {"prefill": "dynamic_dims"}),
], ids=["static", "gears", "gears-all-inputs", "fp8-scale-inputs", "ascend-target", "ascend-gears"])
def test_fake_acl_generates_the_ort_tokens(converted, fake: FakeAcl, tmp_path: Path, model: str,
                                           extra: tuple[str, ...], om: dict) -> None:
    out = converted(model, "fp16" if extra else "fp32", *extra)
    if om.get("prefill") == "dynamic_dims":  # each gear's first value is input_ids' T
        cmd = json.loads((out / "ascend" / "atc_commands.json").read_text())["compile"][1]
        listed = next(a for a in cmd if a.startswith("--dynamic_dims=")).split("=", 1)[1]
        om = {"prefill": {"gears": [int(g.split(",")[0]) for g in listed.split(";")]}}
        assert om["prefill"]["gears"] == [8, 16, 32]
    ort = cpu_engine(out)  # an Ascend-target output's NPU ops through the reference kernels
    chunk = ort.graphs["prefill"].tokens
    ids = ort.encode(PROMPT)[:2 * chunk + 5]  # 3 chunks; the first has 5 tokens: gear 8 or 16, not 32
    want = greedy(ort, ids)
    ort.reset()
    want_logits = ort.prefill([ids])[0].copy()
    with Engine(with_om(out, tmp_path / "acl", **om), backend="acl") as acl:
        assert acl.caches == {}  # the cache lives on the (fake) device
        assert greedy(acl, ids) == want
        acl.reset()
        # The same graph on the same numbers, in another session (thread scheduling, prepacking).
        assert np.abs(acl.prefill([ids])[0] - want_logits).max() < (1e-2 if extra else 1e-5)
        if "gears" in om.get("prefill", {}):
            assert acl.graphs["prefill"].gears == tuple(om["prefill"]["gears"])
            acl.reset()
            acl.prefill([ids[:13]])  # the smallest gear holding 13 tokens is 16
            assert 16 in fake.gear_of.values()
    assert fake.leaks() == []


def test_kv_cache_and_scales_stay_on_the_device(converted, fake: FakeAcl, tmp_path: Path) -> None:
    """Per decode step: 3 host→device copies (ids, mask, positions), 1 device→host (logits), and the
    new K/V appended device to device (layers × K,V × kv heads runs); scales only at load."""
    out = converted("tiny-qwen3-fp8", "fp32")
    manifest = json.loads((out / "manifest.json").read_text())
    decode = manifest["graphs"]["decode"]
    scales = sum(io["role"] == "scale" for io in decode["inputs"])
    assert scales > 0
    with Engine(with_om(out, tmp_path / "acl"), backend="acl") as engine:
        assert fake.calls["memcpy.h2d"] == scales
        engine.prefill([engine.encode("Hello")])
        before = dict(fake.calls)
        engine.step([7])
        step = {k: v - before.get(k, 0) for k, v in fake.calls.items() if v != before.get(k, 0)}
        _, kv_heads, _, _ = next(io for io in decode["inputs"] if io["role"] == "past_key")["shape"]
        assert step == {"memcpy.h2d": 3, "memcpy.d2h": 1, "execute": 1, "execute on device 0": 1,
                        "memcpy.d2d": manifest["runtime"]["layers"] * 2 * kv_heads}  # one NPU: no context switch


def test_om_inputs_must_match_the_manifest(converted, fake: FakeAcl, tmp_path: Path, cli) -> None:
    out = converted("tiny-qwen3", "fp32")
    prefill_onnx = str(out / "model.prefill.onnx")
    swapped = with_om(out, tmp_path / "swapped", decode={"onnx": prefill_onnx})  # the prefill .om as decode's
    with pytest.raises(BackendError, match=r"model.decode.om does not match manifest.json's decode graph: input 0 "
                                           r"is 'input_ids' of 256 bytes in the .om, 'input_ids' int64\[1, 1\]"):
        Engine(swapped, backend="acl")
    assert fake.leaks() == []  # everything loaded before the error was released
    short = with_om(out, tmp_path / "short", prefill={"drop_inputs": ["past_value.3"]})
    with pytest.raises(BackendError, match=r"it has 10 inputs, the manifest 11 \(missing: \['past_value.3'\]"):
        Engine(short, backend="acl")
    assert fake.leaks() == []
    code, stdout, err = cli("run", swapped, "--backend", "acl")
    assert code == 2 and "does not match manifest.json" in err and "Traceback" not in err
    shutil.rmtree(swapped / "ascend")
    with pytest.raises(BackendError, match=r"model.decode.om: missing; compile the decode graph with the ATC command"):
        Engine(swapped, backend="acl")
    assert fake.leaks() == [] and fake.calls["init"] == 3  # a missing .om fails before the NPU is touched


def test_a_gear_outside_the_compiled_range(converted, fake: FakeAcl, tmp_path: Path) -> None:
    out = converted("tiny-qwen3", "fp32")
    with Engine(with_om(out, tmp_path / "acl", prefill={"gears": [4, 16, 32]}), backend="acl") as engine:
        with pytest.raises(RuntimeInputError, match=r"8 tokens is not a compiled gear of the prefill model \(4, 16"):
            engine.graphs["prefill"].run(8)
        with pytest.raises(RuntimeInputError, match="2 tokens is not a compiled gear of the decode model"):
            engine.graphs["decode"].run(2)
        with pytest.raises(RuntimeInputError, match="a prefill call of 33 tokens is outside the compiled range"):
            pick_gear(engine.graphs["prefill"].gears, 33, "prefill")
    too_big = with_om(out, tmp_path / "big", prefill={"gears": [16, 64]})  # compiled for more than the manifest's T
    with pytest.raises(BackendError, match="input 0 is 'input_ids' of 512 bytes in the .om"):
        Engine(too_big, backend="acl")
    assert fake.leaks() == []


def test_cli_run_with_the_acl_backend(converted, fake: FakeAcl, tmp_path: Path, cli) -> None:
    out = converted("tiny-qwen3", "fp32")
    args = ("--prompt", "The standalone stub", "--max-new-tokens", "8", "--greedy", "--json")
    code, ort_out, _ = cli("run", out, *args)
    assert code == 0
    code, acl_out, err = cli("run", with_om(out, tmp_path / "acl"), *args, "--backend", "acl")
    assert code == 0, err
    assert json.loads(acl_out)["tokens"] == json.loads(ort_out)["tokens"]
    assert fake.leaks() == []


@pytest.mark.ascend
@pytest.mark.skipif(not HAVE_ACL, reason="needs CANN's pyACL and an Ascend NPU")
def test_real_npu_matches_onnx_runtime(converted) -> None:
    """On an Ascend host (QWEN2OM_SOC_VERSION, e.g. Ascend910B3, and CANN's atc on PATH): `convert
    --target ascend` compiles both graphs, pyACL runs them, and the prefill logits and greedy tokens
    are compared with ONNX Runtime on the same output directory."""
    soc = os.environ.get("QWEN2OM_SOC_VERSION")
    if not soc or shutil.which("atc") is None:
        pytest.skip("set QWEN2OM_SOC_VERSION (see `npu-smi info`) and put CANN's atc on PATH")
    out = converted("tiny-qwen3", "fp32", "target=ascend", f"soc_version={soc}")
    assert (out / "ascend" / "model.decode.om").is_file() and (out / "ascend" / "model.prefill.om").is_file()
    ort = Engine(out)
    ids = ort.encode(PROMPT)
    want_logits = ort.prefill([ids])[0].copy()
    want = greedy(ort, ids, 16)
    with Engine(out, backend="acl") as npu:
        got_logits = npu.prefill([ids])[0]
        assert np.abs(got_logits - want_logits).max() < 1e-2 * max(1.0, float(np.abs(want_logits).max()))
        assert int(np.argmax(got_logits)) == int(np.argmax(want_logits))
        got = greedy(npu, ids, 16)
    assert np.mean(np.array(got) == np.array(want)) >= 0.9, (got, want)


def test_fake_acl_carries_hybrid_states(converted, fake: FakeAcl, tmp_path: Path) -> None:
    """Qwen3.5 hybrid: conv and recurrent states live in device buffers shared by both graphs, are
    replaced device to device after each call and zeroed on reset; the tokens are ONNX Runtime's."""
    out = converted("tiny-qwen3-5", "fp32", "prefill_chunk=16")
    ort = Engine(out)
    ids = ort.encode(PROMPT)[:2 * 16 + 5]  # three prefill calls: the states cross two chunk boundaries
    want = greedy(ort, ids)
    with Engine(with_om(out, tmp_path / "acl"), backend="acl") as acl:
        assert acl.caches == {} and len(acl.state_specs) == 6
        assert greedy(acl, ids) == want
        assert greedy(acl, ids) == want  # generate resets: states zeroed on the device
        with pytest.raises(RuntimeInputError, match="the graph takes float32"):
            acl.set_state("recurrent_state.0", np.zeros((1, 4, 16, 8), np.float32))
    assert fake.leaks() == []
