"""`convert`: a checkpoint into a static-shape output directory, as one library call."""

from __future__ import annotations

import dataclasses
import errno
import functools
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import qwen2om.passes  # noqa: F401  (registers the passes)
from qwen2om.arch import ModelDims
from qwen2om.builtin import resolve_model
from qwen2om.checkpoint import TOKENIZER_FILES, Checkpoint, ModelConfig, check_tokenizer_sources
from qwen2om.confine import confined
from qwen2om.errors import CheckpointError, DiskFullError, Interrupted, Qwen2omError, RecipeError
from qwen2om.families import family_of
from qwen2om.generation import read_generation
from qwen2om.graphdump import pass_dumper
from qwen2om.journal import Journal
from qwen2om.output import FORMAT_VERSION, file_entries, graph_file, staged_output, tool_versions, write_manifest
from qwen2om.passes.lower_int4_ascend import int4_form
from qwen2om.passes.package import CONFIG_FILES
from qwen2om.pipeline import RunContext, StepReport, no_progress, run_pipeline
from qwen2om.recipe import Recipe, checked_settings, load_recipe, parse_overrides, target_recipe, with_settings
from qwen2om.stages import Stage
from qwen2om.state import ConvertState

LAYOUT = {
    "kv_cache": "BNSD: [batch, kv_heads, capacity, head_dim]; outputs hold the T new tokens only",
    "linear_weights": "stored transposed, [in_features, out_features], names as in the checkpoint",
    "tied_embeddings": "one [hidden, vocab] table: Gather(axis=1) for the embedding, MatMul for lm_head",
    "rope": "cos/sin float32 tables [capacity, head_dim] gathered by position_ids",
    "attention_mask": "additive, compute dtype, 0 = visible, finfo(dtype).min = hidden; columns = P cache + T new",
}


@dataclasses.dataclass(frozen=True)
class ConvertOptions:
    """What a conversion is asked for, typed and built once (the CLI builds it from its flags and
    `--set`): the recipe, recipe settings on top of it, and how to run.

    `settings` maps recipe fields to typed values (`{"dtype": "fp16", "max_seq_len": 512}`), as
    `recipe.parse_overrides` makes them from `key=value` strings; unknown fields are refused here."""

    recipe: str | None = None  # a bundled recipe's name or a YAML file; None: the target's, <family>-<dtype>
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    force: bool = False  # replace an existing OUT (qwen2om's own outputs only)
    resume: bool = False  # continue an interrupted run from its staging directory
    workers: int | None = None  # threads; None: every core this process may use
    dump_graphs: bool = False  # each graph after each pass → OUT/graphs/NN_<pass>.<kind>.txt (graphdump.py)
    allow_unused: bool = False  # tensors config.json does not account for: logged and left out, not refused
    # Pipeline stages (qwen2om/stages.py): K, "auto" (the fewest that fit device_memory), or None: unstaged.
    stages: int | str | None = None
    device_memory: float | None = None  # GiB per device, for --stages auto (default: the SoC's)
    only_stage: int | None = None  # convert this stage only (each host its own)

    def __post_init__(self) -> None:
        object.__setattr__(self, "settings", checked_settings(self.settings))

    @classmethod
    def from_overrides(cls, overrides: Iterable[str] = (), **kwargs: Any) -> ConvertOptions:
        """Options with settings from `key=value` strings, each parsed once (recipe.parse_overrides)."""
        return cls(settings=parse_overrides(overrides), **kwargs)


@dataclasses.dataclass
class ConvertResult:
    out: Path
    recipe: Recipe
    steps: list[StepReport]
    manifest: dict[str, Any]


def read_config(source: Path) -> ModelConfig:
    """The checkpoint's config.json, read and its architecture resolved once per conversion: the
    recipe is chosen from it, preflight checks with it, the Checkpoint is opened with it."""
    if source.is_file():
        raise CheckpointError(f"{source} is a file: give its directory, a checkpoint (config.json + *.safetensors), "
                              "or builtin:NAME")
    return ModelConfig.read(source)


def choose_recipe(model: ModelConfig, recipe: str | None, settings: Mapping[str, Any]) -> Recipe:
    """The recipe for this checkpoint: named/file, or the target's bundled one (`<family>-<dtype>`, the
    family the checkpoint's); `settings` (recipe field → typed value) on top; autos resolved."""
    arch = model.arch
    family = arch.recipe or arch.name
    if recipe is None:
        # the target's recipe names its default dtype (ascend: fp16, what the NPU computes in)
        r = target_recipe(settings.get("target") or "ort", family, settings.get("dtype"))
    else:
        r = load_recipe(recipe)
    r = with_settings(r, settings)
    if not r.family:  # a recipe that names none (recipes/ort.yaml, a user's file): the checkpoint's
        r = dataclasses.replace(r, family=family)
    if r.gears and not family_of(arch).prefill_gears:  # checked here: export_onnx would fail minutes later
        raise RecipeError(f"gears={','.join(map(str, r.gears))}: prefill gears are not supported for {arch.name} "
                          "yet (its chunked linear attention splits a chunk into blocks by the chunk size, "
                          "static_hybrid.py, so one graph cannot serve every gear); convert without --gears")
    return r.resolved(model.dims.max_positions)


