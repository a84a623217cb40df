"""Loss-weighted GPTQ Hessians: `calibrate --hessian fisher | fisher-heads`.

Plain GPTQ minimises each linear's output error with every calibration token counting alike,
H = Σ_t 2·x_t x_tᵀ. The model's loss does not weigh tokens alike. Weighting each token by the
squared gradient of the calibration text's next-token loss at the linear's output,

    H = Σ_t ‖g_t‖² · 2·x_t x_tᵀ,          g_t = ∂ loss / ∂ (the linear's output at token t),

makes GPTQ minimise an estimate of the loss increase instead (an empirical Fisher approximation,
diagonal over tokens, as GuidedQuant's). With `fisher-heads`, q/k/v_proj get one such Hessian per
attention head (‖g‖² over the head's outputs only) and each head's rows are quantised against their
own: GPTQ's rows are independent given H, so a block of rows may have its own. On the three trained
builtins the end-to-end KL against the float model falls by 7–12 % with `fisher-heads` and 2–10 % with
`fisher` (docs/benchmarks.md), for ~3× the calibration time.

The weights come from one extra pass before the calibration, over the same samples, on the float
model, kept to calibrate's one-layer-at-a-time contract (qwen2om/quant/shard.py runs it):
forward through every layer, saving each layer's input (to disk, in the spill directory: layers ×
tokens × hidden floats, which memory would otherwise hold for a whole model's depth); at the end the
final norm and the LM head give the loss's gradient at the last hidden state; then backward, layer by
layer from the last, each rebuilt from its float weights and its saved input, handing the gradient at
its input to the layer before and keeping only the per-token weights (tokens × columns floats, a column
per linear or per head). The calibration proper then runs as usual, each layer's Hessians weighted by
those.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from qwen2om.arch import ModelDims
from qwen2om.families import TensorNames
from qwen2om.quant.gptq import gram

PLAIN = "plain"
HESSIANS = (PLAIN, "fisher", "fisher-heads")
HEAD_KEY = "__lm_head__"  # the LM head's weight in the tensors sent for the loss (the embedding's when tied)


def columns(name: str, width: int, dims: ModelDims, hessian: str, names: TensorNames) -> int:
    """How many token weights a linear gets: one per head for q/k/v_proj under `fisher-heads` (when its
    output is exactly the heads: the hybrids' gated q_proj is twice as wide and keeps one), else one."""
    if hessian != "fisher-heads":
        return 1
    heads = names.head_count(name, dims)
    return heads if heads and width == heads * dims.head_dim else 1


def token_weights(g: torch.Tensor, cols: int) -> torch.Tensor:
    """‖g_t‖² per token [N, cols] of a linear's output gradient [N, out] (per block of out/cols columns)."""
    g = g.float()
    return (g * g).reshape(g.shape[0], cols, -1).sum(2)


def weighted_gram(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Σ_t w_t x_t x_tᵀ of x [N, K] for weights w [N, cols]: [K, K], or [cols, K, K] per head."""
    if w.shape[1] == 1:
        return gram(x * w.sqrt())
    out = torch.empty(w.shape[1], x.shape[1], x.shape[1], dtype=x.dtype, device=x.device)
    for j in range(w.shape[1]):
        out[j] = gram(x * w[:, j].sqrt()[:, None])
    return out


LOGIT_TOKENS = 64  # positions whose logits are held at once: 64 × a 152k vocabulary is 39 MB in float32
HEAD_ROWS = 16384  # vocabulary rows of the head cast to the compute dtype at once (64 MB at hidden 1024)


def loss_gradient(h: torch.Tensor, tokens: np.ndarray, norm: torch.nn.Module, head: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """∂(summed next-token NLL)/∂h for the last hidden states h [B, T, H] of token ids [B, T] (the final
    norm, then the head [V, H] as stored). Each position's loss depends on its own hidden state only, so
    the gradient is taken LOGIT_TOKENS positions at a time; the last position predicts nothing (gradient
    0). The logits' gradient is written out, softmax − one-hot, so that the head is only ever cast
    HEAD_ROWS rows at a time (autograd would keep a compute-dtype copy of the whole head for backward)."""
    out = torch.zeros_like(h, dtype=torch.float32)
    t, vocab = h.shape[1], head.shape[0]
    blocks = [(v, min(v + HEAD_ROWS, vocab)) for v in range(0, vocab, HEAD_ROWS)]
    for b in range(h.shape[0]):
        target = torch.from_numpy(np.asarray(tokens[b, 1:], dtype=np.int64)).to(head.device)
        for i in range(0, t - 1, LOGIT_TOKENS):
            j = min(i + LOGIT_TOKENS, t - 1)
            x = h[b, i:j].detach().to(head.device, dtype).requires_grad_(True)
            with torch.enable_grad():
                z = norm(x)
            with torch.no_grad():
                logits = torch.cat([(z @ head[v0:v1].to(dtype).T).float() for v0, v1 in blocks], 1)
                g_logits = torch.softmax(logits, 1)
                del logits
                g_logits[torch.arange(j - i), target[i:j]] -= 1
                g_z = sum(g_logits[:, v0:v1].to(dtype) @ head[v0:v1].to(dtype) for v0, v1 in blocks)
            z.backward(g_z)
            assert x.grad is not None
            out[b, i:j] = x.grad.float().cpu()
    return out


def layer_backward(forward: Callable[[torch.Tensor], torch.Tensor], layer: torch.nn.Module, x: torch.Tensor,
                   grad: torch.Tensor, linears: dict[str, torch.nn.Module], cols: dict[str, int],
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The gradient at the layer's input x [B, T, H] given the one at its output, and each linear's token
    weights [B·T, cols] (`forward` runs the layer on x as calibration does)."""
    for p in layer.parameters():
        p.requires_grad_(False)  # only the activations' gradients are wanted
    weights: dict[str, torch.Tensor] = {}

    def hook(name: str) -> Callable[..., None]:
        def on_output(_m: torch.nn.Module, _args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            def on_grad(g: torch.Tensor) -> None:
                weights[name] = token_weights(g.reshape(-1, g.shape[-1]), cols[name]).cpu()
            out.register_hook(on_grad)
        return on_output

    handles = [m.register_forward_hook(hook(n)) for n, m in linears.items()]
    x = x.detach().requires_grad_(True)
    try:
        with torch.enable_grad():
            y = forward(x)
            y.backward(grad.to(y.device, y.dtype))
    finally:
        for h in handles:
            h.remove()
    if missing := [n for n in linears if n not in weights]:
        raise RuntimeError(f"no loss gradient reached {missing[:3]}")
    assert x.grad is not None
    return x.grad.float().cpu(), weights
