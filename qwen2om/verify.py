"""`verify`: the compiled model against Hugging Face transformers, token by token.

The reference (transformers, float32, eager attention) generates greedily; the compiled model is
then fed the same tokens (teacher forcing), so one early disagreement cannot cascade and every
step's logits are compared like for like.

The logits limit of a float32-compute model follows the reference's own numerical noise (issue 22;
docs/design.md, "Verify's criterion"): transformers evaluates every step twice, incrementally (what
is compared) and in one full forward over the same tokens; the two differ only by float rounding, and
the conversion may differ from the reference by NOISE_FACTOR times that, never less than 1e-4 (the
fixed limit of old, which small models keep) and never more than NOISE_CAP of the largest |logit|.
A published Qwen2.5-0.5B with logits of ±24 differs from itself by 6.7e-5 between those two paths,
so a correct conversion's 1.1e-4 is noise there, while on a 4-layer model it would be a real error.
`--tolerance X` replaces the limit with X.

A step agrees when the compiled argmax equals the reference's greedy token, or when the two tokens
are tied in the reference: their reference logits differ by no more than the tie gap (the logits
limit where there is one; 16-bit compute: 1e-2, or 1e-3 of the step's largest |logit| where that is
more). Random tiny models give near-ties (gaps of 6e-4 and 9e-6 between the top two seen on
builtin:tiny-qwen3), and which of two tokens so close wins argmax depends on the CPU's float kernels
and the compute dtype's rounding, not on the conversion; such a step is counted as a tie in the
report. A wrong kernel still fails: its disagreements are spread over all gaps, not only the smallest.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qwen2om.arch import LM_HEAD, text_config
from qwen2om.builtin import resolve_model
from qwen2om.errors import Qwen2omError
from qwen2om.families import family_of
from qwen2om.kernels.ascend import cpu_engine
from qwen2om.output import MANIFEST, read_manifest, sha256_file
from qwen2om.runtime.standalone import Engine

DEFAULT_PROMPTS = (
    "The quick brown fox jumps over the lazy dog. In the beginning",
    "人工智能正在改变世界，",
)
LONG_SEED = ("def fibonacci(n: int) -> int:\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
             "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n")
# Tolerances per compute dtype (issue 2): fp32 is exact to float rounding (its 1e-4 is the floor of a limit
# that grows with the reference's own noise, `judged`); fp16 by top-1 agreement.
TOLERANCES = {"float32": {"max_abs": 1e-4, "agreement": 1.0}, "float16": {"max_abs": None, "agreement": 0.99}}
# int4 models whose MatMulNBits may compute in a lower precision than the graph (lower_int4's
# accuracy_level, read from the manifest). Levels 0 and 1 compute in the activations' float type
# (exact against the dequantised weights): the dtype's tolerance stands. Level 2 computes in fp16:
# fp16's tolerance. Levels 3 (bf16, 8 significant bits) and 4 (activations quantised to int8 per
# block, a step of 1/127 of the block's largest |x|) round one to two orders of magnitude more
# coarsely than fp16, and the error grows with the logits' scale: on a random 28-layer Qwen3-0.6B
# at level 4, max |Δlogits| 0.056-0.088 with 45-47 of 48 tokens agreeing (random weights give
# near-tied logits). Judged by top-1 agreement ≥ 90 % alone, which still fails any wrong kernel or
# packing (those agree on next to nothing).
ACCURACY_LEVEL_TOLERANCES = {
    2: {"max_abs": None, "agreement": 0.99, "why": "MatMulNBits accuracy_level 2: fp16 compute"},
    3: {"max_abs": None, "agreement": 0.90, "why": "MatMulNBits accuracy_level 3: bf16 compute"},
    4: {"max_abs": None, "agreement": 0.90, "why": "MatMulNBits accuracy_level 4: int8 activations"},
}


# The reference-logit gap under which two tokens are tied (module docstring) when the tolerance has
# no logits bound (fp16, or int4 computing in bf16/int8): fp16 keeps 11 significant bits, so logits
# of magnitude 2-8 round by up to 2e-3 per operation; the fp16 tiny models' steps differ from the
# float32 reference by 1.4e-3-3.1e-3 (measured), and 1e-2 is about three of those.
UNBOUNDED_TIE = 1e-2


# fp16's rounding, like fp32's, grows with the logits: builtin:tiny-qwen3-trained in fp16 differs from
# its reference by 2.8e-3 with logits of -12..9 and by 8.3e-3 with the same model's logits scaled to
# -37..26 (2.3e-4 of the largest |logit| both times), so at a real model's ±24 a fixed 1e-2 gap is
# about the rounding itself. 1e-3 of the step's largest |reference logit| is ~4x that relative error;
# it exceeds UNBOUNDED_TIE only from |logits| of 10 up, so small models keep their 1e-2.
TIE_RTOL = 1e-3


def tie_gap(tol: dict[str, Any], scale: float = 0.0) -> float:
    """The tie gap: the logits limit where there is one (fp32: 1e-4 or the reference's noise, see
    `judged`), else UNBOUNDED_TIE or TIE_RTOL of `scale` (the step's largest |reference logit|)."""
    return tol["max_abs"] if tol["max_abs"] is not None else max(UNBOUNDED_TIE, TIE_RTOL * scale)


# The logits limit of a tolerance with a bound (fp32 compute): NOISE_FACTOR times the reference's own
# noise, the largest difference between transformers' incremental-decode logits and its full forward
# over the same tokens (`reference_noise`). Measured (docs/design.md, "Verify's criterion"): ONNX
# Runtime's max |Δ| against the reference was 0.9-1.3x that noise on the tiny random, trained (scaled
# to ±37) and hybrid builtins, and 1.6x on a published Qwen2.5-0.5B (1.08e-4 against 6.7e-5):
# 4x leaves 2.5x of margin on the worst. The dtype's fixed max_abs (1e-4) stays as the floor.
NOISE_FACTOR = 4.0
# ...and never more than this fraction of the largest |reference logit|, whatever the noise: two
# reference paths that route one token to different experts (an MoE router near a tie) differ by O(1),
# which would otherwise let any error through. 1e-4 is ~20x the published 0.5B model's 4.5e-6.
NOISE_CAP = 1e-4


def check_tolerance(value: float) -> None:
    """A --tolerance is a max |Δlogits|: finite and ≥ 0 (0: every logit bit-equal, and no ties)."""
    if not math.isfinite(value) or value < 0:
        raise Qwen2omError(f"--tolerance {value}: a max |Δlogits| must be a finite number ≥ 0")


def judged(tol: dict[str, Any], noise: float, scale: float, override: float | None = None) -> dict[str, Any]:
    """The tolerance verify applies: the dtype's `tol` (`tolerance`) with its logits limit set, and how
    (`set_by`). `override` (--tolerance) is the limit as given. A bounded tolerance (fp32 compute) gets
    max(floor, min(NOISE_FACTOR × noise, NOISE_CAP × scale)), the floor being the dtype's own max_abs;
    `noise` is the reference's own (`reference_noise`), `scale` its largest |logit|. Agreement-only
    tolerances (fp16; int4 computing in bf16/int8) keep no logits bound."""
    if override is not None:
        check_tolerance(override)
        return tol | {"max_abs": float(override), "set_by": "--tolerance"}
    if tol["max_abs"] is None:
        return tol | {"set_by": "dtype"}
    floor = float(tol["max_abs"])
    limit = max(floor, min(NOISE_FACTOR * noise, NOISE_CAP * scale))
    return tol | {"max_abs": limit, "set_by": "reference noise", "floor": floor, "noise": noise,
                  "noise_factor": NOISE_FACTOR, "cap": NOISE_CAP * scale}


def describe(tol: dict[str, Any]) -> str:
    """The tolerance in words, for the CLI's verdict line."""
    parts = []
    if tol["max_abs"] is not None:
        how = {"--tolerance": "set by --tolerance",
               "reference noise": f"{tol.get('noise_factor', NOISE_FACTOR):g} × the reference's own noise "
                                  f"{tol.get('noise', 0.0):.2e}, at least {tol.get('floor', 0.0):g}, at most "
                                  f"{tol.get('cap', 0.0):.2e}"}.get(str(tol.get("set_by")))
        parts.append(f"max |Δlogits| ≤ {tol['max_abs']:.3g}" + (f" ({how})" if how else ""))
    parts.append(f"top-1 agreement ≥ {tol['agreement']:.0%}")
    return ", ".join(parts) + (f"; {tol['why']}" if tol.get("why") else "")


def describe_tie(tol: dict[str, Any]) -> str:
    """The tie gap in words (`tie_gap`)."""
    if tol["max_abs"] is not None:
        return f"{tie_gap(tol):.3g}"
    return f"{UNBOUNDED_TIE:g} (or {TIE_RTOL:g} × the step's largest |logit|, where more)"


def tolerance(manifest: dict[str, Any]) -> dict[str, Any]:
    """The compute dtype's tolerance, loosened for an int4 model lowered with accuracy_level ≥ 2."""
    tol: dict[str, Any] = dict(TOLERANCES[manifest["runtime"]["dtype"]])
    lowered = next((s["stats"] for s in manifest.get("stages", []) if s.get("pass") == "lower_int4"), {})
    level = int(lowered.get("accuracy_level", 0)) if lowered.get("lowered") else 0
    loose = ACCURACY_LEVEL_TOLERANCES.get(level)
    if loose is None:
        return tol
    return {"max_abs": loose["max_abs"], "agreement": min(tol["agreement"], loose["agreement"]), "why": loose["why"]}


# `verify`'s keyword `tolerance` (the --tolerance value) shadows this function inside it.
tolerance_of = tolerance


@dataclasses.dataclass
class PromptResult:
    prompt: str
    prompt_tokens: int
    steps: int
    max_abs: float
    agree: int
    first_disagreement: int | None
    ties: int = 0  # steps counted in `agree` whose two argmaxes are tied in the reference (module docstring)
    noise: float = 0.0  # the reference's own: max |Δ| between its incremental and full-forward logits
    scale: float = 0.0  # the reference's largest |logit| over the steps compared

    @property
    def agreement(self) -> float:
        return self.agree / self.steps if self.steps else 1.0


@dataclasses.dataclass
class VerifyReport:
    dtype: str
    tolerance: dict[str, Any]
    prompts: list[PromptResult]

    @property
    def max_abs(self) -> float:
        return max(p.max_abs for p in self.prompts)

    @property
    def agreement(self) -> float:
        steps = sum(p.steps for p in self.prompts)
        return sum(p.agree for p in self.prompts) / steps if steps else 1.0

    @property
    def passed(self) -> bool:
        limit = self.tolerance["max_abs"]
        return (limit is None or self.max_abs <= limit) and self.agreement >= self.tolerance["agreement"]

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "tolerance": self.tolerance, "passed": self.passed,
                "max_abs_logits": self.max_abs, "top1_agreement": self.agreement,
                "reference_noise": max((p.noise for p in self.prompts), default=0.0),
                "logits_scale": max((p.scale for p in self.prompts), default=0.0),
                "prompts": [dataclasses.asdict(p) | {"agreement": p.agreement} for p in self.prompts]}


