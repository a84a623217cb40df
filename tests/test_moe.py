"""Mixture of experts (qwen3_moe, qwen2_moe): static routing that is right for every routing."""

from __future__ import annotations

import collections
import functools
import json
import shutil
from pathlib import Path

import onnx
import pytest
import torch
from edits import INDEX, convert_fails, edit_tensor
from safetensors.torch import load_file, save_file

from qwen2om.checkpoint import Checkpoint
from qwen2om.convert import convert
from qwen2om.verify import reference_greedy, verify

SMALL = ["max_seq_len=256", "prefill_chunk=32"]
REPEATED = "the " * 24  # identical tokens: identical router inputs in layer 0
VARIED = ("MoE routing test: def main(argv): return sum(x ** 2 for x in argv) # 数学 über café, "
          "JSON {\"a\": [1, 2.5, null]} <html><body>Привет</body></html> SELECT * FROM t WHERE id = 42;")


# Routing decisions whose top-k margin (k-th minus (k+1)-th router logit) is below this could flip
# between CPUs or between ONNX Runtime and torch: float32 rounding moves these logits (spread ~3, see
# fixtures/tiny.py ROUTER_SCALE) by ~1e-6, so 1e-3 leaves a thousandfold headroom.
MARGIN = 1e-3


class Router:
    """transformers' own routing: per layer, per position, the experts a text is sent to and the
    margin by which each decision was made."""

    def __init__(self, ckpt_dir: Path) -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32).eval()
        self.tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(ckpt_dir / "tokenizer.json"))
        self.experts = self.model.config.num_experts
        self.top_k = self.model.config.num_experts_per_tok

    def decisions(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per layer and position: the chosen experts [L, N, k] and each choice's margin [L, N]."""
        chosen, margin = self.batch_decisions([ids])
        return chosen[:, 0], margin[:, 0]

    def batch_decisions(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """`decisions` for several sequences at once, right-padded: [L, B, N, k] and [L, B, N], the
        padding's margins +inf (causal attention: padding after a sequence cannot change it)."""
        n = max(map(len, seqs))
        ids = torch.tensor([s + [0] * (n - len(s)) for s in seqs])
        valid = torch.arange(n)[None] < torch.tensor([len(s) for s in seqs])[:, None]
        logits: list[torch.Tensor] = []
        hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out: logits.append(out[0].detach()))
                 for layer in self.model.model.layers]
        with torch.no_grad():  # the decoder alone: the LM head's [B, N, 151936] logits are not needed
            self.model.model(ids, attention_mask=valid.long())
        for h in hooks:
            h.remove()
        top = torch.stack(logits).reshape(len(logits), len(seqs), n, -1).topk(self.top_k + 1, dim=-1)
        margin = top.values[..., self.top_k - 1] - top.values[..., self.top_k]
        return top.indices[..., :self.top_k], margin.masked_fill(~valid, torch.inf)

    def __call__(self, text: str) -> list[list[set[int]]]:
        chosen, _ = self.decisions(self.tok.encode(text))
        return [[set(row.tolist()) for row in layer] for layer in chosen]

    def coverage(self, text: str) -> list[int]:
        """Experts reached per layer, counting only decisions made by at least MARGIN (so on any CPU)."""
        return self.scan(self.tok.encode(text))[0]

    def scan(self, ids: list[int]) -> tuple[list[int], float]:
        """Coverage per layer (decisions made by at least MARGIN) and the smallest margin of any decision."""
        return self.batch_scan([ids])[0]

    def batch_scan(self, seqs: list[list[int]]) -> list[tuple[list[int], float]]:
        chosen, margin = self.batch_decisions(seqs)
        sure = (margin >= MARGIN)[..., None].expand_as(chosen)
        return [([len(set(c[m].tolist())) for c, m in zip(chosen[:, b], sure[:, b], strict=True)],
                 float(margin[:, b].min())) for b in range(len(seqs))]

    def every_expert_prompt(self, budget: int = 200, batch: int = 32) -> str:
        """Sentences of CPython's docs appended, in order, while they reach experts not yet reached
        in some layer and make no routing decision by less than MARGIN, until every layer has used
        every expert. Random tiny routers favour a few experts in deep layers, so no fixed sentence
        does this. Deterministic; candidates are scored `batch` at a time (the first that helps is
        taken, as if one by one). Its result holds on any CPU because every decision in it clears
        MARGIN (the caller asserts it again, unbatched)."""
        from qwen2om.datasets import prose_docs

        text = VARIED
        covered, low = self.scan(self.tok.encode(text))
        assert low >= MARGIN, f"VARIED itself has a routing decision made by {low:.2e} < {MARGIN}"
        sentences = [s.strip() for doc in prose_docs() for s in doc.split(". ")]
        i = 0
        while min(covered) < self.experts and i < len(sentences):
            tried = []  # (index, text, ids) of the next candidates that fit the budget
            while len(tried) < batch and i < len(sentences):
                longer = f"{text} {sentences[i]}."
                if len(ids := self.tok.encode(longer)) <= budget:
                    tried.append((i, longer, ids))
                i += 1
            if not tried:
                break
            for (at, longer, _), (more, low) in zip(tried, self.batch_scan([t[2] for t in tried]), strict=True):
                if sum(more) > sum(covered) and low >= MARGIN:
                    text, covered, i = longer, more, at + 1  # the candidates after it are tried again
                    break
        if min(covered) < self.experts:
            raise AssertionError(f"no prompt under {budget} tokens reaches every expert by a margin of "
                                 f"{MARGIN}: {covered}")
        return text


