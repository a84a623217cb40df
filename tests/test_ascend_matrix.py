"""Every Ascend graph qwen2om can produce passes the Ascend checker and verifies (issue 23, item 3).

The matrix: each built-in architecture (dense Qwen2 with q/k/v biases, Qwen3, Qwen3-MoE, Qwen2-MoE
with its shared expert, Qwen3.5 as published, Qwen3.5-MoE, Qwen3-Next) × fp16 / W4A16 / FP8 ×
Ascend910B3 / Ascend310P3 / Ascend310B1, with and without prefill gears, plus batch 2.

The graphs depend on the SoC: the fusion passes (fuse_*_ascend) emit the NPU's fused ops where the
SoC's op-info configs have kernels (910B: norms, RoPE, MoE routing, prefill attention; 310P: the norms;
310B: none), and the int4 lowering picks WeightQuantBatchMatmulV2 or int8 + Cast/Mul. So each
conversion is for one SoC, checked with `check_graphs` for it (what `inspect --check ascend` runs, so
a stricter checker applies here as it lands) and verified once through the reference kernels on CPU:
verify's fp16 criterion, every greedy token equal. Every architecture and scheme runs on 910B3 (the
fused graphs), fp16 and W4A16 on 310B1 (the portable ones; FP8 on two models, its lowering reads no
SoC); 310P3 on a dense, a MoE and a hybrid model in fp16 and W4A16 on one; gears and batch 2 on
910B3, batch 2 on 310B1 once. `test_the_soc_decides_the_fused_ops` checks that
the 310B1 graphs are the portable form: the fused passes change nothing there.

Refused by design, each checked here before any work: prefill gears for the Qwen3.5 / Qwen3-Next
hybrids; int4 on a SoC without an int4 matmul unless `weight_storage=int8` is given; int4 with fp32
activations. (A W4A16 checkpoint whose group is not a multiple of 32 is refused by the checker on
WeightQuantBatchMatmulV2 SoCs; the weights of width 48 in the shared experts are left float here.)

All slow: about fifty-five conversions, shared through module-scoped caches (and conftest's `converted`
with tests/test_gears.py and tests/test_ascend_defects.py), each verified on two short prompts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import onnx
import pytest

from qwen2om.ascend import soc_info
from qwen2om.builtin import FP8_BUILTINS
from qwen2om.convert import convert
from qwen2om.errors import Qwen2omError
from qwen2om.inspect import check_graphs
from qwen2om.verify import verify

pytestmark = pytest.mark.slow

SOCS = ("Ascend910B3", "Ascend310P3", "Ascend310B1")
SMALL = ["max_seq_len=256", "prefill_chunk=32"]
GEARS = "gears=8,16,32"
HYBRIDS = ("tiny-qwen3-5", "tiny-qwen3-5-moe", "tiny-qwen3-next")
ARCHS = ("tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen2-moe", *HYBRIDS)
# Width-48 shared-expert down projections: no group of 32 divides them, so they stay float.
ODD_WIDTHS = (r".*shared_expert\.down_proj",)
# A 5-token prompt and a 41-token one: two chunks of prefill (32 + 9), so gears 8/16 and 32 all run.
PROMPTS = ["The tiny model", "A prompt long enough for two chunks of the prefill graph, which takes thirty-two "
                             "tokens at most per call, and then some."]


@dataclasses.dataclass(frozen=True)
class Case:
    """One conversion and the SoCs it is checked for."""

    arch: str
    scheme: str  # fp16 | w4a16 | fp8
    socs: tuple[str, ...]
    extra: tuple[str, ...] = ()  # gears / batch

    @property
    def id(self) -> str:
        soc = self.socs[0].removeprefix("Ascend") + (f"+{len(self.socs) - 1}" if len(self.socs) > 1 else "")
        extra = ("gears" if e.startswith("gears=") else e.replace("batch_size=", "batch") for e in self.extra)
        return "-".join([self.arch.removeprefix("tiny-"), self.scheme, soc, *extra])

    def overrides(self) -> list[str]:
        storage = ["weight_storage=int8"] if self.scheme == "w4a16" and not soc_info(self.socs[0]).w4a16 else []
        return ["target=ascend", f"soc_version={self.socs[0]}", *storage, *self.extra]


def cases() -> Iterator[Case]:
    fused, portable, duo = ("Ascend910B3",), ("Ascend310B1",), ("Ascend310P3",)
    for arch in ARCHS:
        for scheme in ("fp16", "w4a16", "fp8"):
            yield Case(arch, scheme, fused)
            # FP8's lowering reads no SoC: the portable FP8 graphs are checked on one dense and one MoE model
            if scheme != "fp8" or arch in ("tiny-qwen3", "tiny-qwen3-moe"):
                yield Case(arch, scheme, portable)
            # gears: every non-hybrid in fp16, and the quantised forms on one dense and one MoE model
            if arch not in HYBRIDS and (scheme == "fp16" or arch in ("tiny-qwen3", "tiny-qwen3-moe")):
                yield Case(arch, scheme, fused, (GEARS,))
    # 310P3 fuses the norms only (the hybrids' 1 + w cast to fp16 there): a dense, a MoE and a hybrid model
    for arch in ("tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen3-5"):
        yield Case(arch, "fp16", duo)
    yield Case("tiny-qwen3", "w4a16", duo)
    for arch in ("tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen3-next"):
        yield Case(arch, "fp16", fused, ("batch_size=2",))
    yield Case("tiny-qwen3", "fp16", portable, ("batch_size=2",))


CASES = list(cases())


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], str]:
    """(arch, scheme) → the checkpoint to convert and verify against: the builtin itself, its FP8
    builtin, or a calibration (RTN W4A16 in groups of 32; data-free FP8 blocks) done once."""
    from qwen2om.quant.calibrate import CalibrationConfig, calibrate

    done: dict[tuple[str, str], str] = {}

    def get(arch: str, scheme: str) -> str:
        fp8 = f"{arch}-fp8"
        if scheme == "fp16":
            return f"builtin:{arch}"
        if scheme == "fp8" and fp8 in FP8_BUILTINS:
            return f"builtin:{fp8}"
        if (arch, scheme) not in done:
            out = tmp_path_factory.mktemp("ckpt") / f"{arch}-{scheme}"
            cfg = (CalibrationConfig(num_samples=8, seq_len=64, scheme="fp8-block") if scheme == "fp8" else
                   CalibrationConfig(num_samples=8, seq_len=64, method="rtn", group_size=32, ignore=ODD_WIDTHS))
            calibrate(f"builtin:{arch}", out, cfg)
            done[arch, scheme] = str(out)
        return done[arch, scheme]

    return get


@pytest.fixture(scope="module")
def output(converted, source, tmp_path_factory: pytest.TempPathFactory) -> Callable[[Case], Path]:
    """Case → its output directory, converted once per module (builtins once per session)."""
    done: dict[Case, Path] = {}

    def get(case: Case) -> Path:
        if case not in done:
            model = source(case.arch, case.scheme)
            if model.startswith("builtin:"):  # Ascend's default dtype, spelled out: conftest's key
                done[case] = converted(model.removeprefix("builtin:"), "fp16", *case.overrides())
            else:
                out = tmp_path_factory.mktemp("ascend") / case.id
                convert(model, out, overrides=[*SMALL, *case.overrides()])
                done[case] = out
        return done[case]

    return get


def defects(out: Path) -> list[str]:
    """The issue's three defects, found by hand (independent of the checker's state)."""
    found = []
    for f in sorted(out.glob("model.*.onnx")):
        for n in onnx.load(f, load_external_data=False).graph.node:
            attrs = {a.name for a in n.attribute}
            if (n.op_type in ("TopK", "AscendAntiQuant") or (n.op_type == "Shape" and attrs & {"start", "end"})
                    or (n.op_type == "Reshape" and "allowzero" in attrs)):
                found.append(f"{f.name}: {n.op_type} {n.name}")
    return found


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_every_graph_passes_the_checker_and_verifies(output, source, case: Case) -> None:
    out = output(case)
    assert defects(out) == []
    for soc in case.socs:
        problems = check_graphs(out, "ascend", soc)
        assert problems == {"decode": [], "prefill": []}, (soc, problems)
    ops = {n.op_type for n in onnx.load(out / "model.decode.onnx", load_external_data=False).graph.node}
    if case.scheme == "w4a16":  # the lowering this SoC group gets
        assert ("WeightQuantBatchMatmulV2" in ops) == soc_info(case.socs[0]).w4a16
    # verify's own fp16 criterion, and every greedy token equal. (|Δlogits| reaches 4.7e-2 on Qwen3-Next's
    # second prompt, the same with the TopK graph as with the ArgMax rounds: fp16 over chunked linear attention.)
    report = verify(out, source(case.arch, case.scheme), tokens=4, prompts=PROMPTS)
    assert report.passed and report.agreement == 1.0, report


def graphs(out: Path) -> dict[str, bytes]:
    return {f.name: onnx.load(f, load_external_data=False).SerializeToString()
            for f in sorted(out.glob("model.*.onnx"))}


NPU_OPS = {"NPURmsNorm", "NPUAddRmsNorm", "NPURotaryPositionEmbedding", "NPUMoeGatingTopKSoftmax",
           "NPUPromptFlashAttention"}


def npu_ops(out: Path) -> dict[str, set[str]]:
    return {f.name: {n.op_type for n in onnx.load(f, load_external_data=False).graph.node if n.domain == "npu"}
            for f in sorted(out.glob("model.*.onnx"))}


def test_the_soc_decides_the_fused_ops(output, converted, tmp_path: Path) -> None:
    """An fp16 MoE model: 910B3 gets every fused op (prefill attention included), 310P3 the norms only,
    310B1 none, and its graphs are the same bytes as a conversion whose recipe has no fusion pass."""
    b3 = npu_ops(output(Case("tiny-qwen3-moe", "fp16", ("Ascend910B3",))))
    assert b3["model.prefill.onnx"] == NPU_OPS, b3
    assert b3["model.decode.onnx"] == NPU_OPS - {"NPUPromptFlashAttention"}, b3  # decode attention: portable
    p3 = npu_ops(output(Case("tiny-qwen3-moe", "fp16", ("Ascend310P3",))))
    assert p3 == {"model.decode.onnx": {"NPURmsNorm", "NPUAddRmsNorm"},
                  "model.prefill.onnx": {"NPURmsNorm", "NPUAddRmsNorm"}}, p3
    b1 = output(Case("tiny-qwen3-moe", "fp16", ("Ascend310B1",)))
    assert npu_ops(b1) == {"model.decode.onnx": set(), "model.prefill.onnx": set()}
    recipe = (Path(__file__).parent.parent / "recipes" / "ascend.yaml").read_text(encoding="utf-8")
    unfused = tmp_path / "unfused.yaml"
    unfused.write_text("\n".join(line for line in recipe.splitlines() if "fuse_" not in line) + "\n",
                       encoding="utf-8")
    out = tmp_path / "unfused"
    convert("builtin:tiny-qwen3-moe", out, recipe=str(unfused),
            overrides=[*SMALL, "dtype=fp16", "target=ascend", "soc_version=Ascend310B1"])
    assert graphs(out) == graphs(b1)


def test_refused_by_design(source, tmp_path: Path) -> None:
    """What the matrix leaves out is refused before any work, with the fix named, and leaves no OUT."""
    with pytest.raises(Qwen2omError, match="prefill gears are not supported for qwen3_next"):
        convert("builtin:tiny-qwen3-next", tmp_path / "a", overrides=[*SMALL, "target=ascend",
                                                                      "soc_version=Ascend910B3", GEARS])
    w4 = source("tiny-qwen3", "w4a16")
    for soc in (s for s in SOCS if not soc_info(s).w4a16):
        with pytest.raises(Qwen2omError, match="weight_storage=int8"):
            convert(w4, tmp_path / "b", overrides=[*SMALL, "target=ascend", f"soc_version={soc}"])
    with pytest.raises(Qwen2omError, match="--dtype fp16"):
        convert(w4, tmp_path / "c", overrides=[*SMALL, "target=ascend", "soc_version=Ascend910B3", "dtype=fp32"])
    assert not any((tmp_path / d).exists() for d in "abc")