def long_prompt(engine: Engine, tokens: int) -> str:
    """Code text just over `tokens` tokens long (to span more than one prefill chunk)."""
    text = LONG_SEED
    while len(engine.encode(text)) <= tokens:
        text += LONG_SEED
    return text


LOADERS = ("exact", "transformers")


def load_reference(ref_dir: Path, loader: str = "exact") -> Any:
    """transformers' own model class in float32. With `loader="exact"` (the default) the weights come
    from qwen2om's own reader, the safetensors files convert read and its manifest hashed; a quantised
    checkpoint is loaded with its exact float32 dequantisation, `(q - zp) · scale` or `q · scale`
    per tile, so the reference is the weights the converted model really holds (transformers' own
    int4 decompression rounds to the scale's bf16, and its FP8 load mis-sizes ragged tiles).
    `loader="transformers"` is transformers' own `from_pretrained` (float32 on CPU, safetensors only)."""
    import transformers

    from qwen2om.checkpoint import Checkpoint

    transformers.utils.logging.disable_progress_bar()
    if loader not in LOADERS:
        raise Qwen2omError(f"reference loader {loader!r} is not one of {', '.join(LOADERS)}")
    ckpt = Checkpoint(ref_dir)
    if loader == "transformers":  # transformers' own load (it dequantises FP8 on CPU); safetensors only
        ckpt.close()
        return transformers.AutoModelForCausalLM.from_pretrained(
            ref_dir, dtype=torch.float32, attn_implementation="eager", use_safetensors=True).eval()
    # qwen2om's own reader, float checkpoints included: exactly the files convert read and the manifest
    # hashed (from_pretrained would take a pytorch_model.bin beside oddly named safetensors shards).
    cfg = {k: v for k, v in ckpt.config.items() if k != "quantization_config"}
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    names = set(model.state_dict())
    state = {n: ckpt.get(n, torch.float32) for n in names if n in ckpt or n in ckpt.quantized}
    fused = family_of(ckpt.arch).names.is_fused
    state |= {n: fused_experts(ckpt, n) for n in names - set(state) if fused(n) and not ckpt.fused_experts}
    missing = model.load_state_dict(state, strict=False).missing_keys
    if set(missing) - {LM_HEAD}:
        raise Qwen2omError(f"{ref_dir}: the reference lacks {sorted(missing)[:3]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    ckpt.close()
    return model.eval()


def vocab_size(path: Path) -> int:
    """The logits' width of an output directory (its manifest) or a checkpoint (its config.json)."""
    if (path / MANIFEST).is_file():
        return int(read_manifest(path)["runtime"]["vocab"])
    try:
        return int(text_config(json.loads((path / "config.json").read_text(encoding="utf-8")))["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise Qwen2omError(f"{path / 'config.json'}: cannot read vocab_size ({e})") from None


def check_same_vocabulary(model: Path, reference: Path, names: tuple[str, str] | None = None) -> None:
    """Logits are compared token by token, so both sides must share the vocabulary: a model checked
    against another family's checkpoint would fail deep inside a Gather or a broadcast."""
    a, b = vocab_size(model), vocab_size(reference)
    if a != b:
        shown, ref = names or (model, reference)  # as the user wrote them (builtin:NAME, not its cache path)
        raise Qwen2omError(f"{shown} has a {a:,}-token vocabulary but the reference {ref} has {b:,}: "
                           "compare a model with the checkpoint it was converted or calibrated from")


def fused_experts(ckpt: Any, name: str) -> torch.Tensor:
    """transformers 5's in-memory 3-D expert tensor `name`, assembled from per-expert weights."""
    unfused = family_of(ckpt.arch).names.unfused
    return torch.stack([torch.cat([ckpt.get(n, torch.float32) for n in unfused(name, e).values()])
                        for e in range(ckpt.dims.experts)])


def reference_greedy(model: Any, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens and the raw logits of every step (EOS suppressed: n steps)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(ids):].tolist()
    return tokens, torch.stack(out.logits, 1)[0].float().numpy()


def reference_noise(model: Any, ids: list[int], tokens: list[int], logits: np.ndarray) -> float:
    """The reference's own float32 noise on these tokens: max |Δ| between the incremental-decode `logits`
    of `reference_greedy` (a KV cache, one token a call) and one full forward over the prompt and the
    tokens (no cache). Both evaluate the same function; their sums run in other orders and shapes."""
    with torch.no_grad():
        full = model(torch.tensor([ids + tokens[:-1]]), use_cache=False).logits[0, len(ids) - 1:]
    return float(np.abs(full.float().numpy() - logits).max())


def default_reference(out: Path) -> str:
    """The checkpoint OUT was converted from, as its manifest records it: a builtin by name, a directory
    by its absolute path (older manifests hold the path as it was typed), which must still hold the files
    the conversion read: a checkpoint calibrated again into the same directory is another model, and
    verify would report its differences as conversion errors."""
    source = read_manifest(out).get("source", {})
    model, path = str(source.get("model", "")), Path(source.get("path", ""))
    if model.startswith("builtin:"):
        return model
    if not (source.get("path") and (path / "config.json").is_file()):
        raise Qwen2omError(f"{out} was converted from {model or 'an unrecorded checkpoint'}, which is not at "
                           f"{path} any more: pass --reference")
    if changed := source_change(path, source.get("files", [])):
        raise Qwen2omError(f"{path} has changed since {out} was converted from it ({changed}): reconvert, or "
                           f"pass --reference {path} to compare with it as it is now")
    return str(path)


def source_change(path: Path, files: list[dict[str, Any]]) -> str | None:
    """How the files under `path` differ from the manifest's record of them (name, bytes, sha256), or None.
    Sizes first, for free; then the hashes (one read of the checkpoint, which verify loads whole anyway)."""
    for f in files:
        p = path / f["name"]
        if not p.is_file():
            return f"{f['name']} is gone"
        if p.stat().st_size != f["bytes"]:
            return f"{f['name']} is {p.stat().st_size:,} bytes, was {f['bytes']:,}"
    for f in files:
        if sha256_file(path / f["name"]) != f["sha256"]:
            return f"{f['name']} has another sha256"
    return None


def judge_step(logits: np.ndarray, ref_logits: np.ndarray, token: int, tie: float) -> str | None:
    """"agree" when the compiled argmax is the reference's greedy `token`; "tie" when it is another
    token whose reference logit is within `tie` of the greedy one's; None for a real disagreement."""
    pick = int(np.argmax(logits))
    if pick == token:
        return "agree"
    return "tie" if tie and ref_logits[token] - ref_logits[pick] <= tie else None


def verify(out: Path, reference: str | Path | None = None, *, tokens: int = 32, prompts: list[str] | None = None,
           loader: str = "exact", check_hashes: bool = True, tolerance: float | None = None,
           progress: Any = lambda *a: None, distributed: str | None = None, address: str | None = None,
           ) -> VerifyReport:
    """Compare OUT with `reference` on each prompt's greedy tokens. `tolerance`, when given, is the max
    |Δlogits| allowed (and the tie gap) in place of the dtype's criterion (`judged`). `distributed` and
    `address` run OUT's stages as Ray actors (the runtime Engine's arguments)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    manifest = read_manifest(out)
    reference = default_reference(out) if reference is None else reference
    if tolerance is not None:  # refused before any work, not after the reference ran
        check_tolerance(tolerance)
    # An Ascend-target output runs through the reference kernels; OUT's files checked against its manifest first.
    engine = cpu_engine(out, check_hashes=check_hashes, distributed=distributed, address=address)
    try:
        return compare(engine, out, manifest, reference, tokens, prompts, loader, tolerance, progress)
    finally:
        engine.close()  # with --distributed ray: its actors, and the local cluster it started


def compare(engine: Engine, out: Path, manifest: dict[str, Any], reference: str | Path, tokens: int,
            prompts: list[str] | None, loader: str, tolerance: float | None, progress: Any) -> VerifyReport:
    """`verify`'s comparison, on an open engine."""
    ref_dir = resolve_model(reference)
    if not (ref_dir / "config.json").is_file():
        raise Qwen2omError(f"{ref_dir}: not a checkpoint directory (no config.json) for --reference")
    check_same_vocabulary(out, ref_dir, (str(out), str(reference)))
    model = load_reference(ref_dir, loader)
    chunk = max(g.tokens for g in engine.graphs.values())
    long = long_prompt(engine, chunk + 5) if chunk + 5 + tokens <= engine.capacity else None
    texts = list(prompts) if prompts else [*DEFAULT_PROMPTS, *([long] if long else [])]
    # Every prompt's reference first: the logits limit rests on the noise and scale of them all.
    refs = []
    for i, text in enumerate(texts):
        progress("reference", i, len(texts))
        ids = engine.encode(text)
        n = min(tokens, engine.capacity - len(ids))
        if n < 1 or not ids:
            raise Qwen2omError(f"prompt {i + 1} has {len(ids)} tokens: it leaves no room to generate in the "
                               f"cache capacity {engine.capacity}; use a shorter --prompt")
        ref_tokens, ref_logits = reference_greedy(model, ids, n)
        refs.append((ids, ref_tokens, ref_logits, reference_noise(model, ids, ref_tokens, ref_logits)))
    progress("reference", len(texts), len(texts))
    scales = [float(np.abs(r[2]).max()) for r in refs]
    tol = judged(tolerance_of(manifest), max(r[3] for r in refs), max(scales), tolerance)
    results = []
    for i, (text, (ids, ref_tokens, ref_logits, noise)) in enumerate(zip(texts, refs, strict=True)):
        progress("verifying", i, len(texts))
        engine.reset()
        logits = engine.prefill([ids] * engine.batch)[0]
        diffs, agree, ties, first = [], 0, 0, None
        for step, tok in enumerate(ref_tokens):
            diffs.append(float(np.abs(logits - ref_logits[step]).max()))
            tie = tie_gap(tol, float(np.abs(ref_logits[step]).max()))
            match = judge_step(logits, ref_logits[step], tok, tie)
            agree, ties = agree + (match is not None), ties + (match == "tie")
            if match is None and first is None:
                first = step
            if step + 1 < len(ref_tokens):
                logits = engine.step([tok] * engine.batch)[0]
        results.append(PromptResult(text, len(ids), len(ref_tokens), max(diffs), agree, first, ties, noise, scales[i]))
    progress("verifying", len(texts), len(texts))
    return VerifyReport(manifest["runtime"]["dtype"], tol, results)
