"""Strict YAML recipes: the pipeline and its parameters, with `--set key=value` overrides.

A recipe is a flat set of parameters plus an ordered `pipeline:` of pass names (each optionally
with arguments). Unknown keys are rejected with the valid ones listed; command-line flags are
sugar over the same fields, and the resolved recipe goes into the manifest.

The bundled recipes are one per target (recipes/ort.yaml, recipes/ascend.yaml; qwen2om/targets.py
says which) and name no family: the checkpoint says which. The per-family names manifests record
and `--recipe` takes (`qwen3-fp32`, `qwen2-ascend-fp16`) are that file with the family and the
compute dtype filled in (`target_recipe`). A user's recipe file may state `family:` (it is then
checked against the checkpoint) or leave it to the checkpoint.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from qwen2om.ascend import KNOWN, soc_info
from qwen2om.errors import PlanError, Qwen2omError, RecipeError
from qwen2om.targets import MAX_GEARS, TARGETS, Target

if TYPE_CHECKING:
    from qwen2om.arch import ModelDims

AUTO = "auto"
DTYPES = ("fp32", "fp16")
LOGITS = ("last", "all")
SCALES = ("auto", "constants", "inputs")
# A static graph computes all of its B rows on every call, used or not, and its KV cache is B times one
# row's: past 256 rows (vLLM's default max_num_seqs, the most sequences a serving engine batches by
# default) a static batch is a typo, which would otherwise surface only after the whole export.
MAX_BATCH = 256
# ONNX Runtime's GroupQueryAttention takes the positions a call sees (cache + new tokens) as int32.
INT32_MAX = 2**31 - 1
# What every output directory holds, whatever the recipe: the workspace slots that fill it. A pipeline
# that never fills one would run to its end, then fail building the manifest or write an OUT that
# `qwen2om run` cannot load.
OUTPUT_SLOTS = {"signatures": "the graphs' inputs and outputs, which manifest.json records",
                "onnx_files": "the ONNX graphs and their weights",
                "package_files": "the tokenizer, config files and run.py that `qwen2om run` loads"}
# Recipe files are a few hundred bytes of YAML nested four levels deep (pipeline → step → arguments →
# value), with a few dozen values. The bounds refuse what safe_load would let through: an alias bomb
# (nine lines that expand to 10⁹ values when Recipe.to_dict copies them), nesting that exhausts the
# composer's recursion, and files that are not recipes at all.
MAX_RECIPE_BYTES = 1 << 20
MAX_YAML_NODES = 10_000
MAX_YAML_DEPTH = 32


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Everything that decides what `convert` produces."""

    family: str  # "": not stated (the bundled recipes); convert.choose_recipe fills in the checkpoint's
    pipeline: tuple[tuple[str, dict[str, Any]], ...]
    dtype: str = "fp32"
    target: str = "ort"
    max_seq_len: int | str = AUTO  # cache capacity P; auto = 2048 or the model's limit if smaller
    prefill_chunk: int | str = AUTO  # T of the prefill graph; auto = 128 or max_seq_len if smaller
    batch_size: int = 1
    logits: str = "last"  # prefill graph returns logits for the last token only, or all T
    scale_range: str | tuple[float, float] = AUTO  # accepted quantisation scales [lo, hi]; auto: the target's
    scales: str = "auto"  # quantisation scales as graph inputs (scale_map.json) or constants; auto: inputs for FP8
    opset: int = 18
    ir_version: int = 8
    # target ascend only (targets.py, Target.fields):
    soc_version: str = ""  # ATC --soc_version, e.g. Ascend910B3
    precision: str = "origin"  # ATC --precision_mode_v2: origin keeps the graph's dtypes
    weight_storage: str = "auto"  # int8: int4 weights stored as int8, dequantised by Cast + Mul (310B: W8A16)
    compile: str = "auto"  # auto: run atc when CANN is installed; dry-run: write the commands only
    # Prefill chunk sizes compiled into one .om with ATC --dynamic_dims; the largest is the prefill chunk.
    # Empty: one static prefill graph of prefill_chunk tokens.
    gears: tuple[int, ...] = ()
    name: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["pipeline"] = [{n: a} if a else n for n, a in self.pipeline]
        d["gears"] = list(self.gears)
        return d

    def resolved(self, max_positions: int) -> Recipe:
        """Fill the `auto` fields from the model's limits and check every value."""
        p = min(2048, max_positions) if self.max_seq_len == AUTO else int(self.max_seq_len)
        if p > max_positions:
            raise RecipeError(f"max_seq_len={p} exceeds the model's max_position_embeddings={max_positions}")
        if self.gears and self.prefill_chunk == AUTO:  # the prefill graph's T is the largest gear
            c = max(self.gears)
        else:
            c = min(128, p) if self.prefill_chunk == AUTO else int(self.prefill_chunk)
        r = dataclasses.replace(self, max_seq_len=p, prefill_chunk=c)
        r.check()
        if TARGETS.get(r.target).socs and not r.soc_version:
            raise RecipeError(f"target={r.target} needs --soc-version (the chip `npu-smi info` names; known: {KNOWN})")
        return r

    def check(self) -> None:
        def one_of(field: str, allowed: tuple[str, ...]) -> None:
            if getattr(self, field) not in allowed:
                raise RecipeError(f"{field}={getattr(self, field)!r} is not one of {', '.join(allowed)}")

        one_of("dtype", DTYPES)
        one_of("target", tuple(TARGETS.names()))
        one_of("logits", LOGITS)
        one_of("scales", SCALES)
        target = TARGETS.get(self.target)
        # Another target's settings (ATC's, on ort) shape nothing here: refused, not recorded in a manifest.
        for other in TARGETS:
            for field in other.fields:
                value = getattr(self, field)
                if field not in target.fields and value != FIELDS[field].default:
                    raise RecipeError(f"{field}={value!r} is for target={other.name}; this recipe's target is "
                                      f"{self.target} (add --target {other.name}, or leave {field} out)")
        for field, allowed in target.choices.items():
            one_of(field, allowed)
        if target.socs and self.soc_version:  # required, but only once overrides are in (resolved)
            try:
                soc_info(self.soc_version)
            except Qwen2omError as e:
                raise RecipeError(str(e)) from None
        for field in ("max_seq_len", "prefill_chunk", "batch_size"):
            v = getattr(self, field)
            if v != AUTO and (not isinstance(v, int) or v < 1):
                raise RecipeError(f"{field}={v!r} must be a positive integer or 'auto'")
        if isinstance(self.batch_size, int) and self.batch_size > MAX_BATCH:
            raise RecipeError(f"batch_size={self.batch_size} is more than {MAX_BATCH}: a static graph computes every "
                              "row on every call, and the KV cache grows with each (recipe.py, MAX_BATCH)")
        self.check_gears()  # before the chunk/capacity check: with gears, the chunk is the largest gear
        if isinstance(self.max_seq_len, int) and isinstance(self.prefill_chunk, int):
            if self.prefill_chunk > self.max_seq_len:
                raise RecipeError(f"prefill_chunk={self.prefill_chunk} exceeds max_seq_len={self.max_seq_len}")
        if self.scale_range != AUTO:
            lo, hi = self.scale_range  # type: ignore[misc]
            if not 0 < lo < hi:
                raise RecipeError(f"scale_range={list(self.scale_range)} must be [lo, hi] with 0 < lo < hi")
        if self.opset > 18:
            raise RecipeError(f"opset={self.opset}: the targets take ai.onnx opset 18 at most")
        import qwen2om.passes  # noqa: F401  (registers the passes)
        from qwen2om.pipeline import PASSES, check_plan

        for name, _ in self.pipeline:
            PASSES.get(name)
        names = [n for n, _ in self.pipeline]
        check_plan(names)
        for name, args in self.pipeline:
            check_pass_args(name, args)
        if missing := [slot for slot in OUTPUT_SLOTS if not any(slot in PASSES.get(n).produces for n in names)]:
            slot = missing[0]
            makers = " or ".join(repr(e.name) for e in PASSES if slot in e.produces)
            raise PlanError(f"the pipeline has no {makers} pass: every output needs {OUTPUT_SLOTS[slot]} "
                            f"({slot!r}); add {makers} to the pipeline")
        if self.scales == "inputs" and "scale_inputs" not in names:  # asked for, and silently not done
            raise PlanError("scales=inputs needs the 'scale_inputs' pass, which the pipeline does not list; add it "
                            "after the lowering passes, or use scales=constants")


    def check_gears(self) -> None:
        """Gears are the prefill chunk sizes one symbolic-T prefill graph serves (on Ascend, ATC
        --dynamic_dims; on ONNX Runtime, the runtime runs each chunk at the smallest that holds it):
        2..100 distinct positive token counts, none above the prefill chunk (which the largest one is)
        or the cache capacity."""
        g = self.gears
        if not g:
            return
        shown = ",".join(map(str, g))
        if bad := [x for x in g if x < 1]:
            raise RecipeError(f"gears={shown}: gear {bad[0]} is not a positive token count")
        if dup := sorted({x for x in g if g.count(x) > 1}):
            raise RecipeError(f"gears={shown}: gear {dup[0]} is listed more than once")
        if len(g) < 2:
            raise RecipeError(f"gears={shown}: one gear is a static prefill graph; use --prefill-chunk {g[0]} "
                              "instead, or give at least two gears")
        if len(g) > MAX_GEARS:
            raise RecipeError(f"gears: {len(g)} gears, at most {MAX_GEARS} (ATC --dynamic_dims' limit)")
        if isinstance(self.prefill_chunk, int):
            if over := [x for x in g if x > self.prefill_chunk]:
                raise RecipeError(f"gears={shown}: gear {over[0]} is outside 1..{self.prefill_chunk} (prefill_chunk, "
                                  "the most tokens one prefill call takes)")
            if max(g) != self.prefill_chunk:
                raise RecipeError(f"gears={shown}: the largest gear is the prefill chunk, but prefill_chunk="
                                  f"{self.prefill_chunk}; add gear {self.prefill_chunk} or leave --prefill-chunk out")
        if isinstance(self.max_seq_len, int) and (over := [x for x in g if x > self.max_seq_len]):
            raise RecipeError(f"gears={shown}: gear {over[0]} is outside 1..{self.max_seq_len} (max_seq_len, the "
                              "cache capacity)")


