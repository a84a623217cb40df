"""RoPE cos/sin tables, computed once in float64 from the config.

The tables are graph constants gathered by `position_ids`. inv_freq comes from transformers'
own RoPE initialisers (every `rope_type` they know: default, linear, yarn, llama3, ...), is
float32 there, and is never stored or computed in fp16: with rope_theta = 1e6 the low
frequencies fall into fp16 subnormals and get flushed on the NPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import transformers
from huggingface_hub.errors import StrictDataclassError

from qwen2om.errors import CheckpointError


def hf_config(cfg: dict[str, Any]) -> transformers.PretrainedConfig:
    """The transformers config object for a config.json dict (offline, no hub). transformers validates
    its fields strictly; what it refuses that qwen2om's own schema (arch.ConfigFields) let through is
    still the config's fault, so it is reported as such, not as a traceback."""
    try:
        return transformers.CONFIG_MAPPING[cfg["model_type"]].from_dict(dict(cfg))
    except (KeyError, TypeError, ValueError, StrictDataclassError) as e:
        why = " ".join(str(e).split())
        raise CheckpointError(f"config.json: transformers cannot read this config: {why}") from None


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread for the block. float64 cos/sin of a [512, 128] table split over two
    threads came out different in the last bits in about 1 process in 15 on an AVX-512 Xeon (same inputs;
    repeats within one process agree), and now and then that survived the rounding to float32 and changed
    `calibrate`'s checkpoint bytes; on one thread 40 runs of 40 agreed, with the value the threaded runs
    mostly give."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def rope_tables(cfg: dict[str, Any], positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [positions, head_dim], float32, attention scaling folded in."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = hf_config(cfg)
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "dynamic":
        # Dynamic NTK rescales with the live sequence length: not a static table.
        raise CheckpointError("config.json: rope_type 'dynamic' has no static-shape equivalent")
    if rope_type == "default":
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        scaling = 1.0
    elif rope_type in ROPE_INIT_FUNCTIONS:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    else:
        raise CheckpointError(f"config.json: unknown rope_type {rope_type!r}")
    pos = torch.arange(positions, dtype=torch.float64)
    with one_thread():  # the same bits in every run (see one_thread)
        freqs = torch.outer(pos, inv_freq.to(torch.float64))
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scaling).float(), (emb.sin() * scaling).float()