def preflight(model: ModelConfig, r: Recipe, *, allow_unused: bool = False,
              log: Callable[[str], None] = lambda m: None) -> Checkpoint | None:
    """Refusals that need only config.json and the checkpoint's tensor table, made before anything is
    staged: the passes that raise them run after every shard is read (static_model's RoPE tables) or
    after the ONNX export (lower_int4_ascend), minutes into a large conversion. (max_seq_len against
    the model's limit is choose_recipe's.)

    Returns the checkpoint it opened (lazily: headers and quantisation metadata), for load_checkpoint
    to take on; None where it opened none, or could not (load_checkpoint then says why, naming its pass)."""
    from qwen2om.recipe import check_capacity

    source, dims = model.root, model.dims
    check_capacity(r, dims)  # before static_model's RoPE tables and export_onnx's traced caches exist
    read_generation(source, model.config, dims.vocab)  # the manifest's stop and pad ids, written at the very end
    passes = {name for name, _ in r.pipeline}
    if "package" in passes:  # files it copies into OUT: inside the checkpoint, regular (qwen2om.confine)
        for name in (*TOKENIZER_FILES, *CONFIG_FILES):
            if (source / name).exists() or (source / name).is_symlink():
                confined(source, name)
        check_tokenizer_sources(source)
        chat_format(source)  # a template file that cannot be read is named now, not after the export
    if "static_model" in passes:  # a one-row table: the same refusals, none of the work
        family_of(model.arch).rope_tables(model.config, dims, 1)
    if "load_checkpoint" not in passes and "lower_int4_ascend" not in passes:
        return None
    try:
        ckpt = Checkpoint(source, model)  # lazy: headers and quantisation metadata, no weights
    except Qwen2omError:
        return None  # load_checkpoint opens it and says what is wrong with it, naming its pass
    try:
        if "load_checkpoint" in passes:
            ckpt.validate_layout()  # first: a missing or misshapen tensor says more than an unused one
    except Qwen2omError:
        return ckpt  # load_checkpoint checks it again and says what is wrong, naming its pass
    try:
        if "load_checkpoint" in passes:  # tensors the config leaves out: refused, or with allow_unused said
            ckpt.check_unused(log if allow_unused else None)
        if "lower_int4_ascend" in passes:
            int4_form(ckpt.quantized, r.soc_version, r.weight_storage, fp16=r.dtype == "fp16")
    except BaseException:
        ckpt.close()
        raise
    return ckpt


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
    model: str | Path, out: Path, options: ConvertOptions | None = None, *, recipe: str | None = None,
    overrides: list[str] | None = None, force: bool = False, resume: bool = False, workers: int | None = None,
    progress: Callable[..., None] = no_progress,
    log: Callable[[str], None] = lambda m: None, on_step: Callable[[StepReport], None] = lambda r: None,
    dump_graphs: bool = False, allow_unused: bool = False,
) -> ConvertResult:
    """Convert `model` into the output directory `out`, as `options` asks, atomically; see the module
    docstring. `recipe`, `overrides` (`key=value` strings) and the run flags are the same options
    spelled out, for callers that build none; give one or the other.

    An interrupted run (Ctrl-C, SIGKILL, full disk) keeps its finished work in a staging
    directory next to `out`; the same call with `resume` continues it.
    """
    if options is None:
        options = ConvertOptions.from_overrides(overrides or [], recipe=recipe, force=force, resume=resume,
                                                workers=workers, dump_graphs=dump_graphs, allow_unused=allow_unused)
    elif (recipe, overrides, force, resume, workers, dump_graphs, allow_unused) != (None, None, False, False, None,
                                                                                      False, False):
        raise TypeError("convert(): give `options`, or recipe/overrides and the run flags, not both")
    source = resolve_model(model)
    config = read_config(source)  # read once: the recipe, preflight and the Checkpoint all use it
    r = choose_recipe(config, options.recipe, options.settings)
    split = None
    if options.stages is not None or options.only_stage is not None or options.device_memory is not None:
        from qwen2om.staged import plan_split

        split = plan_split(config, r, options)  # refused before anything is opened or staged
    opened = preflight(config, r, allow_unused=options.allow_unused, log=log)
    try:
        n_workers = choose_workers(options.workers, log)
        tools = tool_versions()
        key = {"model": str(model), "source": str(source), "recipe": r.to_dict(), "tools": tools}
        out = Path(out)
        with staged_output(out, force=options.force, resume=options.resume, log=log) as stage:
            try:
                run = functools.partial(convert_into, model=str(model), source=source, config=config, recipe=r,
                                        options=options, opened=opened, tools=tools, workers=n_workers,
                                        progress=progress, log=log, on_step=on_step)
                if split is not None:
                    from qwen2om.staged import convert_stages

                    steps, manifest = convert_stages(stage, split, key, run)
                else:
                    steps, manifest = run(stage, key)
            except KeyboardInterrupt:
                raise Interrupted(f"{out} was not written; finished work is kept in {stage}: rerun the same "
                                  "command with --resume to continue") from None
            except OSError as e:
                where = e.filename or stage
                if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise DiskFullError(f"no space left while writing {where} ({e.strerror}); finished work is "
                                        f"kept in {stage}: free space, then rerun the same command with --resume"
                                        ) from None
                raise DiskFullError(f"cannot write {where} ({e.strerror or e}); finished work is kept in {stage}: "
                                    "fix the problem, then rerun the same command with --resume") from None
    finally:
        if opened is not None:  # the state's checkpoint, once load_checkpoint has taken it on
            opened.close()
    return ConvertResult(out, r, steps, manifest)


