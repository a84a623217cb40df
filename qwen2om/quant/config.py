"""Calibration settings: defaults, a recipe file's settings, then the command line's, checked as one
configuration by the scheme it names (qwen2om/quant/schemes.py). A recipe file is read as convert's
recipes are (qwen2om.recipe: bounded YAML, typed values, unknown keys refused listing the valid ones).
`calibrate()` checks the configuration it is given the same way, so the library refuses what the CLI
refuses.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

from qwen2om.quant.device import check_spelling
from qwen2om.quant.fisher import HESSIANS, PLAIN
from qwen2om.quant.int4 import Int4Spec
from qwen2om.quant.schemes import METHODS, SCHEMES, CalibrationError, Method, Scheme
from qwen2om.recipe import parse_yaml, read_recipe_text, typed

COMPUTE_DTYPES = ("float32", "bfloat16", "float16", "auto")
DTYPE_SPELLINGS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # convert's `--dtype fp16`


@dataclasses.dataclass
class CalibrationConfig:
    """One calibration's settings. None means "not given": the scheme's default is filled in when the
    configuration is checked (on construction), and a scheme refuses a setting it ignores when given."""

    scheme: str = "w4a16"  # or "fp8-block" (data-free; qwen2om/quant/fp8_block.py)
    method: str | None = None  # w4a16: gptq; fp8-block: rtn
    group_size: int | None = None  # w4a16: 128
    symmetric: bool | None = None  # w4a16: True
    dataset: str | None = None  # w4a16: builtin:chat+prose+code
    num_samples: int = 500
    seq_len: int | None = None  # default: 2048 or the model's limit
    batch_size: int = 1  # samples per forward: faster per layer, more activation memory at once
    quantize_lm_head: bool = False
    ignore: tuple[str, ...] = ()
    damp: float = 0.01
    actorder: bool = True
    # GPTQ: each output row keeps the clipping ratio (gptq.CLIP_RATIOS) whose result has the least output
    # error on the calibration data. Off by default: every group's min-max range, as llm-compressor's GPTQ.
    # On the trained builtins it lowers the layers' output errors by a quarter but not the end-to-end KL or
    # perplexity beyond their noise, and GPTQ's own time grows ~3x (docs/benchmarks.md, issue 28).
    clip_search: bool = False
    # GPTQ: "plain" (every token's xxᵀ alike, as llm-compressor), or weighted by the calibration loss's
    # squared gradient at each linear's output: "fisher", "fisher-heads" (q/k/v per attention head). One
    # more forward and backward of the model first (qwen2om/quant/fisher.py); fisher-heads: KL −7…−12 % on
    # the trained builtins, calibration ~3× as long (docs/benchmarks.md, issue 28).
    hessian: str = "plain"
    activation_budget: int = 2 << 30  # bytes of activations kept in memory before spilling to disk
    # The layers' forward passes: float32, or bfloat16 / float16 (matmuls ~1.8x faster on CPUs with bf16
    # instructions, a whole calibration ~20 % at Qwen3-0.6B's shapes; "auto": the checkpoint's own
    # dtype). Activations between layers, Hessians and the quantisation stay float32.
    compute_dtype: str = "float32"
    fmt: str | None = None  # a FORMATS name; the scheme's first (w4a16: compressed-tensors; or ascendv1)
    device: str = "cpu"  # the forward passes and the GPTQ/AWQ arithmetic: cpu, cuda[:i], npu[:i]
    # torch threads of the driver and of every worker (default: this process's). A product's float sums
    # depend on how it is split over threads, so one checkpoint byte for byte needs one thread count.
    threads: int | None = None

    def __post_init__(self) -> None:
        self.check()

    @property
    def scheme_entry(self) -> Scheme:
        return SCHEMES.get(self.scheme)

    @property
    def method_entry(self) -> Method:
        return METHODS.get(self.method or self.scheme_entry.defaults["method"])

    @property
    def int4(self) -> Int4Spec:
        """The int4 group layout (w4a16, whose defaults fill group_size and symmetric)."""
        assert self.group_size is not None and self.symmetric is not None, "not an int4 scheme"
        return Int4Spec(self.group_size, self.symmetric)

    def check(self) -> None:
        """Refuse what the scheme does not take and values out of range, then fill the scheme's defaults."""
        if self.scheme not in SCHEMES:
            raise CalibrationError(f"--scheme {self.scheme!r} is not one of {', '.join(SCHEMES.names())}")
        scheme = self.scheme_entry
        scheme.check(self)
        self.compute_dtype = DTYPE_SPELLINGS.get(self.compute_dtype, self.compute_dtype)
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise CalibrationError(f"compute_dtype {self.compute_dtype!r} is not one of {', '.join(COMPUTE_DTYPES)}")
        check_spelling(self.device)
        for name in ("group_size", "num_samples", "batch_size", "threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise CalibrationError(f"{name} must be a positive integer (got {value!r})")
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or isinstance(self.seq_len, bool)
                                         or self.seq_len < 2):
            raise CalibrationError(f"seq_len must be an integer >= 2 (got {self.seq_len!r})")
        for pattern in self.ignore:
            try:
                re.compile(pattern)
            except (re.error, TypeError) as e:
                raise CalibrationError(f"ignore pattern {pattern!r} is not a regular expression ({e})") from None
        for key, value in {**scheme.defaults, "fmt": scheme.formats[0]}.items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        if self.hessian not in HESSIANS:
            raise CalibrationError(f"--hessian {self.hessian!r} is not one of {', '.join(HESSIANS)}")
        if self.hessian != PLAIN and "hessian" not in self.method_entry.reads:
            raise CalibrationError(f"--hessian {self.hessian} weights GPTQ's Hessians; --method "
                                   f"{self.method_entry.name} does not run GPTQ")
        if self.clip_search and "clip_search" not in self.method_entry.reads:
            raise CalibrationError(f"--clip-search searches GPTQ's clipping; --method {self.method_entry.name} "
                                   "does not run GPTQ")


