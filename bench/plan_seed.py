"""`qwen2om plan` for the seed systems, from header-only checkpoints of their published shapes.

Writes each checkpoint with real safetensors headers and holes for data (a few MB on disk whatever the
model: fixtures/synthetic.py, `header_only=True`) into a temporary directory, runs the planner as
`qwen2om plan` does, and prints one markdown table (docs/plan.md quotes it):

- Qwen3.5-397B-A17B W4A16 on 910B (deployed on 8 hosts × 8 Atlas 800I A2 cards);
- Qwen3.6-35B-A3B-FP8 on 910B: Qwen3.5-35B-A3B's shapes with every decoder linear e4m3fn in 128×128 tiles
  and a bf16 `weight_scale_inv` (Hugging Face fine-grained FP8, experts one tensor each, as Qwen's FP8
  releases are), written here because fixtures/synthetic.py writes bf16 only;
- Qwen3-Coder-30B-A3B-Instruct W4A16 on 910B and on 310P3; Qwen3.5-35B-A3B W4A16 on 310P3;
- Qwen3-32B fp16 on 910B.

W4A16 rows plan the float checkpoint with `--scheme w4a16`: the bytes calibrate's output would have
(symmetric int4, groups of 128). Each system is planned as the bundled Ascend recipe converts it (fp16,
P = 2048, B = 1, prefill chunk 128); MoE rows add what-if rows for experts kept quantised.

    .venv/bin/python bench/plan_seed.py [--max-seq-len 2048] [--batch-size 1] [--keep DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.resources
import json
import math
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from qwen2om.checkpoint import Checkpoint
from qwen2om.convert import choose_recipe, read_config
from qwen2om.errors import Qwen2omError
from qwen2om.fixtures.fp8 import LINEAR
from qwen2om.fixtures.layouts import QWEN3_5_35B_A3B, unfuse_experts
from qwen2om.fixtures.synthetic import TensorSpec, write_header_only_shards, write_synthetic_checkpoint
from qwen2om.planner import Plan, Storage, plan
from qwen2om.stages import gib

FP8_BLOCK = 128
# Small shards: qwen2om.quantized.read_fp8 parses a shard's header once per FP8 weight (`setdefault` builds
# the Shard before looking), so 31k weights in 4 GiB shards (700 KB headers) took over ten minutes.
SHARD = 128 << 20
ASCEND_FP8_EXPERTS = "lower_fp8: {storage: bytes, experts: true}"


@dataclasses.dataclass(frozen=True)
class Row:
    system: str
    checkpoint: str  # a preset of fixtures/synthetic.py, or "fp8:<preset>" (written here)
    soc: str
    scheme: str | None = None
    what_if: str = ""  # "fp8-experts": the Ascend recipe with lower_fp8 {experts: true}; "int4-experts": no such pass
    context: str = ""


ROWS = [
    Row("Qwen3.5-397B-A17B W4A16", "qwen3.5-397b-a17b", "Ascend910B3", "w4a16",
        context="deployed on 8 hosts × 8 cards"),
    Row("Qwen3.5-397B-A17B W4A16", "qwen3.5-397b-a17b", "Ascend910B3", "w4a16", "int4-experts"),
    Row("Qwen3.6-35B-A3B-FP8", "fp8:qwen3.5-35b-a3b", "Ascend910B3"),
    Row("Qwen3.6-35B-A3B-FP8", "fp8:qwen3.5-35b-a3b", "Ascend910B3", what_if="fp8-experts"),
    Row("Qwen3-Coder-30B-A3B-Instruct W4A16", "qwen3-coder-30b-a3b-instruct", "Ascend910B3", "w4a16"),
    Row("Qwen3-Coder-30B-A3B-Instruct W4A16", "qwen3-coder-30b-a3b-instruct", "Ascend910B3", "w4a16", "int4-experts"),
    Row("Qwen3-Coder-30B-A3B-Instruct W4A16", "qwen3-coder-30b-a3b-instruct", "Ascend310P3", "w4a16"),
    Row("Qwen3.5-35B-A3B W4A16", "qwen3.5-35b-a3b", "Ascend310P3", "w4a16"),
    Row("Qwen3-32B fp16", "qwen3-32b", "Ascend910B3"),
]


# -- an FP8 header-only checkpoint -----------------------------------------------------------------
def fp8_table(table: dict[str, tuple[int, ...]]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name → (safetensors dtype, shape): experts one tensor each; every decoder linear F8_E4M3 with a
    BF16 [⌈N/128⌉, ⌈K/128⌉] `weight_scale_inv` beside it; the rest BF16."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, shape in unfuse_experts(table).items():
        if LINEAR.search(name) and len(shape) == 2:
            n, k = shape
            out[name] = ("F8_E4M3", shape)
            out[name.removesuffix(".weight") + ".weight_scale_inv"] = (
                "BF16", (math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK)))
        else:
            out[name] = ("BF16", shape)
    return out


def write_header_only(dest: Path, table: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """Safetensors shards with real headers and sparse (hole) data areas, and their index
    (fixtures/synthetic.write_header_only_shards, with the FP8 weights' own dtype)."""
    specs = [TensorSpec(name, shape, "matrix") for name, (_, shape) in table.items()]
    index = write_header_only_shards(dest, specs, SHARD, dtypes={n: d for n, (d, _) in table.items()})
    (dest / "model.safetensors.index.json").write_text(json.dumps(index))


def write_fp8(dest: Path) -> Path:
    """Qwen3.6-35B-A3B-FP8 as header-only files: Qwen3.5-35B-A3B's config and shapes, FP8 decoder linears."""
    dest.mkdir(parents=True)
    cfg = QWEN3_5_35B_A3B.config_for()
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
                                  "modules_to_not_convert": ["lm_head", "mlp.gate", "mlp.shared_expert_gate",
                                                             "linear_attn.in_proj_a", "linear_attn.in_proj_b"]}
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    write_header_only(dest, fp8_table(QWEN3_5_35B_A3B.tensors(QWEN3_5_35B_A3B.config_for())))
    return dest


