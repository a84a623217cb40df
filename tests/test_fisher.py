"""`calibrate --hessian fisher | fisher-heads` (qwen2om/quant/fisher.py): GPTQ's Hessians weighted per
token by the calibration loss's squared gradient at each linear's output.

The oracle for the weights is transformers: its own Qwen model, the whole of it in one autograd graph,
the same summed next-token loss backward, the gradient read at every nn.Linear's output. qwen2om gets
them one layer at a time from saved inputs (a forward pass, the head, then backward layer by layer).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

from qwen2om.builtin import resolve_model
from qwen2om.checkpoint import Checkpoint
from qwen2om.families import family_of
from qwen2om.layerwise import LayerTensors
from qwen2om.quant import fisher
from qwen2om.quant.calibrate import calibrate
from qwen2om.quant.config import CalibrationConfig
from qwen2om.quant.fisher import HEAD_KEY, columns, weighted_gram
from qwen2om.quant.int4 import Int4Spec
from qwen2om.quant.schemes import CalibrationError
from qwen2om.quant.shard import Job, Settings, ShardWorker, solve

MODELS = ["builtin:tiny-qwen3", "builtin:tiny-qwen2"]


def worker_weights(path: Path, samples: np.ndarray, hessian: str) -> dict[str, torch.Tensor]:
    """qwen2om's token weights for every linear of every layer, one chunk per sample: [samples·T, cols]."""
    ckpt = Checkpoint(path)
    family = family_of(ckpt.arch)
    settings = Settings(Int4Spec(32, True), False, 0.01, True, (1.0,), "float32", "cpu", 1, 1 << 30,
                        hessian=hessian)
    worker = ShardWorker(dataclasses.replace(LayerTensors.header(ckpt)), settings)
    unique = np.unique(samples)
    rows = torch.cat([ckpt.get(family.names.embed, rows=(int(t), int(t) + 1)) for t in unique])
    worker.embed(len(samples), {c: ([c], samples[c:c + 1]) for c in range(len(samples))}, unique, rows)

    def tensors(prefix: str) -> list[dict[str, torch.Tensor]]:
        return [{n: ckpt.get(n) for n in ckpt.names() if n.startswith(prefix)}]
    layers = ckpt.dims.layers
    for i in range(layers):
        worker.fisher_forward(i, tensors(f"{family.names.layer(i)}."))
    head = tensors(family.names.final_norm)
    head[0][HEAD_KEY] = ckpt.get("lm_head.weight" if "lm_head.weight" in ckpt.names() else family.names.embed)
    worker.fisher_head(head)
    out: dict[str, torch.Tensor] = {}
    for i in reversed(range(layers)):
        prefix = f"{family.names.layer(i)}."
        names = [n for n in ckpt.names() if n.startswith(prefix) and n.endswith("_proj.weight")]
        cols = {n: columns(n, ckpt.shape(n)[0], ckpt.dims, hessian, family.names) for n in names}
        per_chunk = worker.fisher_backward(i, tensors(prefix), cols)
        out |= {n: torch.cat([per_chunk[c][n] for c in range(len(samples))]) for n in names}
    assert all(worker.level[c] == 0 for c in range(len(samples))), "the chunks are back at layer 0"
    worker.close()
    ckpt.close()
    return out


def transformers_weights(path: Path, samples: np.ndarray, hessian: str) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ckpt = Checkpoint(path)
    dims, names = ckpt.dims, family_of(ckpt.arch).names
    grads: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and ".layers." in name:
            key = f"{name}.weight"

            def on_output(_m, _a, out, key=key):
                out.register_hook(lambda g, key=key: grads.setdefault(key, []).append(g[0].detach()))
            handles.append(m.register_forward_hook(on_output))
    for ids in samples:
        t = torch.from_numpy(ids[None].astype(np.int64))
        logits = model(input_ids=t, use_cache=False).logits[0, :-1]
        torch.nn.functional.cross_entropy(logits, t[0, 1:], reduction="sum").backward()
    for h in handles:
        h.remove()
    out = {}
    for key, gs in grads.items():
        g = torch.cat(gs)  # one entry per sample, in order
        k = columns(key, g.shape[1], dims, hessian, names)
        out[key] = (g * g).reshape(g.shape[0], k, -1).sum(2)
    return out


@pytest.mark.parametrize("model", MODELS)
def test_token_weights_are_transformers_squared_output_gradients(model: str, monkeypatch) -> None:
    monkeypatch.setattr(fisher, "LOGIT_TOKENS", 5)  # the head's gradient in blocks of positions, as on a long window
    monkeypatch.setattr(fisher, "HEAD_ROWS", 700)  # and of vocabulary rows, as for a large vocabulary
    path = resolve_model(model)
    vocab = Checkpoint(path).dims.vocab
    samples = np.random.default_rng(0).integers(0, vocab, size=(3, 24))
    ours = worker_weights(path, samples, "fisher-heads")
    theirs = transformers_weights(path, samples, "fisher-heads")
    assert set(ours) == set(theirs) and len(ours) >= 7
    assert any(w.shape[1] > 1 for w in ours.values()), "q/k/v get one column per head"
    for name, w in theirs.items():
        assert ours[name].shape == w.shape, name
        # Both float32; attention through PyTorch's fused kernel here, transformers' eager/sdpa there.
        torch.testing.assert_close(ours[name], w, rtol=2e-3, atol=2e-3 * float(w.max()), msg=name)
        assert float(w.max()) > 0