def recipe_with(tmp_path: Path, name: str, edit: dict[str, str | None], base: str = "ort") -> str:
    """The bundled recipe `base` with pipeline lines replaced (by pass name) or dropped (None); it names no
    family, so the checkpoint's is used."""
    import importlib.resources

    text = (importlib.resources.files("qwen2om.recipes") / f"{base}.yaml").read_text()
    lines = []
    for line in text.splitlines():
        step = line.strip().removeprefix("- ").split(":")[0].split()[0] if line.strip().startswith("- ") else None
        if step in edit:
            if edit[step] is not None:
                lines.append(f"  - {edit[step]}")
            continue
        lines.append(line)
    path = tmp_path / f"{name}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def moe_out(tmp_path_factory) -> dict[str, Path]:
    """tiny qwen3/qwen2 MoE as the ORT recipes build them (experts → com.microsoft::MoE), and
    tiny qwen3 MoE in the portable standard-op form (the recipe without the fuse_* passes)."""
    outs = {}
    for name in ("tiny-qwen3-moe", "tiny-qwen2-moe"):
        outs[name] = tmp_path_factory.mktemp("moe") / name
        convert(f"builtin:{name}", outs[name], overrides=SMALL)
    tmp = tmp_path_factory.mktemp("portable")
    outs["portable"] = tmp / "out"
    convert("builtin:tiny-qwen3-moe", outs["portable"], overrides=SMALL,
            recipe=recipe_with(tmp, "portable", {"fuse_moe": None, "fuse_attention": None, "fuse_norm": None}))
    return outs


@functools.cache
def routed(ckpt_dir: Path) -> tuple[Router, str]:
    """The router of a checkpoint and its every-expert prompt, searched once per session."""
    router = Router(ckpt_dir)
    return router, router.every_expert_prompt()


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-qwen2-moe", "portable"])
def test_verify_moe(moe_out, checkpoint, name: str) -> None:
    model = "tiny-qwen3-moe" if name == "portable" else name
    router, every = routed(checkpoint(model))
    assert router.coverage(every) == [router.experts] * len(router.model.model.layers)
    # The crowded case: a repeated token sends most positions to one pair of experts. (Not all of
    # them: attention mixes the first token, "the", into each position by a different weight.)
    crowd = collections.Counter(frozenset(s) for s in router(REPEATED)[0]).most_common(1)[0][1]
    assert crowd >= len(router.tok.encode(REPEATED)) // 2, "a repeated token crowds one expert pair in layer 0"
    for text in (every, REPEATED):  # what verify compares: the prompt and 32 greedy tokens after it
        ids = router.tok.encode(text)
        low = router.scan(ids + reference_greedy(router.model, ids, 32)[0])[1]
        assert low >= MARGIN, f"a routing decision made by {low:.2e}: ONNX Runtime may route it otherwise"
    report = verify(moe_out[name], f"builtin:{model}", tokens=32, prompts=[every, REPEATED])
    assert report.passed and report.max_abs <= 1e-4 and report.agreement == 1.0
    assert all(p.steps == 32 for p in report.prompts) and report.prompts[0].prompt_tokens > 32  # two chunks


