"""Quantisation schemes and calibration methods as data: which methods apply to which scheme, the
settings each reads and ignores, the formats a scheme writes, and the refusals that go with them.
`calibrate()` and the CLI check a configuration through the same entries (`Scheme.check`); code asks
the entry (`METHODS.get(m).needs_data`), not `if method == "rtn"`. Formats are qwen2om/quant/formats.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol

from qwen2om.errors import Qwen2omError
from qwen2om.quant.formats import FORMATS
from qwen2om.registry import Registry


class CalibrationError(Qwen2omError):
    """Calibration cannot go on (non-finite activations, a group size that does not fit, …)."""


class Settings(Protocol):
    """What `Scheme.check` reads of a calibration configuration (None: not given)."""

    method: str | None
    fmt: str | None


# Settings a method that runs the model over calibration data reads.
DATA = ("dataset", "num_samples", "seq_len", "batch_size", "compute_dtype", "activation_budget")


@dataclasses.dataclass(frozen=True)
class Method:
    """One way of choosing the quantised values, as `--method` names it."""

    name: str
    summary: str
    schemes: tuple[str, ...]  # the schemes it applies to
    reads: tuple[str, ...] = ()  # the settings it reads besides its scheme's (group_size, symmetric)
    searches_scales: bool = False  # AWQ: input-channel scales and a clipping search, no error feedback
    orders_columns: bool = False  # GPTQ: static act-order (recorded in quantization_config)

    @property
    def needs_data(self) -> bool:
        """Runs the model over calibration samples (else data-free: each weight read once)."""
        return "dataset" in self.reads


METHODS: Registry[Method] = Registry("method")

RTN = METHODS.add(Method("rtn", "round to nearest (data-free)", ("w4a16", "fp8-block")))
GPTQ = METHODS.add(Method("gptq", "Hessian-based, static act-order", ("w4a16",),
                          reads=(*DATA, "damp", "actorder", "clip_search", "hessian"), orders_columns=True))
AWQ = METHODS.add(Method("awq", "activation-aware scaling + clipping search", ("w4a16",), reads=DATA,
                         searches_scales=True))


@dataclasses.dataclass(frozen=True)
class Scheme:
    """One quantisation scheme, as `--scheme` names it."""

    name: str
    summary: str
    formats: tuple[str, ...]  # the formats (FORMATS names) it writes; the first is the default
    defaults: Mapping[str, Any]  # its settings' values when not given
    # setting → the flag that gives it: settings it ignores, refused when given (at a value it does not take)
    unused: Mapping[str, str] = dataclasses.field(default_factory=dict)
    why_unused: str = ""

    @property
    def methods(self) -> tuple[str, ...]:
        return tuple(m.name for m in METHODS if self.name in m.schemes)

    def _takes(self, setting: str, value: Any) -> bool:
        return value is None or (setting == "method" and value in self.methods)

    def check(self, settings: Settings) -> None:
        """Refuse a setting this scheme ignores, a method that does not apply to it and a format it
        does not write; the library and the CLI alike."""
        if given := [flag for key, flag in self.unused.items() if not self._takes(key, getattr(settings, key))]:
            raise CalibrationError(f"{', '.join(given)}: not used by --scheme {self.name} ({self.why_unused})")
        if settings.method is not None and settings.method not in self.methods:
            raise CalibrationError(f"--method {settings.method!r} is not one of {', '.join(self.methods)}")
        if settings.fmt is not None and settings.fmt not in self.formats:
            if len(self.formats) == 1:
                raise CalibrationError(f"--format {settings.fmt}: {self.name} writes "
                                       f"{FORMATS.get(self.formats[0]).summary} only")
            raise CalibrationError(f"--format {settings.fmt!r} is not one of {', '.join(self.formats)}")


SCHEMES: Registry[Scheme] = Registry("scheme")

W4A16 = SCHEMES.add(Scheme(
    "w4a16", "int4 weights in groups, float activations (qwen2om/quant/int4.py)",
    formats=("compressed-tensors", "ascendv1"),
    defaults={"method": "gptq", "group_size": 128, "symmetric": True, "dataset": "builtin:chat+prose+code"},
))
FP8_BLOCK = SCHEMES.add(Scheme(
    "fp8-block", "e4m3fn weights in 128×128 tiles, data-free (qwen2om/quant/fp8_block.py)",
    formats=("fp8",), defaults={"method": "rtn"},
    unused={"method": "--method", "group_size": "--group-size", "symmetric": "--sym/--asym", "dataset": "--dataset"},
    why_unused="data-free: each 128×128 tile's largest |w| maps to e4m3fn's 448",
))
