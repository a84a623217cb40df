"""`convert`: a checkpoint into a static-shape output directory, as one library call."""

from __future__ import annotations

import dataclasses
import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import qwen2om.passes  # noqa: F401  (registers the passes)
from qwen2om.arch import ModelDims, resolve_arch
from qwen2om.builtin import resolve_model
from qwen2om.checkpoint import TOKENIZER_FILES, Checkpoint, check_tokenizer_sources, read_json
from qwen2om.confine import confined
from qwen2om.errors import CheckpointError, DiskFullError, Interrupted, Qwen2omError, RecipeError
from qwen2om.generation import read_generation
from qwen2om.graphdump import pass_dumper
from qwen2om.journal import Journal
from qwen2om.output import FORMAT_VERSION, file_entries, staged_output, tool_versions, write_manifest
from qwen2om.passes.lower_int4_ascend import int4_form
from qwen2om.passes.package import CONFIG_FILES
from qwen2om.passes.write_onnx import graph_file
from qwen2om.pipeline import RunContext, StepReport, Workspace, no_progress, run_pipeline
from qwen2om.recipe import DTYPES, TARGETS, Recipe, apply_overrides, load_recipe
from qwen2om.rope import rope_tables
from qwen2om.static_hybrid import hybrid_rope_tables

LAYOUT = {
    "kv_cache": "BNSD: [batch, kv_heads, capacity, head_dim]; outputs hold the T new tokens only",
    "linear_weights": "stored transposed, [in_features, out_features], names as in the checkpoint",
    "tied_embeddings": "one [hidden, vocab] table: Gather(axis=1) for the embedding, MatMul for lm_head",
    "rope": "cos/sin float32 tables [capacity, head_dim] gathered by position_ids",
    "attention_mask": "additive, compute dtype, 0 = visible, finfo(dtype).min = hidden; columns = P cache + T new",
}


@dataclasses.dataclass
class ConvertResult:
    out: Path
    recipe: Recipe
    steps: list[StepReport]
    manifest: dict[str, Any]


def choose_recipe(source: Path, recipe: str | None, overrides: list[str]) -> tuple[Recipe, ModelDims]:
    """The recipe for this checkpoint: named/file, or `<family>-<dtype>`; overrides; autos resolved."""
    if source.is_file():
        raise CheckpointError(f"{source} is a file: give its directory, a checkpoint (config.json + *.safetensors), "
                              "or builtin:NAME")
    cfg_path = source / "config.json"
    cfg = read_json(cfg_path, "config.json")
    arch = resolve_arch(cfg, str(cfg_path))
    dims = ModelDims.from_config(cfg, str(cfg_path))
    if recipe is None:
        def given(key: str, default: str) -> str:
            return next((o.split("=", 1)[1].strip() for o in reversed(overrides) if o.startswith(f"{key}=")), default)

        target = given("target", "ort")
        dtype = given("dtype", "fp16" if target == "ascend" else "fp32")  # the NPU computes in fp16
        if dtype not in DTYPES:
            raise RecipeError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
        if target not in TARGETS:
            raise RecipeError(f"target={target!r} is not one of {', '.join(TARGETS)}")
        family = arch.recipe or arch.name
        recipe = f"{family}-ascend-{dtype}" if target == "ascend" else f"{family}-{dtype}"
    r = apply_overrides(load_recipe(recipe), overrides)
    if r.gears and arch.hybrid:  # checked here, before any work: export_onnx would fail minutes later
        raise RecipeError(f"gears={','.join(map(str, r.gears))}: prefill gears are not supported for {arch.name} "
                          "yet (its chunked linear attention splits a chunk into blocks by the chunk size, "
                          "static_hybrid.py, so one graph cannot serve every gear); convert without --gears")
    return r.resolved(dims.max_positions), dims