def check_pass_args(name: str, args: dict[str, Any]) -> None:
    """A pass's recipe arguments, checked before any work: typed against its constructor (YAML reads
    `experts: "no"` as a string, which bool() would take for true; counts and limits are never negative),
    then by building the pass, whose own checks (lower_int4's accuracy_level 0-4) run in its constructor."""
    from qwen2om.pipeline import PASSES, build_pass

    factory = PASSES.get(name).factory
    try:
        hints = typing.get_type_hints(factory.__init__)  # type: ignore[misc]
    except (NameError, TypeError):  # an annotation this module cannot resolve: the constructor still checks
        hints = {}
    for arg, value in args.items():
        want = hints.get(arg) if isinstance(arg, str) else None
        if want is bool and not isinstance(value, bool):
            raise RecipeError(f"pass {name!r}: {arg}={value!r} must be true or false")
        if want is int and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise RecipeError(f"pass {name!r}: {arg}={value!r} must be a non-negative integer")
        if want is str and not isinstance(value, str):
            raise RecipeError(f"pass {name!r}: {arg}={value!r} must be a string")
    try:
        build_pass(name, args)
    except ValueError as e:
        raise RecipeError(f"pass {name!r}: {e}") from None


def physical_memory() -> int | None:
    """This machine's memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def check_capacity(r: Recipe, dims: ModelDims) -> None:
    """Refuse a resolved recipe whose buffers cannot exist, before anything allocates them: positions past
    int32, or a KV cache plus RoPE tables larger than this machine's memory. They are what the output
    needs to run, and a floor on what converting it takes: static_model computes the tables here (in
    float64) and export_onnx traces with caches of the full capacity."""
    p, t, b = int(r.max_seq_len), int(r.prefill_chunk), r.batch_size
    if p + t > INT32_MAX:
        raise RecipeError(f"max_seq_len={p:,}: a call sees the cache and {t} new tokens, {p + t:,} positions, more "
                          f"than {INT32_MAX:,} (ONNX Runtime's attention kernel counts them in int32)")
    itemsize = {"fp32": 4, "fp16": 2}[r.dtype]
    full = sum(1 for i in range(dims.layers) if not dims.is_linear(i))
    kv = b * full * 2 * dims.kv_heads * p * dims.head_dim * itemsize
    rope = 2 * p * (dims.rotary_dim or dims.head_dim) * 4  # cos and sin, float32 graph constants
    have = physical_memory()
    if have is not None and kv + rope > have:
        raise RecipeError(
            f"max_seq_len={p:,}: the KV cache ({full} layers × K and V × batch {b} × {dims.kv_heads} heads × {p:,} "
            f"positions × {dims.head_dim} × {itemsize} bytes) and RoPE tables need {_gib(kv + rope)} "
            f"({kv + rope:,} bytes), more than this machine's {_gib(have)} of memory: lower --max-seq-len"
            + (" or --batch-size" if b > 1 else ""))


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def _gears(key: str, value: Any, where: str) -> tuple[int, ...]:
    """Gears from YAML (a list of integers) or --set / --gears (`16,32,64`); empty or `none`: no gears."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return ()
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        raise RecipeError(f"{where}: {key}={value!r} must be a list of token counts (e.g. 16,32,64,128)")
    out = []
    for x in items:
        text = x.strip() if isinstance(x, str) else x
        if isinstance(text, bool) or not (isinstance(text, int) or (isinstance(text, str) and
                                                                    text.lstrip("-").isdigit())):
            raise RecipeError(f"{where}: {key}={value!r}: {x!r} is not an integer token count (e.g. 16,32,64,128)")
        out.append(int(text))
    return tuple(out)


