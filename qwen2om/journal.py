"""What an interrupted conversion has finished, kept in its staging directory for `--resume`.

The journal is rewritten atomically (temporary file, fsync, rename) after each unit of work
and only ever records work whose bytes are already on disk (the data file is synced first),
so a SIGKILL at any instant leaves a journal that under-reports, never one that lies. On
resume nothing is trusted blindly: the source shards are hashed again and must match, and
every tensor the journal lists is re-read and its hash compared before it is skipped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from qwen2om.errors import Qwen2omError

JOURNAL = "journal.json"
VERSION = 1


class ResumeError(Qwen2omError):
    """--resume cannot continue this staging directory; it is kept so nothing is lost."""

    keep_partial = True


class Journal:
    """Progress of one conversion. `path=None` keeps it in memory only (library calls, tests)."""

    def __init__(self, path: Path | None = None, key: dict[str, Any] | None = None) -> None:
        self.path = path
        self.state: dict[str, Any] = {"version": VERSION, "key": key or {}, "sources": None, "data": {}}
        self.resumed = False

    @classmethod
    def open(cls, stage: Path, key: dict[str, Any], *, resume: bool) -> Journal:
        """The journal of `stage`; with `resume`, the earlier run's, refused if made differently."""
        j = cls(stage / JOURNAL, key)
        if resume and j.path is not None and j.path.is_file():
            try:
                old = json.loads(j.path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as e:
                raise ResumeError(f"{j.path}: the journal of the interrupted run is unreadable ({e}); "
                                  "rerun with --force to start over") from None
            if old.get("version") != VERSION or old.get("key") != key:
                diff = sorted(k for k in {*key, *old.get("key", {})} if key.get(k) != old.get("key", {}).get(k))
                raise ResumeError(f"{stage} was started with a different {', '.join(diff) or 'journal format'}; "
                                  "--resume continues only the same command: rerun with --force to start over")
            j.state, j.resumed = old, True
        j.save()
        return j

    def save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(self.state, fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)

    def check_sources(self, hashes: dict[str, str]) -> None:
        """Record the shards' hashes; on resume, refuse if any changed since the interrupted run."""
        before = self.state.get("sources")
        if before is not None and before != hashes:
            changed = sorted(k for k in {*before, *hashes} if before.get(k) != hashes.get(k))
            name = changed[0]
            was, now = (before.get(name) or "absent")[:12], (hashes.get(name) or "absent")[:12]
            raise ResumeError(
                f"{name} changed since the interrupted run (sha256 {was}… then, {now}… now"
                + (f"; {len(changed) - 1} more shards changed" if len(changed) > 1 else "")
                + "): refusing to mix weights from two checkpoints; restore it, or rerun with --force to start over")
        self.state["sources"] = hashes
        self.save()

    def data_done(self, layout: str) -> dict[str, str]:
        """Tensors already written for this exact data layout: {region key: sha256}."""
        data = self.state.get("data") or {}
        return dict(data.get("done", {})) if data.get("layout") == layout else {}

    def mark_data(self, layout: str, done: dict[str, str]) -> None:
        self.state["data"] = {"layout": layout, "done": dict(sorted(done.items()))}
        self.save()

    def remove(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path.with_suffix(".tmp").unlink(missing_ok=True)
