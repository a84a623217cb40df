"""`convert --stages`: pipeline stages that give the unstaged model's logits, and the split itself."""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from qwen2om.errors import RecipeError
from qwen2om.stages import fewest_stages, split_layers, stage_totals

W4A16 = "w4a16"  # the llmcompressor_ckpt fixture: llm-compressor's W4A16 output for tiny-qwen3 (two shards)
PROMPT = [9707, 11, 1879, 0, 576, 3974, 13876, 38835, 43, 11, 323, 279, 1156, 220, 17, 13]  # 16 tokens: 1 chunk + 1
SMALL = ["max_seq_len=64", "prefill_chunk=8"]


# -- the split ----------------------------------------------------------------------------------------
def test_split_minimises_the_largest_stage_with_the_ends_counted() -> None:
    layers = [10] * 8
    assert split_layers(layers, 2) == [(0, 4), (4, 8)]
    # the embedding (first) and the head (last) weigh like layers: the end stages get fewer layers
    runs = split_layers(layers, 3, first=20, last=20)
    assert max(stage_totals(layers, runs, first=20, last=20)) == 40
    assert runs == [(0, 2), (2, 6), (6, 8)]
    assert split_layers([1, 1, 1, 1], 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_split_is_deterministic_and_covers_every_layer_once() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        layers = [int(x) for x in rng.integers(1, 100, rng.integers(1, 30))]
        k = int(rng.integers(1, len(layers) + 1))
        ends = {"first": int(rng.integers(0, 200)), "last": int(rng.integers(0, 200))}
        runs = split_layers(layers, k, **ends)
        assert runs == split_layers(layers, k, **ends)
        assert len(runs) == k and runs[0][0] == 0 and runs[-1][1] == len(layers)
        assert all(a < b for a, b in runs) and all(runs[i][1] == runs[i + 1][0] for i in range(k - 1))
        # no split into k runs has a smaller largest stage (checked by brute force on small cases)
        if len(layers) <= 8:
            best = min(max(stage_totals(layers, list(zip((0, *cuts), (*cuts, len(layers)), strict=True)), **ends))
                       for cuts in itertools.combinations(range(1, len(layers)), k - 1))
            assert max(stage_totals(layers, runs, **ends)) == best


def test_more_stages_than_layers_is_refused() -> None:
    with pytest.raises(RecipeError, match="--stages 5 is more than the model's 4 decoder layers"):
        split_layers([1, 1, 1, 1], 5)


def test_fewest_stages_and_a_layer_that_fits_nowhere() -> None:
    assert fewest_stages([10] * 6, 30) == [(0, 3), (3, 6)]
    assert fewest_stages([10] * 6, 25, first=5) == [(0, 2), (2, 4), (4, 6)]
    with pytest.raises(RecipeError, match=r"the last stage \(layer 5 with the final norm and LM head\) needs"):
        fewest_stages([10] * 6, 25, last=20)
    with pytest.raises(RecipeError, match="a stage holding layer 2 alone needs"):
        fewest_stages([10, 10, 40, 10], 30)


# -- staged conversions against the unstaged one ------------------------------------------------------------
@pytest.fixture
def outs(staged_outs: Callable[..., Path]) -> Callable[..., Path]:
    return staged_outs  # conftest.py: shared with test_ray_stages.py


def logits_of(out: Path, steps: int = 6, **kwargs: object) -> tuple[np.ndarray, list[int]]:
    """Prefill PROMPT (a chunk and a remainder), then greedy decode `steps` tokens: every logits row, the tokens."""
    from qwen2om.kernels.ascend import cpu_engine

    engine = cpu_engine(out, **kwargs)
    try:
        rows, tokens = [engine.prefill([PROMPT] * engine.batch)[0]], []
        for _ in range(steps):
            tokens.append(int(np.argmax(rows[-1])))
            rows.append(engine.step([tokens[-1]] * engine.batch)[0])
        return np.stack(rows), tokens
    finally:
        engine.close()


CASES = [
    ("builtin:tiny-qwen3", 2),
    ("builtin:tiny-qwen3", 3),  # 4 layers in 3 stages: uneven
    ("builtin:tiny-qwen3-moe", 2),
    ("builtin:tiny-qwen3-5", 3),  # linear, linear | linear | full: states and caches in different stages
    ("builtin:tiny-qwen3-fp8", 2),  # FP8 weights, scale inputs per stage
    (W4A16, 2),  # W4A16 (compressed-tensors)
]


@pytest.mark.parametrize(("model", "stages"), CASES, ids=[f"{m.removeprefix('builtin:')}-{k}" for m, k in CASES])
def test_staged_logits_equal_the_unstaged(outs: Callable[..., Path], model: str, stages: int,
                                          request: pytest.FixtureRequest) -> None:
    if model == W4A16:
        model = str(request.getfixturevalue("llmcompressor_ckpt"))
    whole, staged = outs(model, 0), outs(model, stages)
    want, want_tokens = logits_of(whole)
    got, got_tokens = logits_of(staged)
    # fp32: the same graphs cut in two compute the same float operations in the same order
    assert np.abs(got - want).max() <= 1e-6
    assert got_tokens == want_tokens
    top = json.loads((staged / "manifest.json").read_text())
    runs = [s["layers"] for s in top["split"]["stages"]]
    assert len(runs) == stages and runs[0][0] == 0 and runs[-1][1] == 4
    for entry in top["split"]["stages"]:
        m = json.loads((staged / entry["dir"] / "manifest.json").read_text())
        assert m["stage"]["id"] == top["split"]["id"] and m["stage"]["layers"] == entry["layers"]
        a, b = entry["layers"]
        names = [io["name"] for io in m["graphs"]["decode"]["inputs"]]
        assert names[0] == ("input_ids" if a == 0 else "hidden_in")
        assert m["graphs"]["decode"]["outputs"][0]["name"] == ("logits" if b == 4 else "hidden_out")
        layers = {io["layer"] for io in m["graphs"]["decode"]["inputs"] if "layer" in io}
        assert layers == set(range(a, b))
        scale_map = stage_scale_map(staged / entry["dir"])
        assert all(a <= v["layer"] < b for v in scale_map.values() if v.get("layer") is not None)


def stage_scale_map(folder: Path) -> dict[str, dict]:
    path = folder / "scale_map.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def test_fp8_stages_split_the_scale_inputs(outs: Callable[..., Path]) -> None:
    staged, whole = outs("builtin:tiny-qwen3-fp8", 2), outs("builtin:tiny-qwen3-fp8", 0)
    per_stage = [stage_scale_map(staged / f"stages/0{k}") for k in range(2)]
    assert per_stage[0] and per_stage[1] and not set(per_stage[0]) & set(per_stage[1])
    assert {**per_stage[0], **per_stage[1]} == stage_scale_map(whole)


def test_only_stage_on_two_hosts_assembles_into_the_same_model(outs: Callable[..., Path], tmp_path: Path) -> None:
    from qwen2om.convert import ConvertOptions, convert
    from qwen2om.runtime.standalone import RuntimeInputError

    hosts = []
    for k in range(2):
        out = tmp_path / f"host{k}"
        convert("builtin:tiny-qwen3", out, ConvertOptions.from_overrides(SMALL, stages=2, only_stage=k))
        assert sorted(p.name for p in (out / "stages").iterdir()) == [f"0{k}"]
        hosts.append(out)
    with pytest.raises(RuntimeInputError, match=r"stage 1 \(layers 2-3, .*\) is missing: convert it"):
        logits_of(hosts[0])
    shutil.copytree(hosts[1] / "stages" / "01", hosts[0] / "stages" / "01")
    full = outs("builtin:tiny-qwen3", 2)
    assert logits_of(hosts[0])[1] == logits_of(full)[1]
    for k in range(2):  # each host's stage is byte-identical to the one converted in one go
        for f in ("model.decode.onnx", "model.prefill.onnx", "model.onnx.data"):
            assert (hosts[0] / f"stages/0{k}" / f).read_bytes() == (full / f"stages/0{k}" / f).read_bytes()


def test_a_stage_from_another_conversion_is_named(outs: Callable[..., Path], tmp_path: Path) -> None:
    from qwen2om.runtime.standalone import RuntimeInputError

    mixed = tmp_path / "mixed"
    shutil.copytree(outs("builtin:tiny-qwen3", 2), mixed)
    shutil.rmtree(mixed / "stages" / "01")
    other = outs("builtin:tiny-qwen3", 2, "logits=all")  # same layers, another recipe: another split id
    shutil.copytree(other / "stages" / "01", mixed / "stages" / "01")
    with pytest.raises(RuntimeInputError, match=r"stage 1 \(layers 2-3.*\) is from another conversion"):
        logits_of(mixed)


def test_bad_stage_requests_are_refused_before_any_work(cli, tmp_path: Path) -> None:
    out = tmp_path / "o"
    code, _, err = cli("convert", "builtin:tiny-qwen3", "-o", out, "--stages", "5")
    assert code != 0 and "--stages 5 is more than the model's 4 decoder layers" in err
    # tiny-qwen3's first layer with its 39 MB tied embedding table is more than 0.03 GiB
    code, _, err = cli("convert", "builtin:tiny-qwen3", "-o", out, "--stages", "2", "--device-memory", "0.03")
    assert code != 0 and "stage 0 of 2 (layers 0–1) needs 0.0" in err and "one device has 0.03 GiB" in err
    code, _, err = cli("convert", "builtin:tiny-qwen3", "-o", out, "--stages", "auto", "--device-memory", "0.03")
    assert code != 0 and "the first stage (layer 0 with the embedding) needs 0.0" in err
    assert "cannot fit however the layers are split" in err
    code, _, err = cli("convert", "builtin:tiny-qwen3", "-o", out, "--stages", "2", "--only-stage", "2")
    assert code != 0 and "--only-stage 2: the split has stages 0–1" in err
    code, _, err = cli("convert", "builtin:tiny-qwen3", "-o", out, "--only-stage", "0")
    assert code != 0 and "--only-stage needs --stages" in err
    code, _, err = cli("convert", "builtin:tiny-qwen3", "-o", out, "--stages", "two")
    assert code != 0 and "--stages takes a number of stages or 'auto'" in err
    assert not out.exists() and not list(tmp_path.glob(".o.partial"))


def test_stages_auto_fits_the_device(outs: Callable[..., Path], tmp_path: Path) -> None:
    from qwen2om.convert import ConvertOptions, convert
    from qwen2om.planner import stage_costs

    whole = json.loads((outs("builtin:tiny-qwen3", 2) / "manifest.json").read_text())
    biggest = max(s["device_bytes"] for s in whole["split"]["stages"])
    gib = biggest * 1.01 / (1 << 30)  # room for the 2-stage split's largest stage, not for one stage
    out = tmp_path / "auto"
    result = convert("builtin:tiny-qwen3", out, ConvertOptions.from_overrides(SMALL, stages="auto", device_memory=gib))
    split = result.manifest["split"]
    assert split["count"] >= 2
    assert all(s["device_bytes"] <= gib * (1 << 30) for s in split["stages"])
    assert stage_costs  # the estimate convert balances with is the planner's (qwen2om plan prints the same)


def test_resume_keeps_finished_stages(tmp_path: Path, outs: Callable[..., Path]) -> None:
    from qwen2om.convert import ConvertOptions, convert
    from qwen2om.errors import Interrupted

    out, seen = tmp_path / "r", []

    def interrupt_in_stage_1(label: str, done: int, total: int, unit: str = "") -> None:
        seen.append(label)
        if label.startswith("exporting") and sum(x.startswith("exporting decode") for x in seen) > 2:
            raise KeyboardInterrupt  # stage 1's export: stage 0 is finished

    with pytest.raises(Interrupted):
        convert("builtin:tiny-qwen3", out, ConvertOptions.from_overrides(SMALL, stages=2),
                progress=interrupt_in_stage_1)
    kept = tmp_path / ".r.partial" / "stages" / "00" / "manifest.json"
    assert kept.is_file()
    before = kept.stat().st_mtime_ns
    convert("builtin:tiny-qwen3", out, ConvertOptions.from_overrides(SMALL, stages=2, resume=True))
    assert (out / "stages" / "00" / "manifest.json").stat().st_mtime_ns == before  # not converted again
    full = outs("builtin:tiny-qwen3", 2)
    for k in range(2):
        for f in ("model.decode.onnx", "model.prefill.onnx", "model.onnx.data"):
            assert (out / f"stages/0{k}" / f).read_bytes() == (full / f"stages/0{k}" / f).read_bytes()


def test_ascend_stages_each_get_an_atc_command_and_pass_the_checker(outs: Callable[..., Path], cli) -> None:
    out = outs("builtin:tiny-qwen3-moe", 2, "target=ascend", "soc_version=Ascend910B3", "compile=dry-run")
    for k in range(2):
        folder = out / f"stages/0{k}"
        commands = (folder / "ascend" / "atc.sh").read_text() if (folder / "ascend" / "atc.sh").is_file() else ""
        commands = commands or "\n".join(p.read_text() for p in sorted((folder / "ascend").glob("*.sh")))
        first_input = "input_ids:1,8" if k == 0 else "hidden_in:1,8,"
        assert first_input in commands, commands
        assert "--soc_version=Ascend910B3" in commands
    code, stdout, err = cli("inspect", out, "--check", "ascend", "--soc-version", "Ascend910B3")
    assert code == 0, err
    assert "stage0/decode" in stdout and "stage1/prefill" in stdout
    code, stdout, err = cli("verify", out)
    assert code == 0 and "PASS" in stdout, stdout + err


def test_acl_backend_runs_one_npu_per_stage(outs: Callable[..., Path], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the fake pyACL (tests/fake_acl.py): stage k on NPU k (or --devices), the ORT tokens."""
    import sys

    from fake_acl import FakeAcl
    from test_acl_backend import staged_with_om

    from qwen2om.runtime.standalone import BackendError, Engine

    fake = FakeAcl()
    monkeypatch.setitem(sys.modules, "acl", fake)
    staged = outs("builtin:tiny-qwen3", 2)
    mirror = staged_with_om(staged, tmp_path / "acl")
    want = logits_of(staged)[1]
    with Engine(mirror, backend="acl", devices=[3, 5]) as engine:
        assert engine.caches == {}
        rows = [engine.prefill([PROMPT])[0]]
        tokens = []
        for _ in range(6):
            tokens.append(int(np.argmax(rows[-1])))
            rows.append(engine.step([tokens[-1]])[0])
    assert tokens == want
    # 2 prefill chunks + 6 decode steps on each NPU
    assert fake.calls["execute on device 3"] == fake.calls["execute on device 5"] == 8
    assert fake.leaks() == []
    with pytest.raises(BackendError, match="--devices names 1 NPUs for 2 stages"):
        Engine(mirror, backend="acl", devices=[0])
    assert fake.leaks() == []


def test_run_eval_verify_and_run_py_take_a_staged_out(outs: Callable[..., Path], cli) -> None:
    import subprocess
    import sys

    whole, staged = outs("builtin:tiny-qwen3", 0), outs("builtin:tiny-qwen3", 3)
    said = {}
    for name, out in (("whole", whole), ("staged", staged)):
        code, stdout, err = cli("run", out, "--prompt", "Once upon a time", "--greedy", "--max-new-tokens", "12",
                                "--json")
        assert code == 0, err
        tokens = json.loads(stdout)["tokens"]
        code, ppl, err = cli("eval", "ppl", out, "--dataset", "builtin:prose", "--max-windows", "2", "--window", "32")
        assert code == 0, err
        script = subprocess.run([sys.executable, str(out / "run.py"), "--prompt", "Once upon a time", "--greedy",
                                 "--max-new-tokens", "12", "--json"], capture_output=True, text=True, check=True)
        said[name] = (tokens, ppl.split(" on ")[0], json.loads(script.stdout)["tokens"])
    assert said["staged"] == said["whole"]
    code, stdout, err = cli("verify", staged, "--tokens", "8")
    assert code == 0 and "PASS" in stdout, stdout + err


def test_run_prompts_file_continues_each_prompt(outs: Callable[..., Path], cli, tmp_path: Path) -> None:
    staged = outs("builtin:tiny-qwen3", 2)
    texts = ["Once upon a time", "The capital of France is", "def fib(n):"]
    (tmp_path / "p.txt").write_text("\n".join(texts) + "\n\n")
    code, stdout, err = cli("run", staged, "--prompts-file", tmp_path / "p.txt", "--greedy", "--max-new-tokens", "6",
                            "--json")
    assert code == 0, err
    got = [json.loads(line) for line in stdout.splitlines()]
    assert [g["prompt"] for g in got] == texts
    for text, g in zip(texts, got, strict=True):
        code, one, err = cli("run", staged, "--prompt", text, "--greedy", "--max-new-tokens", "6", "--json")
        assert json.loads(one)["tokens"] == g["tokens"]
    code, _, err = cli("run", staged, "--prompts-file", tmp_path / "p.txt", "--prompt", "Hi")
    assert code == 2 and "--prompts-file gives the prompts" in err
    code, _, err = cli("run", staged, "--prompts-file", tmp_path / "missing.txt")
    assert code == 2 and "--prompts-file" in err and "cannot read it" in err


def test_staged_gears_give_the_unstaged_gears_logits(outs: Callable[..., Path]) -> None:
    """Prefill gears (a symbolic token axis): each stage's hidden_in/hidden_out grow with the call's gear."""
    whole, staged = outs("builtin:tiny-qwen3", 0, "gears=4,8"), outs("builtin:tiny-qwen3", 2, "gears=4,8")
    m = json.loads((staged / "stages" / "01" / "manifest.json").read_text())
    assert m["graphs"]["prefill"]["gears"] == [4, 8]
    want, want_tokens = logits_of(whole)
    got, got_tokens = logits_of(staged)  # PROMPT: a chunk of 8, then 8 more; decode: T = 1
    assert np.abs(got - want).max() <= 1e-6 and got_tokens == want_tokens