def checkpoint_for(spec: str, root: Path, made: dict[str, Path]) -> Path:
    if spec not in made:
        dest = root / re.sub(r"[^\w.-]", "_", spec)
        made[spec] = (write_fp8(dest) if spec.startswith("fp8:")
                      else write_synthetic_checkpoint(spec, dest, header_only=True))
    return made[spec]


# -- the table --------------------------------------------------------------------------------------
def run(row: Row, path: Path, settings: dict[str, Any], recipes: Path) -> Plan:
    cfg = read_config(path)
    recipe = None
    if row.what_if == "fp8-experts":
        text = (importlib.resources.files("qwen2om.recipes") / "ascend.yaml").read_text(encoding="utf-8")
        recipe_file = recipes / "ascend-fp8-experts.yaml"
        recipe_file.write_text(re.sub(r"lower_fp8: \{storage: bytes\}", ASCEND_FP8_EXPERTS, text))
        recipe = str(recipe_file)
    r = choose_recipe(cfg, recipe, {"target": "ascend", "soc_version": row.soc, **settings})
    storage = dataclasses.replace(Storage.of(r), int4_experts="target") if row.what_if == "int4-experts" else None
    ckpt = Checkpoint(path, cfg)
    try:
        ckpt.validate_layout()
        return plan(cfg, r, ckpt, scheme=row.scheme, storage=storage, name=row.system)
    finally:
        ckpt.close()


def storage_of(row: Row, p: Plan) -> str:
    quantised = "fp16" if not (row.scheme or row.checkpoint.startswith("fp8")) else (
        "FP8" if row.checkpoint.startswith("fp8") else "W8A16 (int8)" if "310P" in row.soc else "W4A16 (WQBMM int4)")
    experts = ""
    if p.architecture.endswith("moe"):
        experts = {"": "; experts fp16 (as converted today)", "fp8-experts": "; experts FP8 (`lower_fp8: {experts: "
                   "true}`)", "int4-experts": "; experts int4 (**what-if**: no Ascend int4 expert lowering exists)"
                   }[row.what_if]
    return quantised + experts


def table(rows: list[tuple[Row, Plan | str]]) -> str:
    head = ("| system | SoC (GiB) | weights as stored | weights | KV + state | workspace / stage | total | devices "
            "(fewest that fit) | layers per stage | largest stage |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for row, p in rows:
        if isinstance(p, str):
            lines.append(f"| {row.system} | {row.soc} | {p} |")
            continue
        weights = sum(sum(st.weights.values()) for st in p.stages)
        cache = sum(st.kv_cache + st.linear_state for st in p.stages)
        sizes = [st.stop - st.start for st in p.stages]
        largest = max(st.total for st in p.stages)
        counts = ", ".join(str(s) for s in sizes) if len(sizes) <= 12 else (
            f"{min(sizes)}–{max(sizes)} ({len(sizes)} stages)")
        ctx = f" ({row.context})" if row.context else ""
        total = weights + cache + len(p.stages) * p.stages[0].workspace
        lines.append(f"| {row.system}{ctx} | {row.soc} ({p.device.memory / 2**30:.0f}) | {storage_of(row, p)} | "
                     f"{gib(weights)} | {gib(cache)} | {gib(p.stages[0].workspace)} | {gib(total)} | "
                     f"**{len(p.stages)}** | {counts} | {gib(largest)} ({largest / p.device.memory:.0%}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--keep", type=Path, help="write the checkpoints here (kept) instead of a temporary directory")
    a = ap.parse_args(argv)
    settings = {"max_seq_len": a.max_seq_len, "batch_size": a.batch_size}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="plan-seed-") as tmp:
        root = a.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        made: dict[str, Path] = {}
        results: list[tuple[Row, Plan | str]] = []
        for row in ROWS:
            path = checkpoint_for(row.checkpoint, root, made)
            try:
                results.append((row, run(row, path, settings, Path(tmp))))
            except Qwen2omError as e:
                results.append((row, f"does not fit: {e}"))
        disk = sum(f.stat().st_blocks * 512 for p in made.values() for f in p.rglob("*") if f.is_file())
    print(table(results))
    print(f"\nP = {a.max_seq_len}, B = {a.batch_size}, fp16, prefill chunk 128; {len(made)} header-only checkpoints "
          f"({disk / 2**20:.0f} MiB on disk), {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
