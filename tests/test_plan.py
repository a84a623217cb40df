"""The pass contract: declarations checked at registration, plans checked before any work, passes
held to what they declare."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import qwen2om.passes  # noqa: F401  (registers the passes)
from qwen2om.errors import PlanError
from qwen2om.pipeline import PASSES, PassResult, check_plan, hold_to_declaration, register
from qwen2om.recipe import bundled_recipes, load_recipe
from qwen2om.state import FACTS, FIELDS, ConvertState


def bundled_pipelines() -> dict[str, list[str]]:
    """target → the pass names of its bundled pipeline (the dtypes share one pipeline)."""
    found: dict[str, list[str]] = {}
    for name in bundled_recipes():
        r = load_recipe(name)
        names = [n for n, _ in r.pipeline]
        assert found.setdefault(r.target, names) == names, f"{name}: a second {r.target} pipeline"
    return found


def test_the_reorder_that_lost_every_scale_input_is_refused() -> None:
    """scale_inputs before lower_fp8 converted an FP8 model with zero scale inputs; now refused, naming both."""
    names = bundled_pipelines()["ort"]
    i, j = names.index("lower_fp8"), names.index("scale_inputs")
    names[i], names[j] = names[j], names[i]
    with pytest.raises(PlanError, match=r"pass 'scale_inputs' needs \['fp8_lowered'\].*'lower_fp8' must run before"):
        check_plan(names)


def test_a_graph_change_after_the_graphs_were_written_is_refused() -> None:
    names = bundled_pipelines()["ort"]
    names.remove("fuse_int4")
    names.insert(names.index("write_onnx") + 1, "fuse_int4")
    with pytest.raises(PlanError, match=r"'fuse_int4' changes \['graphs'.*'write_onnx' has already taken as final"):
        check_plan(names)


def test_ascend_graphs_are_checked_after_their_last_change() -> None:
    names = bundled_pipelines()["ascend"]
    i = names.index("check_ascend")
    names[i - 1], names[i] = names[i], names[i - 1]  # scale_inputs after the legality check
    with pytest.raises(PlanError, match=r"'scale_inputs' changes .*'check_ascend' has already taken as final"):
        check_plan(names)


def test_a_pass_runs_after_the_passes_whose_work_it_takes() -> None:
    """fuse_moe fuses the experts' final forms: after the lowering passes where they run, with or without them."""
    names = bundled_pipelines()["ort"]
    names.remove("fuse_moe")
    names.insert(names.index("lower_int4"), "fuse_moe")
    with pytest.raises(PlanError, match=r"'fuse_moe' must run after 'lower_int4': it works on what 'lower_int4' "
                                        r"leaves \(int4_lowered\)"):
        check_plan(names)
    check_plan([n for n in bundled_pipelines()["ort"] if n not in ("scale_inputs", "lower_fp8")])


def test_check_plan_accepts_a_filled_state() -> None:
    check_plan(["static_model"], filled={"checkpoint"})
    with pytest.raises(PlanError, match=r"needs \['checkpoint'\].*'load_checkpoint' must run before it"):
        check_plan(["static_model"])


def test_every_declaration_names_fields_and_facts() -> None:
    produced = set()
    for entry in PASSES:
        assert set(entry.requires) | set(entry.produces) <= {*FIELDS, *FACTS}, entry.name
        assert set(entry.modifies) | set(entry.freezes) <= set(FIELDS), entry.name
        produced |= set(entry.produces)
    assert set(FACTS) <= produced, "a fact no pass establishes"


def pass_class(**declared: tuple[str, ...]) -> type:
    attrs = {"name": "probe", "requires": (), "produces": ("graphs",), "__call__": lambda self, s, c: PassResult(True)}
    return type("Probe", (), attrs | declared)


@pytest.mark.parametrize(("declared", "message"), [
    ({"requires": ("graph",)}, r"declares \['graph'\], which are not ConvertState fields or facts"),
    ({"produces": ("legal",)}, r"declares \['legal'\]"),
    ({"modifies": ("graphs_legal",)}, r"declares \['graphs_legal'\], which are not ConvertState fields"),
    ({"requires": ("graphs",), "produces": ("graphs",)}, r"both requires and produces \['graphs'\]"),
    ({"modifies": ("signatures",)}, r"modifies \['signatures'\] without requiring them"),
    ({"produces": ()}, "produces nothing"),
])
def test_a_bad_declaration_is_refused_when_the_pass_registers(declared: dict, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        register(pass_class(**declared))
    assert "probe" not in PASSES


def test_a_pass_is_held_to_its_declaration() -> None:
    """Replacing a field it does not declare, or leaving one it produces empty, fails at that pass."""
    state = ConvertState(graphs={})
    held = {f: id(getattr(state, f)) for f in FIELDS}
    state.signatures = {}
    with pytest.raises(PlanError, match=r"'fuse_norm' wrote \['signatures'\], which it does not declare"):
        hold_to_declaration(PASSES.get("fuse_norm"), state, held)
    empty = ConvertState()
    with pytest.raises(PlanError, match=r"'package' declares it produces \['package_files'\] but left them empty"):
        hold_to_declaration(PASSES.get("package"), empty, {f: id(getattr(empty, f)) for f in FIELDS})


def test_a_state_starts_from_its_filled_fields_and_facts() -> None:
    state = ConvertState(graphs={})
    assert not state.has("graphs_legal") and state.filled() == {"graphs"}
    state.facts.add("graphs_legal")
    assert state.has("graphs_legal") and state.filled() == {"graphs", "graphs_legal"}


def test_the_design_doc_lists_every_pass_as_declared() -> None:
    """docs/design.md's pass table is the contract as users read it; it must say what the code declares."""
    text = (Path(__file__).parent.parent / "docs" / "design.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]*) \|", text, flags=re.M))
    for entry in PASSES:
        cell = f"{', '.join(entry.requires)} → {', '.join(entry.produces)}".strip()
        cell += f"; changes {', '.join(entry.modifies)}" if entry.modifies else ""
        cell += f"; freezes {', '.join(entry.freezes)}" if entry.freezes else ""
        cell += f"; after {', '.join(entry.follows)}" if entry.follows else ""
        assert rows.get(entry.name, "").strip() == cell, entry.name


def test_scale_inputs_asked_for_without_the_pass_is_refused(tmp_path) -> None:
    r = load_recipe("ort")
    without = tuple(step for step in r.pipeline if step[0] not in ("scale_inputs", "fuse_int4"))
    dataclasses.replace(r, pipeline=without, scales="constants").check()
    with pytest.raises(PlanError, match="scales=inputs needs the 'scale_inputs' pass"):
        dataclasses.replace(r, pipeline=without, scales="inputs").check()