def test_weighted_gram_is_the_sum_of_weighted_outer_products() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(50, 8, generator=g), torch.rand(50, 3, generator=g)
    h = weighted_gram(x, w)
    assert h.shape == (3, 8, 8)
    for j in range(3):
        torch.testing.assert_close(h[j], sum(w[t, j] * torch.outer(x[t], x[t]) for t in range(50)), rtol=1e-4,
                                   atol=1e-4)
    torch.testing.assert_close(weighted_gram(x, w[:, :1]), h[0])


def test_per_head_solve_is_each_heads_gptq() -> None:
    """A [heads, K, K] Hessian: each head's rows are solved against their own, as separate weights."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 64, generator=g)
    xs = [torch.randn(200, 64, generator=g) * torch.linspace(0.2, 2, 64) for _ in range(2)]
    h = torch.stack([2 * x.T @ x / 200 for x in xs])
    s = Settings(Int4Spec(32, True), False, 0.01, True, (1.0,), "float32", "cpu", 1, 1 << 30)
    both = solve(Job("w", w, h, torch.bfloat16), s, torch.device("cpu"))
    parts = [solve(Job("w", w[i * 4:(i + 1) * 4], h[i], torch.bfloat16), s, torch.device("cpu")) for i in range(2)]
    assert torch.equal(both.q, torch.cat([p.q for p in parts]))
    assert torch.equal(both.scale, torch.cat([p.scale for p in parts]))
    assert both.error is not None and both.rtn_error is not None and both.error < both.rtn_error


def test_hessian_setting_is_checked() -> None:
    with pytest.raises(CalibrationError, match="--hessian 'guided' is not one of plain, fisher, fisher-heads"):
        CalibrationConfig(hessian="guided")
    for method in ("awq", "rtn"):
        with pytest.raises(CalibrationError, match="does not run GPTQ"):
            CalibrationConfig(method=method, hessian="fisher")


@pytest.mark.parametrize("hessian", ["fisher", "fisher-heads"])
def test_fisher_calibration_writes_another_checkpoint_and_records_it(hessian: str, tmp_path: Path) -> None:
    """End to end through the driver: the weights reach every layer's Hessians (the codes move off plain
    GPTQ's), each layer's error is still below RTN's, and the checkpoint says how it was made."""
    common = dict(method="gptq", group_size=32, num_samples=6, seq_len=48, dataset="builtin:prose")
    outs = {}
    for h in ("plain", hessian):
        outs[h] = tmp_path / h
        report = calibrate("builtin:tiny-qwen3", outs[h], CalibrationConfig(hessian=h, **common)).report
        linears = [r for layer in report["layers"] for r in layer["linears"]]
        assert linears and all(r["error"] < r["rtn_error"] for r in linears), h
    config = json.loads((outs[hessian] / "config.json").read_text())
    assert config["quantization_config"]["qwen2om"]["hessian"] == hessian
    report = json.loads((outs[hessian] / "calibration_report.json").read_text())
    assert report["hessian"] == hessian and 0 < report["hessian_pass_seconds"] < report["seconds"]
    plain, weighted = ({k: v for f in sorted(o.glob("*.safetensors")) for k, v in load_file(f).items()}
                       for o in (outs["plain"], outs[hessian]))
    moved = [n for n in plain if n.endswith("weight_packed") and not torch.equal(plain[n], weighted[n])]
    assert any(".layers.0." in n for n in moved) and any(".layers.1." in n for n in moved), moved


@pytest.mark.parametrize("model,group", [("builtin:tiny-qwen3-moe", 32), ("builtin:tiny-qwen3-next", 16)])
def test_fisher_heads_calibrates_moe_and_hybrid_models(model: str, group: int, tmp_path: Path) -> None:
    """The backward pass runs through routed experts and linear attention too (experts keep the plain H;
    the hybrid's gated q_proj, twice the heads' width, keeps one weight per token)."""
    cfg = CalibrationConfig(method="gptq", hessian="fisher-heads", group_size=group, num_samples=4, seq_len=32,
                            dataset="builtin:prose")
    report = calibrate(model, tmp_path / "q", cfg).report
    linears = [r for layer in report["layers"] for r in layer["linears"]]
    assert report["hessian"] == "fisher-heads"
    # An expert that no calibration token reached falls back to RTN, as with the plain H; nothing else does.
    assert not [n for n in report["fell_back_to_rtn"] if ".experts." not in n]
    assert linears and all(r["error"] <= r["rtn_error"] for r in linears if r["error"] is not None)
