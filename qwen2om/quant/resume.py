"""What an interrupted calibration has finished, for `calibrate --resume`.

Each calibrated layer is kept in the staging directory as it was handed to the workers
(`.calibration/layer-NNNNN.pt`: int4 values, scales, zero points, AWQ's float tensors, the layer's
report), written and synced before the journal (qwen2om.journal: atomic, never over-reports) lists
it. A resumed run writes the checkpoint's shards again from these files in the same order, and its
workers rebuild the activations entering the next layer by running the samples through the kept
layers — the same arithmetic the first run did, so the checkpoint is byte-identical to an
uninterrupted one. Both go when the calibration finishes; the journal's key refuses a resume with
other settings, samples or weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from qwen2om.journal import JOURNAL, Journal, ResumeError
from qwen2om.quant.shard import LayerResult

FOLDER = ".calibration"


def digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


class CalibrationJournal:
    def __init__(self, stage: Path, key: dict[str, Any], *, resume: bool) -> None:
        self.folder = stage / FOLDER
        self.journal = Journal.open(stage, key, resume=resume)
        self.folder.mkdir(exist_ok=True)
        self.done: list[int] = list(self.journal.state["data"].get("layers", []))
        self.resumed = self.journal.resumed and bool(self.done)

    def path(self, index: int) -> Path:
        return self.folder / f"layer-{index:05d}.pt"

    def save(self, result: LayerResult) -> None:
        path, tmp = self.path(result.index), self.path(result.index).with_suffix(".tmp")
        blob = {"index": result.index, "int4": {n: list(v) for n, v in result.int4.items()},
                "floats": result.floats, "order": result.order, "meta": json.dumps(result.meta)}
        with open(tmp, "wb") as fh:
            torch.save(blob, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        self.done.append(result.index)
        self.journal.state["data"]["layers"] = self.done
        self.journal.save()

    def load(self, index: int) -> LayerResult:
        try:
            blob = torch.load(self.path(index), weights_only=True)
            return LayerResult(blob["index"], {n: tuple(v) for n, v in blob["int4"].items()}, blob["floats"],
                               blob["order"], json.loads(blob["meta"]))
        except (OSError, RuntimeError, KeyError, ValueError) as e:
            raise ResumeError(f"{self.path(index)}: layer {index} of the interrupted calibration is unreadable "
                              f"({e}); rerun with --force to start over") from None

    def finish(self) -> None:
        """The journal and the kept layers leave the staging directory before it becomes OUT."""
        shutil.rmtree(self.folder, ignore_errors=True)
        (self.journal.path or self.folder / JOURNAL).unlink(missing_ok=True)


def key(source: Path, config: dict[str, Any], settings: dict[str, Any], samples: list[list[int]]) -> dict[str, Any]:
    """What a resumed run must share with the interrupted one to write the same checkpoint."""
    return {"command": "calibrate", "model": str(source.resolve()), "config": digest(config),
            "settings": digest(settings), "samples": digest(samples)}

