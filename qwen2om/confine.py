"""Files a checkpoint or output directory names must be regular files inside that directory.

A checkpoint is untrusted input: a `vocab.json` that is a symlink to `/etc/passwd` or to a key file
would otherwise be copied into OUT, hashed in its manifest and published with it. Symlinks are
followed only while they stay inside the directory (a shard linked to another file of the same
checkpoint is fine); FIFOs and devices are refused before anything blocks on them.
"""

from __future__ import annotations

import stat
from pathlib import Path

from qwen2om.errors import CheckpointError


def confined(root: Path, name: str) -> Path:
    """`root / name`, resolved, when it is a regular file inside `root`; a CheckpointError naming it otherwise."""
    path = root / name
    real = path.resolve()
    if not real.is_relative_to(root.resolve()):
        raise CheckpointError(f"{path}: points outside {root} (to {real}); qwen2om reads only files inside the "
                              "checkpoint directory")
    mode = real.stat().st_mode
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path}: not a regular file (a FIFO, device or directory); refusing to read it")
    return real