def convert_into(stage: Path, key: dict[str, Any], *, model: str, source: Path, config: ModelConfig, recipe: Recipe,
                 options: ConvertOptions, opened: Checkpoint | None, tools: dict[str, str], workers: int,
                 progress: Callable[..., None], log: Callable[[str], None], on_step: Callable[[StepReport], None],
                 split: Stage | None = None, extra: Mapping[str, Any] | None = None,
                 ) -> tuple[list[StepReport], dict[str, Any]]:
    """Run the pipeline into the directory `stage` (a conversion's staging directory, or one pipeline
    stage's folder inside it) and write its manifest (with `extra` keys); returns the steps and manifest."""
    journal = Journal.open(stage, key, resume=options.resume)
    ctx = RunContext(recipe=recipe, stage_dir=stage, source=source, model=model, tool_version=tools["qwen2om"],
                     progress=progress, log=log, workers=workers, journal=journal, opened_checkpoint=opened,
                     stage=split)
    state = ConvertState()
    after = pass_dumper(stage / "graphs") if options.dump_graphs else None
    steps = run_pipeline(recipe.pipeline, state, ctx, on_step, after)
    manifest = build_manifest(model, source, recipe, config.dims, state, steps, tools)
    manifest.update(extra or {})
    journal.remove()
    write_manifest(stage, manifest, workers)
    return steps, manifest


def source_entries(source: Path, ckpt: Any, state: ConvertState) -> list[dict[str, Any]]:
    """Every file read, with its hash; shards were hashed by check_weights, so not read twice."""
    hashed = state.source_hashes or {}
    entries = []
    staged = len(hashed) < len(ckpt.shards)  # a pipeline stage: only the shards it read
    for p in sorted(ckpt.files):
        name = str(p.relative_to(source))
        if staged and p in ckpt.shards and name not in hashed:
            continue
        sha = hashed.get(name) or file_entries(source, [p])[0]["sha256"]
        entries.append({"name": name, "bytes": p.stat().st_size, "sha256": sha})
    return entries


def chat_format(source: Path) -> str:
    """The file the checkpoint's chat template comes from (as transformers picks it), or "chatml"."""
    from qwen2om.runtime.standalone import ChatTemplate

    template = ChatTemplate.load(source)
    return template.file.name if template.file is not None else "chatml"


def build_manifest(model: str, source: Path, r: Recipe, dims: ModelDims, state: ConvertState,
                   steps: list[StepReport], tools: dict[str, str]) -> dict[str, Any]:
    ckpt = state.checkpoint
    # `gears`: the token counts a graph exported with a symbolic T takes (ATC --dynamic_dims); its
    # inputs/outputs are listed at the largest, `tokens`.
    gears = state.graph_gears or {}
    graphs = {
        kind: {"file": graph_file(kind), "tokens": inputs[0].shape[1],
               **({"gears": list(gears[kind])} if gears.get(kind) else {}),
               "inputs": [s.to_dict() for s in inputs], "outputs": [s.to_dict() for s in outputs]}
        for kind, (inputs, outputs) in state.signatures.items()
    }
    generation = read_generation(source, ckpt.config, dims.vocab)
    return {
        "format_version": FORMAT_VERSION,
        "tools": tools,
        # absolute, so `verify OUT` finds the checkpoint from any directory
        "source": {"model": model, "path": str(source.absolute()), "files": source_entries(source, ckpt, state)},
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