FIELDS = {f.name: f for f in dataclasses.fields(Recipe)}


def _pipeline(value: Any, where: str) -> tuple[tuple[str, dict[str, Any]], ...]:
    if not isinstance(value, list) or not value:
        raise RecipeError(f"{where}: 'pipeline' must be a non-empty list of pass names")
    steps = []
    for item in value:
        if isinstance(item, str):
            steps.append((item, {}))
        elif isinstance(item, dict) and len(item) == 1:
            (name, args), = item.items()
            if args is not None and not isinstance(args, dict):
                raise RecipeError(f"{where}: arguments of pass {name!r} must be a mapping")
            steps.append((str(name), dict(args or {})))
        else:
            raise RecipeError(f"{where}: pipeline entry {item!r} must be a pass name or {{name: {{args}}}}")
    return tuple(steps)


def _float_pair(key: str, value: Any, where: str) -> tuple[float, float]:
    """[lo, hi] from YAML (a list) or --set (`lo,hi`)."""
    items = value.split(",") if isinstance(value, str) else value
    try:
        if not isinstance(items, list | tuple) or len(items) != 2 or any(isinstance(x, bool) for x in items):
            raise ValueError
        return float(items[0]), float(items[1])
    except (TypeError, ValueError):
        raise RecipeError(f"{where}: {key}={value!r} must be two numbers [lo, hi] (or lo,hi with --set)") from None


