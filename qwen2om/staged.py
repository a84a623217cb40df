"""`convert --stages`: one complete static model per pipeline stage, under OUT/stages/NN/.

Each stage is converted by the whole pipeline into its own folder (graphs, external data, its layers'
caches and states, its scale inputs and scale_map.json, for Ascend its own atc command), one after the
other, so conversion memory is one stage's. OUT's own manifest.json records the split: the stages'
layer ranges and folders, and an id that every stage's manifest repeats, so a runtime can tell a stage
from another conversion. `--only-stage k` converts stage k alone (each host its own); the id is the
same on every host, as it hashes only what decides the stage graphs.

OUT/
  manifest.json          split (id, stages), runtime, the top-level files below
  tokenizer.json, …, run.py
  stages/00/manifest.json  a whole output directory: graphs, data, scales, ascend/, and a "stage" entry
                           (the split id, its index and layers)
  stages/01/…
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qwen2om.errors import RecipeError
from qwen2om.output import MANIFEST, file_entries
from qwen2om.stages import Stage, split_id, split_layers, stage_totals, stages_of

if TYPE_CHECKING:
    from qwen2om.checkpoint import ModelConfig
    from qwen2om.convert import ConvertOptions
    from qwen2om.pipeline import StepReport
    from qwen2om.recipe import Recipe

TOP_FILES = ("run.py",)  # besides the tokenizer and config files package copies (written by each stage)


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    stages: list[Stage]
    bytes: list[int]  # each stage's estimated device bytes (weights, caches, workspace)
    id: str
    only: int | None = None  # --only-stage

    @property
    def selected(self) -> list[Stage]:
        return [s for s in self.stages if self.only is None or s.index == self.only]

    def entry(self, stage: Stage) -> dict[str, Any]:
        """What a stage's own manifest records of the split."""
        return {"id": self.id, **stage.to_dict()}


def plan_split(config: ModelConfig, r: Recipe, options: ConvertOptions) -> SplitPlan:
    """The stages `options` ask for, refused before any work when they cannot be built: more stages than
    layers, a stage over the device's memory however the layers are split, an --only-stage out of range.
    With a device size (--device-memory, or the SoC's), the split is `qwen2om plan`'s, checked as it
    checks it; without one (--stages K on ONNX Runtime), the same balance with nothing to fit."""
    from qwen2om.planner import plan, stage_costs

    asked = options.stages
    if asked is None:
        flag = "--only-stage" if options.only_stage is not None else "--device-memory"
        raise RecipeError(f"{flag} needs --stages K or --stages auto")
    k = None if asked == "auto" else asked if isinstance(asked, int) else _stage_count(asked)
    if options.device_memory is not None or r.soc_version:
        p = plan(config, r, devices=k, device_memory=options.device_memory)
        bounds = [(s.start, s.stop) for s in p.stages]
        totals = [s.total for s in p.stages]
    elif k is None:
        raise RecipeError("--stages auto needs --device-memory GiB (or --target ascend --soc-version S, whose "
                          "memory qwen2om knows)")
    else:
        costs = stage_costs(config, r)
        bounds = split_layers(costs.layers, k, first=costs.first, last=costs.last)
        totals = [t + costs.workspace
                  for t in stage_totals(costs.layers, bounds, first=costs.first, last=costs.last)]
    stages = stages_of(bounds)
    if options.only_stage is not None and not 0 <= options.only_stage < len(stages):
        raise RecipeError(f"--only-stage {options.only_stage}: the split has stages 0–{len(stages) - 1}")
    key = {"config": config.config, "recipe": r.to_dict(), "layers": bounds}
    return SplitPlan(stages, totals, split_id(key), options.only_stage)


def _stage_count(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise RecipeError(f"--stages takes a number of stages or 'auto', not {value!r}") from None


Run = Callable[..., "tuple[list[StepReport], dict[str, Any]]"]


def finished(folder: Path, plan: SplitPlan, stage: Stage) -> bool:
    """A stage folder a resumed run may keep: its manifest written, for this split and stage."""
    try:
        m = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(m, dict) and m.get("stage") == plan.entry(stage)


def convert_stages(root: Path, plan: SplitPlan, key: dict[str, Any], run: Run,
                   ) -> tuple[list[StepReport], dict[str, Any]]:
    """Convert each selected stage into root/stages/NN with `run` (convert.convert_into), then write
    the top-level files and manifest. A stage finished before an interrupt is kept on --resume."""
    steps: list[StepReport] = []
    manifests: dict[int, dict[str, Any]] = {}
    for stage in plan.selected:
        folder = root / stage.dirname
        folder.mkdir(parents=True, exist_ok=True)
        if finished(folder, plan, stage):
            manifests[stage.index] = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
            continue
        stage_key = {**key, "split": plan.entry(stage)}
        done, manifests[stage.index] = run(folder, stage_key, split=stage, extra={"stage": plan.entry(stage)})
        steps += done
    return steps, write_top(root, plan, manifests)


def write_top(root: Path, plan: SplitPlan, manifests: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """OUT's own manifest: the split, what the runtime reads, and the files beside stages/ (tokenizer,
    configs, run.py, copied from a converted stage). Each stage's files are in its own manifest."""
    some = manifests[min(manifests)]
    folder = root / plan.stages[min(manifests)].dirname
    top: list[Path] = []
    for f in some["files"]:
        name = f["name"]
        if "/" not in name and not name.startswith("model.") and name not in ("scales.safetensors", "scale_map.json"):
            shutil.copyfile(folder / name, root / name)
            if name in TOP_FILES:
                (root / name).chmod(0o755)
            top.append(root / name)
    manifest = {
        "format_version": some["format_version"],
        "tools": some["tools"],
        "source": some["source"],
        "architecture": some["architecture"],
        "dims": some["dims"],
        "recipe": some["recipe"],
        "split": {"id": plan.id, "count": len(plan.stages),
                  "stages": [{**s.to_dict(), "device_bytes": b} for s, b in zip(plan.stages, plan.bytes, strict=True)],
                  **({"only": plan.only} if plan.only is not None else {})},
        "runtime": some["runtime"] | {"layers": some["dims"]["layers"]},
        "layout": some["layout"],
        "files": file_entries(root, top),
    }
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest
