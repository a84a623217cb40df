"""Layer-by-layer execution (the shape calibration uses): same hidden states as transformers,
whether the activations stay in memory or spill to disk."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qwen2om.checkpoint import Checkpoint
from qwen2om.layerwise import ActivationStore, LayerRunner


@pytest.mark.parametrize("budget", [1 << 30, 0], ids=["in-memory", "spilled"])
def test_layer_by_layer_matches_transformers_hidden_states(checkpoint, tmp_path, budget: int) -> None:
    import transformers

    src = checkpoint("tiny-qwen3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    samples = [[9707, 11, 1879, 0, 77, 5], [151644, 872, 198, 3838, 374, 279, 6722, 30, 151645]]
    runner = LayerRunner(Checkpoint(src), budget=budget, spill_dir=tmp_path)
    seen: list[tuple[int, int]] = []
    store = runner.run(samples, hook=lambda index, layer, x: seen.append((index, x.sample)))
    assert store.spilled == (len(samples) if budget == 0 else 0)
    assert seen == [(layer, s) for layer in range(4) for s in range(2)]
    final = runner.final_norm(store)
    for i, ids in enumerate(samples):
        with torch.no_grad():
            ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1]  # after the final norm
        torch.testing.assert_close(final[i], ref, rtol=1e-5, atol=1e-5)
    store.close()
    assert list(tmp_path.iterdir()) == []  # spill files are removed


def test_store_keeps_what_fits_and_spills_the_rest(tmp_path) -> None:
    store = ActivationStore(budget=1000, spill_dir=tmp_path)
    a, b = np.ones((10, 10), np.float32), np.full((10, 10), 2, np.float32)  # 400 bytes each
    store.put(0, a)
    store.put(1, b)
    store.put(2, a * 3)
    assert store.spilled == 1 and store.used == 800
    assert [float(store.get(i)[0, 0]) for i in store] == [1.0, 2.0, 3.0]
    store.drop(0)
    assert len(store) == 2 and store.used == 400
    store.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3-5"])
def test_awq_scaling_leaves_each_layer_unchanged(checkpoint, model: str) -> None:
    """AWQ divides a producer's output channels by s and multiplies its consumers' inputs by s: before
    quantisation the layer computes the same function. Qwen3.5's norms scale by (1 + w), so dividing w
    by s (as for a plain RMSNorm) changed every scaled layer."""
    from qwen2om.quant.calibrate import shrink_outputs

    runner = LayerRunner(Checkpoint(checkpoint(model)))
    gen = torch.Generator().manual_seed(0)
    scaled = 0
    for index in range(runner.d.layers):
        layer = runner.layer(index)
        modules = dict(layer.named_modules())
        x = torch.randn(1, 7, runner.d.hidden, generator=gen)
        with torch.no_grad():
            before = runner.forward(layer, x)
            for producer, consumers in runner.family.awq_groups:
                if producer not in modules or not all(c in modules for c in consumers):
                    continue
                prev = modules[producer]
                width = modules[consumers[0]].weight.shape[0]  # consumers stored [in, out]
                if (prev.weight.shape[-1] if producer.endswith("proj") else prev.weight.shape[0]) != width:
                    continue
                s = 0.5 + torch.rand(width, generator=gen)
                shrink_outputs(prev, s)
                for c in consumers:
                    modules[c].weight.data *= s[:, None]
                scaled += 1
            after = runner.forward(layer, x)
        torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)
    assert scaled >= runner.d.layers  # at least the MLP's norm → gate/up in every layer
