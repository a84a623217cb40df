"""The pass runner: a plan checked before any work, each pass timed and reported.

A pass reads and fills named workspace slots. `check_plan` proves the order can satisfy
every `requires` before the first pass runs, so a recipe typo fails in milliseconds.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

from qwen2om.errors import PlanError, Qwen2omError
from qwen2om.journal import Journal
from qwen2om.registry import Registry

Stats = dict[str, int | float | str]


@dataclasses.dataclass(frozen=True)
class PassResult:
    """What a pass did: `modified` only when something changed, `stats` counts what."""

    modified: bool
    stats: Stats = dataclasses.field(default_factory=dict)


def no_progress(label: str, done: int, total: int, *, unit: str = "") -> None:
    """Progress callback signature: `unit="bytes"` makes a bar show sizes instead of counts."""


@dataclasses.dataclass
class RunContext:
    """What every pass may read: the resolved recipe, the staging directory, progress hooks,
    how many threads it may use, and the journal that lets an interrupted run resume."""

    recipe: Any
    stage_dir: Path
    source: Path
    tool_version: str = ""
    model: str = ""  # the model as the user named it (builtin:NAME, not its cache directory), for messages
    progress: Callable[..., None] = no_progress
    log: Callable[[str], None] = lambda msg: None
    workers: int = 1
    journal: Journal = dataclasses.field(default_factory=Journal)


class Workspace(dict[str, Any]):
    """Named slots passes fill; a missing slot is a bug in the plan, reported as such."""

    def need(self, slot: str) -> Any:
        if slot not in self:
            raise PlanError(f"workspace slot {slot!r} is empty")
        return self[slot]


class Pass(Protocol):
    """One pipeline stage: reads and fills workspace slots, reports what it did."""

    name: ClassVar[str]
    requires: ClassVar[tuple[str, ...]]
    produces: ClassVar[tuple[str, ...]]

    def __call__(self, ws: Workspace, ctx: RunContext) -> PassResult: ...


@dataclasses.dataclass(frozen=True)
class PassEntry:
    """A registered pass: its class, built with the recipe's arguments for it."""

    name: str
    factory: Callable[..., Pass]
    requires: tuple[str, ...]
    produces: tuple[str, ...]
    doc: str


PASSES: Registry[PassEntry] = Registry("pass")


def register(cls: type) -> type:
    """Class decorator adding a pass to the registry under its `name`."""
    PASSES.add(PassEntry(cls.name, cls, cls.requires, cls.produces, (cls.__doc__ or "").strip().split("\n")[0]))
    return cls


def check_plan(names: Sequence[str], filled: set[str] | None = None) -> None:
    """Fail before any work if the order cannot satisfy every `requires`."""
    have = set(filled or ())
    for i, name in enumerate(names):
        entry = PASSES.get(name)
        if missing := [s for s in entry.requires if s not in have]:
            before = ", ".join(names[:i]) or "none"
            raise PlanError(f"pass {name!r} needs {missing}, which no earlier pass produces (before it: {before})")
        have.update(entry.produces)


@dataclasses.dataclass(frozen=True)
class StepReport:
    name: str
    seconds: float
    modified: bool
    stats: Stats


def build_pass(name: str, args: dict[str, Any]) -> Pass:
    try:
        return PASSES.get(name).factory(**args)
    except TypeError as e:
        raise PlanError(f"pass {name!r}: bad arguments {args} ({e})") from None


def run_pipeline(
    steps: Sequence[tuple[str, dict[str, Any]]], ws: Workspace, ctx: RunContext,
    on_step: Callable[[StepReport], None] = lambda r: None,
    after_pass: Callable[[int, str, Workspace], None] | None = None,
) -> list[StepReport]:
    """Run the passes in order; an error names the failing pass and those that ran before it.

    `after_pass(number, name, ws)` (numbered from 1) sees the workspace after each pass, untimed:
    `convert --dump-graph` writes the graphs there."""
    check_plan([n for n, _ in steps], set(ws))
    built = [(name, build_pass(name, args)) for name, args in steps]  # bad arguments fail before any work
    reports: list[StepReport] = []
    for name, p in built:
        t0 = time.perf_counter()
        try:
            result = p(ws, ctx)
        except Qwen2omError as e:
            done = ", ".join(r.name for r in reports) or "none"
            raise type(e)(f"{e} [in pass {name!r}; completed: {done}]") from None
        report = StepReport(name, time.perf_counter() - t0, result.modified, dict(result.stats))
        reports.append(report)
        on_step(report)
        if after_pass is not None:
            after_pass(len(reports), name, ws)
    return reports
