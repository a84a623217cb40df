"""What a checkpoint says about generating text: stop ids, the pad id and its sampling defaults.

They come from generation_config.json (over config.json for the token ids), as transformers reads
them, and land in the manifest's `runtime` section, where run.py reads them. Every value is checked
here, before any conversion work, naming the file and key: an `eos_token_id` of "x" used to be an
`int()` traceback after the whole conversion.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from qwen2om.checkpoint import read_json
from qwen2om.confine import confined
from qwen2om.errors import CheckpointError

GENERATION_CONFIG = "generation_config.json"


@dataclasses.dataclass(frozen=True)
class Generation:
    eos_ids: list[int]
    pad_id: int
    # temperature / top_k / top_p as published; temperature 0 when the checkpoint asks for greedy
    # decoding (do_sample false); empty when generation_config.json says nothing about sampling.
    sampling: dict[str, float | int]


def read_generation(source: Path, config: dict[str, Any], vocab: int) -> Generation:
    gen, where = dict(config), dict.fromkeys(config, "config.json")
    published: dict[str, Any] = {}
    if (source / GENERATION_CONFIG).exists() or (source / GENERATION_CONFIG).is_symlink():
        published = read_json(confined(source, GENERATION_CONFIG), GENERATION_CONFIG)
        gen.update(published)
        where.update(dict.fromkeys(published, GENERATION_CONFIG))

    def bad(key: str, what: str) -> CheckpointError:
        return CheckpointError(f"{source / where[key]}: {key} must be {what}, got {str(gen[key])[:80]!r}")

    def token(key: str, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab:
            raise bad(key, f"a token id in [0, {vocab})")
        return value

    eos = gen.get("eos_token_id")
    eos_ids = sorted({token("eos_token_id", e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None})
    pad = gen.get("pad_token_id")
    pad_id = token("pad_token_id", pad) if pad is not None else (eos_ids or [0])[0]

    def number(key: str, lo: float, hi: float, integer: bool = False) -> float | int | None:
        value = published.get(key)
        if value is None:
            return None
        kind = int if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kind) or not (math.isfinite(value) and lo <= value <= hi):
            raise bad(key, f"{'an integer' if integer else 'a number'} in [{lo:g}, {hi:g}]")
        return value

    sampling = {k: v for k, v in (("temperature", number("temperature", 0, 100)),
                                  ("top_k", number("top_k", 0, vocab, integer=True)),
                                  ("top_p", number("top_p", 0, 1))) if v is not None}
    if published.get("do_sample") is False:  # transformers then decodes greedily whatever the rest says
        sampling = {"temperature": 0.0}
    return Generation(eos_ids, pad_id, sampling)