def test_moe_graphs_are_static(moe_out) -> None:
    for kind in ("decode", "prefill"):
        model = onnx.load(moe_out["portable"] / f"model.{kind}.onnx", load_external_data=False)
        ops = {n.op_type for n in model.graph.node}
        assert not ops & {"NonZero", "Loop", "If", "Scan"}, kind
        assert "TopK" in ops and all(n.domain in ("", "ai.onnx") for n in model.graph.node)
        stacked = [i for i in model.graph.initializer if i.name.endswith("mlp.experts.gate_up")]
        assert len(stacked) == 4 and list(stacked[0].dims) == [8, 64, 64]  # [E, H, 2I], one per layer


def test_ort_recipe_fuses_experts(moe_out) -> None:
    """Each layer's routed experts become one com.microsoft::MoE reading the router logits, with
    gate/up interleaved [E, 2I, H] and down [E, H, I]; the router itself stays a float MatMul."""
    for kind in ("decode", "prefill"):
        model = onnx.load(moe_out["tiny-qwen3-moe"] / f"model.{kind}.onnx", load_external_data=False)
        moe = [n for n in model.graph.node if n.op_type == "MoE"]
        assert [n.domain for n in moe] == ["com.microsoft"] * 4, kind
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in moe[0].attribute}
        assert attrs["k"] == 2 and attrs["swiglu_fusion"] == 1 and attrs["normalize_routing_weights"] == 1
        assert not {n.op_type for n in model.graph.node} & {"TopK", "GatherND", "NonZero"}
        inits = {i.name: list(i.dims) for i in model.graph.initializer}
        assert inits["model.layers.3.mlp.experts.fc1"] == [8, 64, 64] and inits["model.layers.3.mlp.experts.fc2"] == [
            8, 64, 32]
        assert "model.layers.3.mlp.experts.gate_up" not in inits
        router = next(n for n in model.graph.node if n.name == "/model/layers.3/mlp/gate/MatMul")
        assert moe[3].input[1] == router.output[0]
    manifest = json.loads((moe_out["tiny-qwen2-moe"] / "manifest.json").read_text())
    stats = next(s["stats"] for s in manifest["stages"] if s["pass"] == "fuse_moe")
    assert stats == {"decode_fused_layers": 2, "decode_kept_layers": 0, "prefill_fused_layers": 2,
                     "prefill_kept_layers": 0}  # 2 layers, counted per graph
    model = onnx.load(moe_out["tiny-qwen2-moe"] / "model.prefill.onnx", load_external_data=False)
    moe = next(n for n in model.graph.node if n.op_type == "MoE")
    assert {a.name: a.i for a in moe.attribute}["normalize_routing_weights"] == 0  # qwen2_moe: norm_topk_prob off
    assert any("shared_expert" in n.name for n in model.graph.node)  # the shared expert stays outside


def experts_recipe(tmp_path: Path) -> str:
    """recipes/ort.yaml with quantised experts kept quantised in the graph (off by default)."""
    return recipe_with(tmp_path, "qwen3-experts", {"lower_int4": "lower_int4: {experts: true}",
                                                   "lower_fp8": "lower_fp8: {experts: true}"})