def _coerce(key: str, value: Any, where: str) -> Any:
    if key == "pipeline":
        return _pipeline(value, where)
    if key == "scale_range":
        return AUTO if value == AUTO else _float_pair(key, value, where)
    if key == "gears":
        return _gears(key, value, where)
    default = FIELDS[key].default
    if value == AUTO and key in ("max_seq_len", "prefill_chunk"):
        return AUTO
    want = int if isinstance(default, int) or key in ("max_seq_len", "prefill_chunk") else type(default)
    return typed(key, value, want, where)


def typed(key: str, value: Any, want: type, where: str) -> Any:
    """`value` as a `want` (int, float, bool, str, or tuple of str), by the rules YAML values and --set
    strings follow: `"64"` → 64, `"true"` → True; a float or a boolean is never an integer. Anything
    else is a RecipeError naming `where`. Recipes and calibration settings share these rules."""
    if want is int:
        # YAML gives ints; --set gives digit strings. Floats and booleans are mistakes, not integers.
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, str) and
                                                                       value.strip().lstrip("-").isdigit())):
            raise RecipeError(f"{where}: {key}={value!r} must be an integer")
        return int(value)
    if want is bool:
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        if not isinstance(value, bool):
            raise RecipeError(f"{where}: {key}={value!r} must be true or false")
        return value
    if want is float:
        try:
            if isinstance(value, bool) or not isinstance(value, int | float | str):
                raise ValueError
            return float(value)
        except ValueError:
            raise RecipeError(f"{where}: {key}={value!r} must be a number") from None
    if want is tuple:
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise RecipeError(f"{where}: {key}={value!r} must be a list of strings")
        return tuple(value)
    if not isinstance(value, str):
        raise RecipeError(f"{where}: {key}={value!r} must be a string")
    return value