FIELDS = {f.name: f for f in dataclasses.fields(CalibrationConfig)}
SPELLINGS = {"format": "fmt"}  # a recipe's (and the CLI's) name → the field's


def _type(name: str) -> type:
    """A field's value type without None (`int | None` → int, `tuple[str, ...]` → tuple)."""
    hint = typing.get_type_hints(CalibrationConfig)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_origin(hint) is not tuple else []
    base = args[0] if args else hint
    return typing.get_origin(base) or base


def calibration_setting(key: str, value: Any, where: str) -> Any:
    """One setting (a field's name) typed as its field is, by the rules recipes follow (qwen2om.recipe.typed)."""
    if value is None and FIELDS[key].default is None:  # `seq_len: null`: not given
        return None
    return typed(key, value, _type(key), where)


def calibration_config(recipe: Path | None, flags: dict[str, Any], ignore: tuple[str, ...] = ()) -> CalibrationConfig:
    """Defaults, then a recipe file's settings, then the command line's; `ignore` lists add up."""
    settings: dict[str, Any] = {}
    if recipe is not None:
        where = str(recipe)
        data = parse_yaml(read_recipe_text(Path(recipe)), where)
        if not isinstance(data, dict):
            raise CalibrationError(f"{recipe}: a calibration recipe is a mapping of settings")
        data = {SPELLINGS.get(k, k): v for k, v in data.items()}
        if unknown := sorted(str(k) for k in set(data) - set(FIELDS)):
            spelled = {v: k for k, v in SPELLINGS.items()}
            raise CalibrationError(f"{recipe}: unknown setting(s) {', '.join(unknown)} "
                                   f"(known: {', '.join(sorted(spelled.get(f, f) for f in FIELDS))})")
        settings.update({k: calibration_setting(k, v, where) for k, v in data.items()})
    settings.update(flags)
    settings["ignore"] = (*tuple(settings.get("ignore") or ()), *ignore)
    try:
        return CalibrationConfig(**settings)
    except TypeError as e:
        raise CalibrationError(f"calibration settings: {e}") from None