def fused_copy(src: Path, dest: Path) -> Path:
    """The same checkpoint with experts stored 3-D, as transformers 5 holds them in memory."""
    shutil.copytree(src, dest)
    index = json.loads((dest / INDEX).read_text())
    cfg = json.loads((dest / "config.json").read_text())
    n, layers = cfg.get("num_local_experts") or cfg["num_experts"], cfg["num_hidden_layers"]
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(dest / shard)
        for layer in range(layers):
            p = f"model.layers.{layer}.mlp.experts"
            if f"{p}.0.gate_proj.weight" not in tensors:
                continue
            gate_up = [torch.cat((tensors.pop(f"{p}.{e}.gate_proj.weight"), tensors.pop(f"{p}.{e}.up_proj.weight")))
                       for e in range(n)]
            tensors[f"{p}.gate_up_proj"] = torch.stack(gate_up)
            tensors[f"{p}.down_proj"] = torch.stack([tensors.pop(f"{p}.{e}.down_proj.weight") for e in range(n)])
        save_file(tensors, dest / shard, metadata={"format": "pt"})
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard} | {k: shard for k in tensors}
    (dest / INDEX).write_text(json.dumps(index))
    return dest


@pytest.mark.slow
def test_fused_expert_layout(checkpoint, tmp_path: Path) -> None:
    src = fused_copy(checkpoint("tiny-qwen3-moe"), tmp_path / "fused")
    ckpt = Checkpoint(src)
    assert ckpt.fused_experts and "model.layers.0.mlp.experts.gate_up_proj" in ckpt.names()
    out = tmp_path / "out"
    convert(src, out, overrides=SMALL)
    report = verify(out, "builtin:tiny-qwen3-moe", tokens=16, prompts=[VARIED])  # reference: per-expert layout
    assert report.passed and report.max_abs <= 1e-4


# -- bad input ------------------------------------------------------------------------------------

@pytest.fixture
def moe_ckpt(checkpoint, tmp_path: Path) -> Path:
    dest = tmp_path / "ckpt"
    shutil.copytree(checkpoint("tiny-qwen3-moe"), dest)
    return dest


def test_top_k_above_experts(cli, moe_ckpt: Path, tmp_path: Path) -> None:
    cfg = json.loads((moe_ckpt / "config.json").read_text())
    cfg["num_experts_per_tok"] = 9
    (moe_ckpt / "config.json").write_text(json.dumps(cfg))
    convert_fails(cli, moe_ckpt, tmp_path, "num_experts_per_tok=9", "num_experts=8")


def test_missing_expert(cli, moe_ckpt: Path, tmp_path: Path) -> None:
    edit_tensor(moe_ckpt, "model.layers.2.mlp.experts.5.up_proj.weight", lambda t: None, unindex=True)
    convert_fails(cli, moe_ckpt, tmp_path, "model.layers.2.mlp.experts.5.up_proj.weight", "missing")


def test_inconsistent_expert_shape(cli, moe_ckpt: Path, tmp_path: Path) -> None:
    edit_tensor(moe_ckpt, "model.layers.1.mlp.experts.3.down_proj.weight", lambda t: t[:, :16].contiguous())
    convert_fails(cli, moe_ckpt, tmp_path, "model.layers.1.mlp.experts.3.down_proj.weight", "[64, 16]", "[64, 32]")


