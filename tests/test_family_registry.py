"""The model-family registry (qwen2om/families.py): one entry per family, no branches on the
architecture outside it, and Hugging Face tensor names spelled only there and in the checkpoint readers."""

from __future__ import annotations

import ast
import re
import zlib
from pathlib import Path

import pytest
import torch

from qwen2om.arch import ARCHS, STATIC_ROPE, ModelDims, expected_tensors, resolve_arch
from qwen2om.families import FAMILIES, HYBRID, QWEN_NAMES, family_of
from qwen2om.fixtures.tiny import TINY
from qwen2om.registry import UnknownNameError
from qwen2om.signature import graph_io
from qwen2om.weights import Weights

ROOT = Path(__file__).resolve().parent.parent
# The converter's own code (installed as qwen2om, qwen2om.passes, qwen2om.kernels). fixtures/ is not
# scanned: it writes Hugging Face checkpoints for the tests, playing transformers' part.
SCANNED = ("qwen2om", "passes", "kernels")
# Where Hugging Face tensor names may be spelled, and why.
ALLOWED = {
    "qwen2om/families.py": "the registry: TensorNames spells them for everyone else",
    "qwen2om/arch.py": "checkpoint reader: the expected tensor table, quantisation targets, what stays float",
    "qwen2om/checkpoint.py": "checkpoint reader: layouts, fused experts, the Qwen3.5 wrapper's names",
    "qwen2om/static_model.py": "the dense family's static model: its module tree is the checkpoint's layout",
    "qwen2om/static_hybrid.py": "the hybrid family's static model: its module tree is the checkpoint's layout",
}
# A module or projection name of the Hugging Face Qwen layout, as a tensor name, a node scope or a regex
# spells it (backslashes removed): `….mlp.experts.7.gate_proj.weight`, `/model/layers.3/self_attn/rotary/`,
# `(input|post_attention)_layernorm`, `lm_head.weight`; not prose such as "also quantise lm_head".
HF_NAME = re.compile(r"_proj\b|_layernorm\b|\bembed_tokens\b|\bself_attn\b|\blinear_attn\b|\bshared_expert"
                     r"|(^|[./])lm_head([./]|$)|[./]experts([./]|$)|(^|[./])experts[./]|[./]mlp[./]|model[./]norm\b")
# Classes a caller would branch on instead of asking the family.
FAMILY_CLASSES = {"StaticQwen", "StaticHybrid", "DecoderLayer", "HybridLayer", "GatedDeltaNet", "GatedAttention"}


def code_strings(source: str) -> list[tuple[int, str]]:
    """Every string literal of `source` (f-strings' literal parts included) except docstrings."""
    tree = ast.parse(source)
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs]


def hf_names(source: str) -> list[str]:
    return [f"{line}: {s!r}" for line, s in sorted(code_strings(source)) if HF_NAME.search(s.replace("\\", ""))]


def modules() -> list[tuple[str, str]]:
    return [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8"))
            for root in SCANNED for p in sorted((ROOT / root).rglob("*.py"))]


def test_the_name_check_finds_names_and_passes_prose() -> None:
    planted = '''
"""Docstrings may say model.layers.0.self_attn.q_proj.weight."""
a = f"{p}.experts.{e}.{proj}_proj.weight"
b = re.compile(r"^/model/layers\\.(\\d+)/self_attn/rotary/")
c = re.compile(r"^(/model/layers\\.\\d+/(input|post_attention)_layernorm|/model/norm)/")
d = "model.embed_tokens.weight"
e = ".mlp.experts.gate_up_proj"
f = "lm_head.weight"
g = f"model.layers.{i}.linear_attn"
ok = ["also quantise lm_head", "quantize_lm_head", "experts with too few calibration tokens", "rtn_experts",
      "experts", "model.layers.", "/model/rotary.half", "in_proj_qkv"]
'''
    found = hf_names(planted)
    assert [f.split(":")[0] for f in found] == ["3", "3", "4", "5", "6", "7", "8", "9"], found


def test_hugging_face_names_are_spelled_only_in_the_registry_and_the_readers() -> None:
    assert all((ROOT / path).is_file() for path in ALLOWED), "an allowed module moved: update ALLOWED"
    found = {path: names for path, source in modules() if path not in ALLOWED and (names := hf_names(source))}
    assert not found, ("Hugging Face tensor names outside qwen2om/families.py and the checkpoint readers; "
                       f"use TensorNames (family_of(arch).names, or QWEN_NAMES in graph passes): {found}")