def from_mapping(data: Any, where: str) -> Recipe:
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: a recipe must be a YAML mapping")
    if unknown := sorted(set(data) - set(FIELDS)):
        raise RecipeError(f"{where}: unknown key(s) {', '.join(unknown)} (valid: {', '.join(FIELDS)})")
    if "pipeline" not in data:
        raise RecipeError(f"{where}: missing required key 'pipeline'")
    values = {"family": "", **{k: _coerce(k, v, where) for k, v in data.items()}}
    recipe = Recipe(**values)
    try:
        recipe.check()
    except Qwen2omError as e:  # the file's values: say which file
        raise type(e)(f"{where}: {e}") from None
    return recipe


class _RecipeLoader(yaml.SafeLoader):
    """yaml.SafeLoader refusing what safe_load lets through: nesting past MAX_YAML_DEPTH (the composer
    recurses once per level, so 50,000 levels are a RecursionError) and duplicate mapping keys (YAML
    forbids them; PyYAML silently keeps the last)."""

    def __init__(self, stream: str, where: str) -> None:
        super().__init__(stream)
        self.where, self.depth = where, 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        self.depth += 1
        try:
            if self.depth > MAX_YAML_DEPTH:
                line = self.peek_event().start_mark.line + 1
                raise RecipeError(f"{self.where}: line {line}: nested more than {MAX_YAML_DEPTH} levels deep "
                                  "(a recipe needs four)")
            return super().compose_node(parent, index)  # type: ignore[no-any-return]
        finally:
            self.depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults` may be overridden: that is its use
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                continue  # PyYAML's own error names the unhashable key
            line = key_node.start_mark.line + 1
            if key in first:
                raise RecipeError(f"{self.where}: line {line}: duplicate key {key!r} (first on line {first[key]})")
            first[key] = line
        return super().construct_mapping(node, deep=deep)  # type: ignore[no-any-return]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _check_expansion(root: yaml.Node, where: str) -> None:
    """Refuse a composed document whose aliases expand past MAX_YAML_NODES values or MAX_YAML_DEPTH levels,
    or refer to the collection that holds them, before anything constructs or copies it. Each distinct
    node is visited once (iteratively: the expansion may be deep), so a bomb costs its own size."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key, kids = id(node), _children(node)
        line = node.start_mark.line + 1
        if done:
            open_nodes.discard(key)
            size[key] = 1 + sum(size[id(k)] for k in kids)
            depth[key] = 1 + max((depth[id(k)] for k in kids), default=0)
            if size[key] > MAX_YAML_NODES or depth[key] > MAX_YAML_DEPTH:
                raise RecipeError(f"{where}: line {line}: with its aliases followed, this holds more than "
                                  f"{MAX_YAML_NODES:,} values or nests more than {MAX_YAML_DEPTH} levels (a recipe "
                                  "has a few dozen values, four levels deep)")
            continue
        if key in size:
            continue
        if key in open_nodes:
            raise RecipeError(f"{where}: line {line}: an alias refers to the collection that contains it")
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((k, False) for k in kids)


def parse_yaml(text: str, where: str) -> Any:
    """One YAML document, bounded (see _RecipeLoader, _check_expansion); every failure a RecipeError naming `where`."""
    loader = _RecipeLoader(text, where)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node, where)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        raise RecipeError(f"{where}: invalid YAML ({' '.join(str(e).split())})") from None
    except RecursionError:  # the bounds above should make this unreachable; a traceback would be worse
        raise RecipeError(f"{where}: nested too deeply to read") from None
    finally:
        loader.dispose()


def read_recipe_text(path: Path) -> str:
    """A recipe file's text: a regular file of at most MAX_RECIPE_BYTES, UTF-8."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_RECIPE_BYTES + 1)
    except OSError as e:
        raise RecipeError(f"{path}: cannot read the recipe ({e.strerror or e})") from None
    if len(data) > MAX_RECIPE_BYTES:
        raise RecipeError(f"{path}: more than {MAX_RECIPE_BYTES:,} bytes; a recipe is a few hundred")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecipeError(f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def target_of(name: str) -> Target:
    """The target `name` (`--target`), or a RecipeError listing the known ones."""
    if name not in TARGETS:
        raise RecipeError(f"target={name!r} is not one of {', '.join(TARGETS.names())}")
    return TARGETS.get(name)


def families() -> list[str]:
    """The families bundled recipes are named for: each architecture's `recipe`, or else its name."""
    from qwen2om.arch import ARCHS

    return list(dict.fromkeys(a.recipe or a.name for a in ARCHS))


def family_recipes() -> dict[str, tuple[str, str, str]]:
    """Every per-family bundled name (`qwen3-ascend-fp16`) → (target, family, dtype)."""
    return {t.named(f, d): (t.name, f, d) for f in families() for t in TARGETS for d in DTYPES}


def bundled_recipes() -> list[str]:
    """What `--recipe` takes besides a file: the target recipes, then the per-family names."""
    root = importlib.resources.files("qwen2om.recipes")
    files = sorted(p.name.removesuffix(".yaml") for p in root.iterdir() if p.name.endswith(".yaml"))
    return [*files, *family_recipes()]


def _bundled(stem: str) -> tuple[str, str]:
    """(text, where) of recipes/<stem>.yaml."""
    res = importlib.resources.files("qwen2om.recipes") / f"{stem}.yaml"
    if not res.is_file():
        raise RecipeError(f"unknown recipe {stem!r} (bundled: {', '.join(bundled_recipes())})")
    return res.read_text(encoding="utf-8"), f"recipes/{stem}.yaml"


def target_recipe(target: str, family: str = "", dtype: str | None = None) -> Recipe:
    """The bundled recipe of `target` for `family` (empty: left to the checkpoint) in compute dtype `dtype`
    (None: the file's, the target's default), named as manifests name it: `qwen3-ascend-fp16`, or the
    file's name without a family."""
    t = target_of(target)
    if dtype is not None and dtype not in DTYPES:
        raise RecipeError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    text, where = _bundled(t.recipe)
    data, fill = parse_yaml(text, where), {k: v for k, v in (("family", family), ("dtype", dtype)) if v}
    r = from_mapping({**data, **fill} if isinstance(data, dict) else data, where)
    return dataclasses.replace(r, name=t.named(family, r.dtype) if family else t.recipe)


def load_recipe(name_or_path: str) -> Recipe:
    """A bundled recipe by name (`ort`, `ascend`, or per family: `qwen3-fp32`) or a YAML file by path."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.exists():
            raise RecipeError(f"{path}: recipe file not found")
        if not path.is_file():  # a directory, or a FIFO whose read would block
            raise RecipeError(f"{path}: not a regular file")
        text, where = read_recipe_text(path), str(path)
    elif named := family_recipes().get(name_or_path):
        return target_recipe(*named)
    else:
        text, where = _bundled(name_or_path)
    recipe = from_mapping(parse_yaml(text, where), where)
    return dataclasses.replace(recipe, name=recipe.name or Path(where).stem)


SETTINGS = tuple(k for k in FIELDS if k != "pipeline")  # what --set and typed settings may change


def setting(key: str, value: Any, where: str) -> Any:
    """One recipe field's value, typed as the field is (`16,32` → (16, 32), `"64"` → 64), by the rules
    YAML values follow; a RecipeError naming `where` if it cannot be. `key` is a valid setting."""
    return _coerce(key, value, where)


def parse_overrides(overrides: Iterable[str]) -> dict[str, Any]:
    """`--set key=value` strings → recipe field → typed value, each string parsed once, strictly;
    the last of a key wins. Values are typed, not yet checked together (`with_settings` does that)."""
    changes: dict[str, Any] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep:
            raise RecipeError(f"--set {item!r}: expected key=value")
        if key not in SETTINGS:
            raise RecipeError(f"--set {item!r}: unknown key {key!r} (valid: {', '.join(SETTINGS)})")
        changes[key] = setting(key, value.strip(), f"--set {item}")
    return changes


def checked_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Typed settings given in code (`{"dtype": "fp16", "max_seq_len": 512}`): known keys, each value
    typed by `setting`; what `parse_overrides` returns passes through unchanged."""
    if unknown := [k for k in settings if k not in SETTINGS]:
        raise RecipeError(f"unknown recipe setting {unknown[0]!r} (valid: {', '.join(SETTINGS)})")
    return {k: setting(k, v, f"setting {k}={v!r}") for k, v in settings.items()}


def with_settings(recipe: Recipe, settings: Mapping[str, Any]) -> Recipe:
    """Typed settings applied on top of a recipe, the result checked."""
    recipe = dataclasses.replace(recipe, **settings)
    recipe.check()
    return recipe


def apply_overrides(recipe: Recipe, overrides: list[str]) -> Recipe:
    """`key=value` strings applied on top of a recipe, strictly."""
    return with_settings(recipe, parse_overrides(overrides))