def preflight(source: Path, r: Recipe, dims: ModelDims, *, allow_unused: bool = False,
              log: Callable[[str], None] = lambda m: None) -> None:
    """Refusals that need only config.json and the checkpoint's tensor table, made before anything is
    staged: the passes that raise them run after every shard is read (static_model's RoPE tables) or
    after the ONNX export (lower_int4_ascend), minutes into a large conversion. (max_seq_len against
    the model's limit is choose_recipe's.)"""
    from qwen2om.recipe import check_capacity

    check_capacity(r, dims)  # before static_model's RoPE tables and export_onnx's traced caches exist
    if (source / "config.json").is_file():  # the manifest's stop and pad ids, written at the very end
        read_generation(source, read_json(source / "config.json", "config.json"), dims.vocab)
    passes = {name for name, _ in r.pipeline}
    if "package" in passes:  # files it copies into OUT: inside the checkpoint, regular (qwen2om.confine)
        for name in (*TOKENIZER_FILES, *CONFIG_FILES):
            if (source / name).exists() or (source / name).is_symlink():
                confined(source, name)
        check_tokenizer_sources(source)
        chat_format(source)  # a template file that cannot be read is named now, not after the export
    if "static_model" in passes:  # a one-row table: the same refusals, none of the work
        cfg = read_json(source / "config.json", "config.json")
        if resolve_arch(cfg, str(source / "config.json")).hybrid:
            hybrid_rope_tables(cfg, dims, 1)
        else:
            rope_tables(cfg, 1)
    if "load_checkpoint" in passes or "lower_int4_ascend" in passes:
        try:
            ckpt = Checkpoint(source)  # lazy: headers and quantisation metadata, no weights
            if "load_checkpoint" in passes:
                ckpt.validate_layout()  # first: a missing or misshapen tensor says more than an unused one
        except Qwen2omError:
            return  # load_checkpoint says what is wrong with it, naming its pass
        try:
            if "load_checkpoint" in passes:  # tensors the config leaves out: refused, or with allow_unused said
                ckpt.check_unused(log if allow_unused else None)
            if "lower_int4_ascend" in passes:
                int4_form(ckpt.quantized, r.soc_version, r.weight_storage, fp16=r.dtype == "fp16")
        finally:
            ckpt.close()


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def choose_workers(asked: int | None, log: Callable[[str], None]) -> int:
    """`--workers N`, capped at the cores this process may use (said when capped); default: all of them."""
    cores = available_cores()
    if asked is None:
        return cores
    if asked < 1:
        raise RecipeError(f"--workers must be at least 1 (got {asked})")
    if asked > cores:
        log(f"--workers {asked} is more than the {cores} cores available here; using {cores}")
        return cores
    return asked


def convert(
    model: str | Path, out: Path, *, recipe: str | None = None, overrides: list[str] | None = None,
    force: bool = False, resume: bool = False, workers: int | None = None,
    progress: Callable[..., None] = no_progress,
    log: Callable[[str], None] = lambda m: None, on_step: Callable[[StepReport], None] = lambda r: None,
    dump_graphs: bool = False, allow_unused: bool = False,
) -> ConvertResult:
    """Convert `model` into the output directory `out`, atomically; see the module docstring.

    An interrupted run (Ctrl-C, SIGKILL, full disk) keeps its finished work in a staging
    directory next to `out`; the same call with `resume=True` continues it. `dump_graphs` writes
    each graph after each pass to OUT/graphs/NN_<pass>.<kind>.txt (qwen2om/graphdump.py).
    `allow_unused`: tensors the config does not account for are logged and left out, not refused.
    """
    source = resolve_model(model)
    r, dims = choose_recipe(source, recipe, list(overrides or []))
    preflight(source, r, dims, allow_unused=allow_unused, log=log)
    n_workers = choose_workers(workers, log)
    tools = tool_versions()
    key = {"model": str(model), "source": str(source), "recipe": r.to_dict(), "tools": tools}
    out = Path(out)
    with staged_output(out, force=force, resume=resume, log=log) as stage:
        try:
            journal = Journal.open(stage, key, resume=resume)
            ctx = RunContext(recipe=r, stage_dir=stage, source=source, model=str(model),
                             tool_version=tools["qwen2om"], progress=progress, log=log, workers=n_workers,
                             journal=journal)
            ws = Workspace()
            after = pass_dumper(stage / "graphs") if dump_graphs else None
            steps = run_pipeline(r.pipeline, ws, ctx, on_step, after)
            manifest = build_manifest(str(model), source, r, dims, ws, steps, tools)
            journal.remove()
            write_manifest(stage, manifest, n_workers)
        except KeyboardInterrupt:
            raise Interrupted(f"{out} was not written; finished work is kept in {stage}: rerun the same command "
                              "with --resume to continue") from None
        except OSError as e:
            where = e.filename or stage
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise DiskFullError(f"no space left while writing {where} ({e.strerror}); finished work is kept in "
                                    f"{stage}: free space, then rerun the same command with --resume") from None
            raise DiskFullError(f"cannot write {where} ({e.strerror or e}); finished work is kept in {stage}: "
                                "fix the problem, then rerun the same command with --resume") from None
    return ConvertResult(out, r, steps, manifest)