def test_router_nan(cli, moe_ckpt: Path, tmp_path: Path) -> None:
    def poison(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[4, 7] = float("nan")
        return t

    edit_tensor(moe_ckpt, "model.layers.0.mlp.gate.weight", poison)
    convert_fails(cli, moe_ckpt, tmp_path, "model.layers.0.mlp.gate.weight", "non-finite")


@pytest.mark.slow
def test_fp8_moe_fixture_converts_and_verifies(checkpoint, tmp_path: Path) -> None:
    """The FP8 fixture generator's MoE layout (Qwen3-30B-A3B-FP8's): every expert its own e4m3fn
    weight and scale grid, routers float and listed in modules_to_not_convert."""
    src = checkpoint("tiny-qwen3-moe-fp8")
    ckpt = Checkpoint(src)
    qc = ckpt.config["quantization_config"]
    assert qc["modules_to_not_convert"][:2] == ["lm_head", "model.layers.0.mlp.gate"]
    assert "model.layers.3.mlp.experts.7.down_proj.weight" in ckpt.quantized
    assert "model.layers.0.mlp.gate.weight" not in ckpt.quantized
    assert ckpt.info("model.layers.0.mlp.gate.weight").dtype == torch.bfloat16
    out = tmp_path / "out"
    convert(src, out, overrides=SMALL)  # default: experts dequantised at conversion
    report = verify(out, src, tokens=32, prompts=[VARIED])
    assert report.passed and report.max_abs <= 1e-4 and report.agreement == 1.0
    out = tmp_path / "out-experts"
    convert(src, out, recipe=experts_recipe(tmp_path), overrides=SMALL)
    report = verify(out, src, tokens=32, prompts=[VARIED])
    assert report.passed and report.max_abs <= 1e-4 and report.agreement == 1.0
    # `lower_fp8: {experts: true}`: experts stay FP8 in the graph, one stacked scale input per layer
    # and projection.
    scale_map = json.loads((out / "scale_map.json").read_text())
    stacked = {k: v for k, v in scale_map.items() if v.get("stacked")}
    assert len(scale_map) == 4 * 4 + 4 * 3 and len(stacked) == 4 * 3
    e = stacked["model.layers.2.mlp.experts.gate_proj.weight.scale"]
    assert (e["shape"], e["experts"], e["layer"], e["source"]) == (
        [8, 1, 1], 8, 2, "model.layers.2.mlp.experts.*.gate_proj.weight_scale_inv")
    values = load_file(out / "scales.safetensors")["model.layers.2.mlp.experts.gate_proj.weight.scale"]
    want = torch.stack([ckpt.raw(f"model.layers.2.mlp.experts.{x}.gate_proj.weight_scale_inv").float()
                        for x in range(8)])
    assert torch.equal(values, want)
    decode = onnx.load(out / "model.decode.onnx", load_external_data=False)
    stack = "model.layers.0.mlp.experts.gate_up.weight_fp8"
    assert {i.name: i.data_type for i in decode.graph.initializer}[stack] == onnx.TensorProto.UINT8
    users = [n.op_type for n in decode.graph.node if stack in n.input]
    assert users == ["GatherND"]  # decode gathers the k routed experts' bytes, then dequantises only them


# -- quantised experts ----------------------------------------------------------------------------

CAL = ["--dataset", "builtin:prose", "--num-samples", "16", "--seq-len", "128", "--group-size", "32"]


@pytest.mark.slow
def test_gptq_moe_quantises_every_expert(cli, tmp_path: Path) -> None:
    ckpt_dir, out = tmp_path / "w4", tmp_path / "out"
    code, _, err = cli("calibrate", "builtin:tiny-qwen3-moe", "-o", ckpt_dir, *CAL)
    assert code == 0, err
    ckpt = Checkpoint(ckpt_dir)
    assert len(ckpt.quantized) == 4 * (4 + 8 * 3)  # q/k/v/o and each expert's gate/up/down, per layer
    assert not [n for n in ckpt.quantized if n.endswith("mlp.gate.weight")]  # routers stay float
    report = json.loads((ckpt_dir / "calibration_report.json").read_text())
    for layer in report["layers"]:
        assert sum(layer["experts"]["tokens"]) == 2 * layer["experts"]["total"]  # top-2
        assert layer["experts"]["rtn_experts"] == []
    convert(ckpt_dir, out, recipe=experts_recipe(tmp_path), overrides=SMALL)
    report = verify(out, ckpt_dir, tokens=16, prompts=[VARIED])
    assert report.passed and report.max_abs <= 1e-4
    # `lower_int4: {experts: true}`: experts stay int4 in the graph, packed bytes per layer, gathered
    # before unpacking in decode.
    decode = onnx.load(out / "model.decode.onnx", load_external_data=False)
    stack = "model.layers.1.mlp.experts.gate_up.weight_int4"
    init = {i.name: i for i in decode.graph.initializer}[stack]
    assert init.data_type == onnx.TensorProto.UINT8 and list(init.dims) == [8, 64, 32]  # [E, 2I, H/2]
    assert [n.op_type for n in decode.graph.node if stack in n.input] == ["GatherND"]
    stages = json.loads((out / "manifest.json").read_text())["stages"]
    stats = next(s["stats"] for s in stages if s["pass"] == "fuse_moe")
    assert stats == {"decode_fused_layers": 0, "decode_kept_layers": 4, "prefill_fused_layers": 0,
                     "prefill_kept_layers": 4}  # int4 stacks: left in the portable form
    # The default ORT recipe: each layer's int4 experts in one com.microsoft::QMoE, the checkpoint's
    # bytes as stored (gate/up rows interleaved), exact against the dequantised weights.
    out_q = tmp_path / "out-qmoe"
    convert(ckpt_dir, out_q, overrides=SMALL)
    report = verify(out_q, ckpt_dir, tokens=16, prompts=[VARIED])
    assert report.passed and report.max_abs <= 1e-4
    prefill = onnx.load(out_q / "model.prefill.onnx", load_external_data=False)
    qmoe = [n for n in prefill.graph.node if n.op_type == "QMoE"]
    assert len(qmoe) == 4 and {a.name: onnx.helper.get_attribute_value(a) for a in qmoe[0].attribute}[
        "block_size"] == 32
    inits = {i.name: (i.data_type, list(i.dims)) for i in prefill.graph.initializer}
    assert inits["model.layers.0.mlp.experts.fc1_int4"] == (onnx.TensorProto.UINT8, [8, 64, 32])  # [E, 2I, H/2]
    assert inits["model.layers.0.mlp.experts.fc2_scales"] == (onnx.TensorProto.FLOAT, [8, 64, 1])  # [E, H, I/g]
    code, stdout, err = cli("eval", "agree", out, "--reference", "builtin:tiny-qwen3-moe", "--max-windows", "2",
                            "--json")
    assert code == 0, err
    agree = json.loads(stdout)
    assert 0 < agree["mean_kl"] < 1 and 0 < agree["top1_agreement"] <= 1
    # With scales as inputs: one stacked input per layer and projection.
    out_in = tmp_path / "out-inputs"
    convert(ckpt_dir, out_in, recipe=experts_recipe(tmp_path), overrides=[*SMALL, "scales=inputs"])
    scale_map = json.loads((out_in / "scale_map.json").read_text())
    stacked = [v for v in scale_map.values() if v.get("stacked")]
    assert len(scale_map) == 4 * 4 + 4 * 3 and len(stacked) == 4 * 3
    assert all(v["shape"][0] == 8 and v["scheme"] == "int4" for v in stacked)
    assert verify(out_in, ckpt_dir, tokens=8, prompts=[VARIED]).passed


def stored(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    return {k: v for shard in sorted(ckpt_dir.glob("*.safetensors")) for k, v in load_file(shard).items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-qwen3-5-moe"])
def test_fused_experts_are_calibrated_per_expert(cli, checkpoint, name: str, tmp_path: Path) -> None:
    """Experts stored fused 3-D (the published Qwen3.5 MoE layout) are quantised expert by expert:
    RTN writes exactly what it writes for the per-expert original (no fused float stack left), and
    the default ORT recipe runs them int4 in QMoE, exact against the dequantised weights."""
    src = fused_copy(checkpoint(name), tmp_path / "fused")
    assert Checkpoint(src).fused_experts
    rtn = ["--method", "rtn", "--group-size", "16"]  # 16: the shared expert of tiny-qwen3-5-moe is 48 wide
    for ckpt, w4 in ((src, tmp_path / "w4-fused"), (f"builtin:{name}", tmp_path / "w4-per-expert")):
        code, _, err = cli("calibrate", ckpt, "-o", w4, *rtn)
        assert code == 0, err
    fused, per_expert = stored(tmp_path / "w4-fused"), stored(tmp_path / "w4-per-expert")
    assert sorted(fused) == sorted(per_expert) and all(torch.equal(fused[k], per_expert[k]) for k in fused)
    ckpt = Checkpoint(tmp_path / "w4-fused")
    assert not ckpt.fused_experts
    assert len([n for n in ckpt.quantized if ".mlp.experts." in n]) == 4 * 8 * 3  # every expert of 4 layers
    out = tmp_path / "out"
    convert(tmp_path / "w4-fused", out, overrides=SMALL)
    prefill = onnx.load(out / "model.prefill.onnx", load_external_data=False)
    assert len([n for n in prefill.graph.node if n.op_type == "QMoE"]) == 4
    report = verify(out, tmp_path / "w4-fused", tokens=16, prompts=[VARIED])
    assert report.passed and report.max_abs <= 1e-4


@pytest.mark.numerics
def test_fused_experts_gptq_equals_per_expert(cli, checkpoint, tmp_path: Path) -> None:
    """GPTQ reads the fused stacks' experts from the layer it runs: same bytes as from the per-expert original."""
    src = fused_copy(checkpoint("tiny-qwen3-moe"), tmp_path / "fused")
    for ckpt, w4 in ((src, tmp_path / "w4-fused"), ("builtin:tiny-qwen3-moe", tmp_path / "w4-per-expert")):
        code, _, err = cli("calibrate", ckpt, "-o", w4, *CAL)
        assert code == 0, err
    fused, per_expert = stored(tmp_path / "w4-fused"), stored(tmp_path / "w4-per-expert")
    assert sorted(fused) == sorted(per_expert) and all(torch.equal(fused[k], per_expert[k]) for k in fused)
    assert len([k for k in fused if k.endswith(".weight_packed") and ".experts." in k]) == 4 * 8 * 3


@pytest.mark.slow
def test_skewed_routing_falls_back_to_rtn(cli, tmp_path: Path) -> None:
    """Starved experts see no calibration token: RTN for them, named in the report and on screen."""
    ckpt_dir = tmp_path / "w4"
    code, stdout, err = cli("calibrate", "builtin:tiny-qwen3-moe-skewed", "-o", ckpt_dir, *CAL)
    assert code == 0, err
    assert "quantised by RTN: layer 0: 6, 7; layer 1: 6, 7" in " ".join(stdout.split())
    report = json.loads((ckpt_dir / "calibration_report.json").read_text())
    for layer in report["layers"]:
        assert layer["experts"]["tokens"][6:] == [0, 0] and layer["experts"]["rtn_experts"] == [6, 7]
    fell = {r["name"]: r for layer in report["layers"] for r in layer["linears"] if r["method"] == "rtn"}
    assert len(fell) == 2 * 2 * 3
    assert "received 0 of 2048" in fell["model.layers.1.mlp.experts.7.up_proj.weight"]["note"]
    assert len(Checkpoint(ckpt_dir).quantized) == 2 * (4 + 8 * 3)
    out = tmp_path / "out"
    convert(ckpt_dir, out, overrides=SMALL)
    assert verify(out, ckpt_dir, tokens=8, prompts=[VARIED]).passed


@pytest.mark.slow
def test_fp8_block_moe(cli, tmp_path: Path) -> None:
    ckpt_dir, out = tmp_path / "fp8", tmp_path / "out"
    code, _, err = cli("calibrate", "builtin:tiny-qwen3-moe", "-o", ckpt_dir, "--scheme", "fp8-block")
    assert code == 0, err
    ckpt = Checkpoint(ckpt_dir)
    assert len(ckpt.quantized) == 4 * (4 + 8 * 3) and "model.layers.0.mlp.gate.weight" not in ckpt.quantized
    # the routers listed as Qwen3-30B-A3B-FP8's own config lists them (loaders make unlisted linears FP8)
    assert ckpt.config["quantization_config"]["modules_to_not_convert"] == [
        "lm_head", *(f"model.layers.{i}.mlp.gate" for i in range(4))]
    convert(ckpt_dir, out, overrides=SMALL)
    assert verify(out, ckpt_dir, tokens=16, prompts=[VARIED]).passed
    code, stdout, err = cli("eval", "agree", out, "--reference", "builtin:tiny-qwen3-moe", "--max-windows", "2",
                            "--json")
    assert code == 0 and json.loads(stdout)["mean_kl"] < 0.05, err


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-qwen3-5-moe"])
def test_fp8_block_fused_experts_are_written_per_expert(cli, checkpoint, name: str, tmp_path: Path) -> None:
    """`--scheme fp8-block` on experts stored fused 3-D writes exactly what it writes for the per-expert
    original (before, the fused stacks were copied float and config.json did not say so)."""
    src = fused_copy(checkpoint(name), tmp_path / "fused")
    for ckpt, fp8 in ((src, tmp_path / "fp8-fused"), (f"builtin:{name}", tmp_path / "fp8-per-expert")):
        code, _, err = cli("calibrate", ckpt, "-o", fp8, "--scheme", "fp8-block")
        assert code == 0, err
    fused, per_expert = stored(tmp_path / "fp8-fused"), stored(tmp_path / "fp8-per-expert")
    assert sorted(fused) == sorted(per_expert) and all(torch.equal(fused[k], per_expert[k]) for k in fused)
    experts = [k for k, v in fused.items() if ".mlp.experts." in k and v.dtype == torch.float8_e4m3fn]
    assert len(experts) == 4 * 8 * 3  # every expert's gate, up and down of 4 layers
    ckpt = Checkpoint(tmp_path / "fp8-fused")
    assert not ckpt.fused_experts
    left = ckpt.config["quantization_config"]["modules_to_not_convert"]  # the routers, no expert stack
    assert left == Checkpoint(tmp_path / "fp8-per-expert").config["quantization_config"]["modules_to_not_convert"]
    assert "model.layers.0.mlp.gate" in left and not any(".experts" in m for m in left)
    out = tmp_path / "out"
    convert(tmp_path / "fp8-fused", out, overrides=SMALL)
    assert verify(out, tmp_path / "fp8-fused", tokens=8, prompts=[VARIED]).passed


def test_moe_layers_are_cloned_from_the_template(moe_out) -> None:
    """Export traces two layers and clones the rest, as for dense models (4-layer tiny-qwen3-moe)."""
    manifest = json.loads((moe_out["tiny-qwen3-moe"] / "manifest.json").read_text())
    stats = next(s["stats"] for s in manifest["stages"] if s["pass"] == "export_onnx")
    assert stats["decode_layers_traced"] == 2 and stats["prefill_layers_traced"] == 2


# sha256 over the bf16 weights (sorted names, raw bytes) as built on a 2-core AMD EPYC (AVX-512) and,
# identically, under ATEN_CPU_CAPABILITY=default/avx2 with MKL_CBWR=COMPATIBLE and one thread.
BUILT = {"tiny-qwen3": "68d0b451160223a01a3212ed589e78cbb7d2a915c92c5304addca4f2c9a468d9",
         "tiny-qwen3-moe": "bf17549601ad298c0959999c472275053e06e1087e255bf803dd3a4a0ed9c7f0",
         "tiny-qwen2-moe": "9d83ddceb832f8779e34f05c32b32d53f6840b4d4aed45d564e9243af0ef3db0"}


@pytest.mark.numerics
@pytest.mark.parametrize("name", sorted(BUILT))
def test_builtin_weights_are_the_same_bytes_on_every_cpu(name: str) -> None:
    """The fixtures are built in float64 with canonical SVD/QR signs (fixtures/tiny.py): under other
    kernels the MoE routers used to come out wholly different (an SVD sign flip), and with them which
    prompt reaches every expert. A fixture change must update these hashes, on purpose."""
    import hashlib

    from qwen2om.fixtures.tiny import TINY, build_tiny_model

    state = build_tiny_model(TINY[name]).to(torch.bfloat16).state_dict()
    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(key.encode())
        digest.update(state[key].contiguous().view(torch.uint8).numpy().tobytes())
    assert digest.hexdigest() == BUILT[name]