def branches(source: str) -> list[str]:
    """`x.hybrid` anywhere, and isinstance checks against a family's model or layer classes."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "hybrid":
            out.append(f"{node.lineno}: .hybrid")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} if len(node.args) > 1 else set()
            if named & FAMILY_CLASSES:
                out.append(f"{node.lineno}: isinstance(…, {', '.join(sorted(named & FAMILY_CLASSES))})")
    return out


def test_the_branch_check_finds_branches() -> None:
    planted = "if ckpt.arch.hybrid:\n    pass\nif isinstance(layer, HybridLayer):\n    pass\nok = arch.family\n"
    assert branches(planted) == ["1: .hybrid", "3: isinstance(…, HybridLayer)"]


def test_no_branch_on_the_family_outside_the_registry() -> None:
    own = {"qwen2om/families.py", "qwen2om/static_model.py", "qwen2om/static_hybrid.py"}
    found = {path: b for path, source in modules() if path not in own and (b := branches(source))}
    assert not found, f"branches on the model family; ask family_of(arch) instead: {found}"


def test_every_architecture_has_a_registered_family() -> None:
    assert FAMILIES.names() == ["dense", "hybrid"]
    by_family = {f.name: sorted(a.name for a in ARCHS if family_of(a) is f) for f in FAMILIES}
    assert by_family == {"dense": ["qwen2", "qwen2_moe", "qwen3", "qwen3_moe"],
                         "hybrid": ["qwen3_5", "qwen3_5_moe", "qwen3_next"]}
    with pytest.raises(UnknownNameError, match=r"unknown model family 'qwen9' \(known: dense, hybrid\)"):
        FAMILIES.get("qwen9")


def test_architecture_facts_agree_with_their_family() -> None:
    """What the config reader knows of an architecture (arch.py, no torch) is what its family's static model
    implements: linear attention, the gated full attention, partial RoPE from plain tables."""
    for a in ARCHS:
        hybrid = family_of(a) is HYBRID
        assert (a.linear_attention, a.attn_output_gate, a.partial_rotary) == (hybrid, hybrid, hybrid), a.name
        assert a.rope_types == (("default",) if hybrid else STATIC_ROPE), a.name


def test_graph_passes_can_assume_one_spelling() -> None:
    """Fusion passes match node scopes without a checkpoint at hand (QWEN_NAMES): a family that names
    its tensors otherwise must thread its names through them first."""
    assert all(f.names is QWEN_NAMES for f in FAMILIES)


def test_tensor_names() -> None:
    n, mlp = QWEN_NAMES, QWEN_NAMES.mlp(3)
    assert mlp == "model.layers.3.mlp" and n.layer(3) == "model.layers.3"
    assert n.expert(mlp, 7, "gate") == "model.layers.3.mlp.experts.7.gate_proj.weight"
    assert n.parse_expert(n.expert(mlp, 7, "down")) == (mlp, 7, "down")
    assert n.parse_expert("model.layers.3.mlp.gate_proj.weight") is None
    assert n.parse_fused("model.layers.3.mlp.experts.gate_up_proj") == (mlp, "gate_up")
    assert n.unfused("model.layers.3.mlp.experts.gate_up_proj", 5) == {
        "gate": n.expert(mlp, 5, "gate"), "up": n.expert(mlp, 5, "up")}
    assert n.unfused("model.language_model.layers.0.mlp.experts.down_proj", 1) == {
        "down": "model.language_model.layers.0.mlp.experts.1.down_proj.weight"}
    assert n.is_fused("model.language_model.layers.0.mlp.experts.down_proj")
    assert n.parse_stack(n.stack(mlp, "gate_up")) == (mlp, "gate_up") and n.parse_stack(mlp + ".gate.weight") is None
    assert n.expert(mlp, "*", "up") == "model.layers.3.mlp.experts.*.up_proj.weight"
    assert n.attention_scope_re("rotary").match(n.attention_scope(12, "rotary") + "/Mul_3").group(1) == "12"
    assert n.experts_scope_re().match(n.experts_scope(2) + "/TopK").group(1) == "2"
    assert n.norm_scope_re().match("/model/layers.1/post_attention_layernorm/Pow").group(1) == \
        "/model/layers.1/post_attention_layernorm"
    assert n.norm_scope_re().match("/model/norm/Sqrt") and not n.norm_scope_re().match("/model/layers.1/mlp/Mul")


def tiny_config(name: str) -> dict:
    spec = TINY[name]
    return {"model_type": spec.model_type, **spec.config, "vocab_size": 96}


def random_weights(shapes: dict[str, tuple[int, ...]]) -> Weights:
    def read(name: str, dtype: torch.dtype | None = None, rows: tuple[int, int] | None = None) -> torch.Tensor:
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        return torch.randn(shapes[name], generator=g) * 0.1

    return Weights(read, dict(shapes), torch.float32, lazy=False)


@pytest.mark.parametrize("arch", [a.name for a in ARCHS])
def test_each_family_builds_its_static_model(arch: str) -> None:
    """The family's static model for a tiny config of each architecture: built from the checkpoint's
    tensor table, every parameter bound to a checkpoint tensor, one decode step in the signature's shapes;
    and its layers as layerwise calibration runs them."""
    cfg = tiny_config(ARCHS.get(arch).builtin)
    spec, d = resolve_arch(cfg), ModelDims.from_config(cfg)
    family = family_of(spec)
    table = expected_tensors(spec, d)
    weights = random_weights(table)
    p = 4
    cos, sin = family.rope_tables(cfg, d, p + 1)
    assert cos.shape == sin.shape == (p + 1, d.rotary_dim or d.head_dim) and cos.dtype == torch.float32
    model = family.static_model(spec, d, weights, cos, sin, logits_last=True).eval()
    assert type(model) is family.static_model
    sources = {ref.source for ref in weights.bindings(model).values()}
    stacks = {n for n in sources if QWEN_NAMES.parse_stack(n)}
    assert sources - stacks == set(table) - {n for n in table if QWEN_NAMES.parse_expert(n)}
    inputs, outputs = graph_io(d, batch=1, t=1, capacity=p, dtype="float32", logits_t=1)
    feeds = [torch.zeros(s.shape, dtype=torch.int64 if s.dtype == "int64" else torch.float32) for s in inputs]
    feeds[2] += p  # position_ids: the first slot after the cache
    with torch.no_grad():
        got = model(*feeds[:3], tuple(feeds[3:]))
    assert [tuple(t.shape) for t in got] == [s.shape for s in outputs]
    assert all(torch.isfinite(t).all() for t in got)
    x = torch.randn(1, 3, d.hidden, generator=torch.Generator().manual_seed(0))
    for i in range(d.layers):
        layer = family.layer(spec, d, weights, QWEN_NAMES.layer(i), i, fused=False).eval()
        with torch.no_grad():
            y = family.first_call(layer, x, cos[None, None, :3], sin[None, None, :3], torch.zeros(1, 1, 3, 3), d)
        assert y.shape == x.shape and torch.isfinite(y).all()
