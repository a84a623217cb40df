"""Files a checkpoint or output directory names must be regular files inside that directory.

A checkpoint is untrusted input: a `vocab.json` that is a symlink to `/etc/passwd` or to a key file
would otherwise be copied into OUT, hashed in its manifest and published with it, and an index entry
`../other/model.safetensors` would be read and recorded. Symlinks are followed only while they stay
inside the directory (a shard linked to another file of the same checkpoint is fine); FIFOs and
devices are refused before anything blocks on them.

One layout is inside by construction: the Hugging Face hub cache, whose `snapshots/<revision>/` files
link to `../../blobs/<hash>` of the same repository (`models--Org--Name/`); links into that `blobs`
folder (itself a real folder, not a link) are followed too.
"""

from __future__ import annotations

import stat
from pathlib import Path

from qwen2om.errors import CheckpointError


def hub_blobs(real_root: Path) -> Path | None:
    """The `blobs` folder of a Hugging Face cache repository when `real_root` is one of its snapshots."""
    snapshots = real_root.parent
    repo = snapshots.parent
    if snapshots.name == "snapshots" and repo.name.startswith(("models--", "datasets--")):
        return repo / "blobs"
    return None


def confined(root: Path, name: str) -> Path:
    """`root / name`, resolved, when it is a regular file inside `root`; a CheckpointError naming it otherwise."""
    path = root / name
    try:
        real, real_root = path.resolve(), root.resolve()
    except (OSError, RuntimeError, ValueError) as e:  # a link loop, a NUL in an index entry
        raise CheckpointError(f"{path}: cannot resolve ({e})") from None
    # `real.parent == blobs` compares with the unresolved blobs path, so a `blobs` that is itself a
    # link (to /etc, say) never matches.
    blobs = hub_blobs(real_root)
    if not real.is_relative_to(real_root) and not (blobs is not None and real.parent == blobs):
        raise CheckpointError(f"{path}: points outside {root} (to {real}); qwen2om reads only files inside the "
                              "checkpoint directory")
    try:
        mode = real.stat().st_mode
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path}: not a regular file (a FIFO, device or directory); refusing to read it")
    return real
