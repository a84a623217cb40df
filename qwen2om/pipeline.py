"""The pass runner: a plan checked against the passes' declarations before any work, each pass
timed and reported.

A pass reads and fills ConvertState fields and establishes facts (qwen2om/state.py). It declares
what it `requires` and `produces`, the fields it changes in place (`modifies`) and those it takes as
final (`freezes`: written out or checked, so no later pass may change them), and the facts it must
come after when the plan establishes them at all (`follows`). `check_plan` proves,
before the first pass runs, that every requirement is produced by an earlier pass and that nothing
is changed after it was frozen, naming the passes; the runner holds each pass to its declaration.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from qwen2om.errors import PlanError, Qwen2omError
from qwen2om.journal import Journal
from qwen2om.registry import Registry
from qwen2om.state import FACTS, FIELDS, ConvertState, check_names

if TYPE_CHECKING:
    from qwen2om.checkpoint import Checkpoint
    from qwen2om.recipe import Recipe
    from qwen2om.stages import Stage

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

    recipe: Recipe
    stage_dir: Path
    source: Path
    tool_version: str = ""
    model: str = ""  # the model as the user named it (builtin:NAME, not its cache directory), for messages
    progress: Callable[..., None] = no_progress
    log: Callable[[str], None] = lambda msg: None
    workers: int = 1
    journal: Journal = dataclasses.field(default_factory=Journal)
    # The checkpoint `convert` opened (lazily: headers) for its checks before any work; load_checkpoint
    # checks it and puts it in the state instead of opening it again. Other passes read state.checkpoint.
    opened_checkpoint: Checkpoint | None = None
    # A pipeline stage's layers and ends (`convert --stages`, qwen2om/stages.py); None: the whole model.
    stage: Stage | None = None


class Pass(Protocol):
    """One pipeline stage: reads and fills ConvertState, reports what it did."""

    name: ClassVar[str]
    requires: ClassVar[tuple[str, ...]]  # fields and facts it reads
    produces: ClassVar[tuple[str, ...]]  # fields it fills and facts it establishes
    modifies: ClassVar[tuple[str, ...]]  # fields it changes in place (optional; default none)
    freezes: ClassVar[tuple[str, ...]]  # fields it takes as final (optional; default none)
    follows: ClassVar[tuple[str, ...]]  # facts it needs established first when the plan establishes them at all

    def __call__(self, state: ConvertState, ctx: RunContext) -> PassResult: ...


@dataclasses.dataclass(frozen=True)
class PassEntry:
    """A registered pass: its class, built with the recipe's arguments for it, and its declaration."""

    name: str
    factory: Callable[..., Pass]
    requires: tuple[str, ...]
    produces: tuple[str, ...]
    doc: str
    modifies: tuple[str, ...] = ()
    freezes: tuple[str, ...] = ()
    follows: tuple[str, ...] = ()

    def changes(self) -> tuple[str, ...]:
        """The fields this pass writes, by filling them or in place."""
        return tuple(f for f in (*self.produces, *self.modifies) if f in FIELDS)


PASSES: Registry[PassEntry] = Registry("pass")


def register(cls: type) -> type:
    """Class decorator adding a pass to the registry under its `name`, its declaration checked."""
    owner = f"pass {cls.name!r}"
    modifies, freezes, follows = (getattr(cls, k, ()) for k in ("modifies", "freezes", "follows"))
    check_names(owner, cls.requires)
    check_names(owner, cls.produces)
    check_names(owner, modifies, fields_only=True)
    check_names(owner, freezes, fields_only=True)
    check_names(owner, follows)
    if not cls.produces:
        raise PlanError(f"{owner} produces nothing: a pass fills a field or establishes a fact")
    if both := sorted(set(cls.requires) & set(cls.produces)):
        raise PlanError(f"{owner} both requires and produces {both}: a change in place is `modifies`")
    if unread := [f for f in modifies if f not in cls.requires]:
        raise PlanError(f"{owner} modifies {unread} without requiring them")
    PASSES.add(PassEntry(cls.name, cls, tuple(cls.requires), tuple(cls.produces),
                         (cls.__doc__ or "").strip().split("\n")[0], tuple(modifies), tuple(freezes),
                         tuple(follows)))
    return cls


def check_plan(names: Sequence[str], filled: set[str] | None = None) -> None:
    """Fail before any work if the order leaves a requirement unmet, puts a pass before one whose work it
    follows, or changes a frozen field."""
    have = set(filled or ())
    frozen: dict[str, str] = {}  # field → the pass that took it as final
    for i, name in enumerate(names):
        entry = PASSES.get(name)
        before = ", ".join(names[:i]) or "none"
        if missing := [s for s in entry.requires if s not in have]:
            makers = sorted({e.name for e in PASSES for s in missing if s in e.produces})
            hint = f"; {' or '.join(map(repr, makers))} must run before it" if makers else ""
            raise PlanError(f"pass {name!r} needs {missing}, which no earlier pass produces "
                            f"(before it: {before}){hint}")
        if early := [(later, f) for later in names[i + 1:] for f in PASSES.get(later).produces if f in entry.follows]:
            later, fact = early[0]
            raise PlanError(f"pass {name!r} must run after {later!r}: it works on what {later!r} leaves ({fact}) "
                            f"(before it: {before})")
        if late := [f for f in entry.changes() if f in frozen]:
            raise PlanError(f"pass {name!r} changes {late}, which pass {frozen[late[0]]!r} has already taken as "
                            f"final (before it: {before}); {name!r} must run before {frozen[late[0]]!r}")
        have.update(entry.produces)
        for f in entry.freezes:
            frozen.setdefault(f, name)


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
    steps: Sequence[tuple[str, dict[str, Any]]], state: ConvertState, ctx: RunContext,
    on_step: Callable[[StepReport], None] = lambda r: None,
    after_pass: Callable[[int, str, ConvertState], None] | None = None,
) -> list[StepReport]:
    """Run the passes in order; an error names the failing pass and those that ran before it.

    `after_pass(number, name, state)` (numbered from 1) sees the state after each pass, untimed:
    `convert --dump-graph` writes the graphs there."""
    check_plan([n for n, _ in steps], state.filled())
    built = [(name, build_pass(name, args)) for name, args in steps]  # bad arguments fail before any work
    reports: list[StepReport] = []
    for name, p in built:
        entry = PASSES.get(name)
        t0 = time.perf_counter()
        held = {f: id(getattr(state, f)) for f in FIELDS}
        try:
            result = p(state, ctx)
        except Qwen2omError as e:
            done = ", ".join(r.name for r in reports) or "none"
            raise type(e)(f"{e} [in pass {name!r}; completed: {done}]") from None
        hold_to_declaration(entry, state, held)
        state.facts.update(f for f in entry.produces if f in FACTS)
        report = StepReport(name, time.perf_counter() - t0, result.modified, dict(result.stats))
        reports.append(report)
        on_step(report)
        if after_pass is not None:
            after_pass(len(reports), name, state)
    return reports


def hold_to_declaration(entry: PassEntry, state: ConvertState, held: dict[str, int]) -> None:
    """A pass that replaced a field it does not declare, or left a field it produces empty, is a bug
    in the pass: caught here, where it happened, not passes later."""
    if stray := [f for f in FIELDS if id(getattr(state, f)) != held[f] and f not in entry.changes()]:
        raise PlanError(f"pass {entry.name!r} wrote {stray}, which it does not declare")
    if empty := [f for f in entry.produces if f in FIELDS and getattr(state, f) is None]:
        raise PlanError(f"pass {entry.name!r} declares it produces {empty} but left them empty")
