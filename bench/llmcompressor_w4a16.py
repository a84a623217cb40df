"""Quantise a checkpoint with llm-compressor (GPTQ, W4A16), for comparisons with `qwen2om calibrate`.

llm-compressor 0.14 pins transformers ≤ 5.17, so it lives in its own virtual environment and this
script imports nothing from qwen2om:

    python3 -m venv .venv-llmc
    .venv-llmc/bin/pip install torch==2.13.0 && .venv-llmc/bin/pip install llmcompressor==0.14.0.1
    .venv-llmc/bin/python bench/llmcompressor_w4a16.py --model CKPT --samples ids.json --out OUT

`--samples` is a JSON list of token-id lists (qwen2om writes the same windows it calibrates on), so
both tools see identical calibration data. Prints one JSON line: seconds, samples, tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--samples", type=Path, required=True, help="JSON list of token-id lists")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--method", choices=["gptq", "rtn"], default="gptq")
    args = ap.parse_args()

    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    ids = json.loads(args.samples.read_text())
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    data = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})
    groups = {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": args.group_size}}}
    if args.method == "gptq":
        recipe = GPTQModifier(config_groups=groups, ignore=["lm_head"], dampening_frac=0.01, actorder="static")
    else:
        recipe = QuantizationModifier(config_groups=groups, ignore=["lm_head"])
    t0 = time.perf_counter()
    oneshot(model=model, dataset=data, recipe=recipe, num_calibration_samples=len(ids),
            max_seq_length=max(map(len, ids)), pipeline="sequential" if args.method == "gptq" else "datafree")
    seconds = time.perf_counter() - t0
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)
    print(json.dumps({"tool": f"llm-compressor {args.method}", "seconds": round(seconds, 2), "samples": len(ids),
                      "tokens": sum(map(len, ids))}))


if __name__ == "__main__":
    main()