def source_entries(source: Path, ckpt: Any, ws: Workspace) -> list[dict[str, Any]]:
    """Every file read, with its hash; shards were hashed by check_weights, so not read twice."""
    hashed = ws.get("source_hashes", {})
    entries = []
    for p in sorted(ckpt.files):
        name = str(p.relative_to(source))
        sha = hashed.get(name) or file_entries(source, [p])[0]["sha256"]
        entries.append({"name": name, "bytes": p.stat().st_size, "sha256": sha})
    return entries


def chat_format(source: Path) -> str:
    """The file the checkpoint's chat template comes from (as transformers picks it), or "chatml"."""
    from qwen2om.runtime.standalone import ChatTemplate

    template = ChatTemplate.load(source)
    return template.file.name if template.file is not None else "chatml"


def build_manifest(model: str, source: Path, r: Recipe, dims: ModelDims, ws: Workspace,
                   steps: list[StepReport], tools: dict[str, str]) -> dict[str, Any]:
    ckpt = ws.need("checkpoint")
    # `gears`: the token counts a graph exported with a symbolic T takes (ATC --dynamic_dims); its
    # inputs/outputs are listed at the largest, `tokens`.
    gears = ws.get("graph_gears", {})
    graphs = {
        kind: {"file": graph_file(kind), "tokens": inputs[0].shape[1],
               **({"gears": list(gears[kind])} if gears.get(kind) else {}),
               "inputs": [s.to_dict() for s in inputs], "outputs": [s.to_dict() for s in outputs]}
        for kind, (inputs, outputs) in ws.need("signatures").items()
    }
    generation = read_generation(source, ckpt.config, dims.vocab)
    return {
        "format_version": FORMAT_VERSION,
        "tools": tools,
        # absolute, so `verify OUT` finds the checkpoint from any directory
        "source": {"model": model, "path": str(source.absolute()), "files": source_entries(source, ckpt, ws)},
        "architecture": ckpt.arch.name,
        "dims": dataclasses.asdict(dims),
        "recipe": r.to_dict(),
        "stages": [{"pass": s.name, "seconds": round(s.seconds, 3), "modified": s.modified, "stats": s.stats}
                   for s in steps],
        "graphs": graphs,
        "layout": LAYOUT,
        "runtime": {
            "capacity": int(r.max_seq_len), "batch": r.batch_size, "vocab": dims.vocab,
            "dtype": {"fp32": "float32", "fp16": "float16"}[r.dtype], "layers": dims.layers,
            "eos_token_ids": generation.eos_ids, "pad_token_id": generation.pad_id,
            **({"sampling": generation.sampling} if generation.sampling else {}),
            # where run.py takes its chat format from: a checkpoint's template file, or plain ChatML
            "chat_format": chat_format(source),
            # ONNX Runtime's int4 kernel is fast only on weights it prepacked at load; float MatMuls
            # are better read straight from the mapped data file (one copy for both sessions).
            "prepack_weights": any(s.name == "lower_int4" and s.stats.get("lowered") for s in steps),
        },
    }
