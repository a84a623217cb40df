"""Calibration and evaluation text: JSONL, plain text and built-in offline samples, as token windows.

Built-in sets (`builtin:NAME`, mixable as `builtin:prose+code`), all read from what is already
on the machine, so calibration works offline:

| name | source | licence |
|---|---|---|
| prose | CPython's `pydoc_data/topics.py` (the language reference, as help() shows it) | PSF-2.0 |
| code | the CPython standard library's own `.py` sources (sorted, first files) | PSF-2.0 |
| chinese | Debian `manpages-zh`: Chinese man pages, markup stripped (apt-get install it) | GFDL-1.2+ / GPL |
| chat | ChatML conversations built from `prose` topics: a question about a topic, its text as the answer | PSF-2.0 |

Every document is tokenised, documents are joined with the end-of-text token, and the stream is
cut into windows of `seq_len` tokens (packing): a short document never becomes a short sample.
The sources change with the Python or Debian version, so the report carries a sha256 of the
text actually used.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import re
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from qwen2om.errors import Qwen2omError

ZH_MAN = Path("/usr/share/man/zh_CN")


class DatasetError(Qwen2omError):
    """A dataset file is missing, empty, malformed or not UTF-8 (file and line named)."""


@dataclasses.dataclass
class Windows:
    """Token windows ready for calibration or evaluation, and where they came from."""

    samples: list[list[int]]
    source: str
    documents: int
    tokens: int  # tokens available before cutting into windows
    sha256: str
    notes: list[str] = dataclasses.field(default_factory=list)

    def report(self) -> dict[str, Any]:
        return {"source": self.source, "documents": self.documents, "tokens_available": self.tokens,
                "samples": len(self.samples), "seq_len": len(self.samples[0]) if self.samples else 0,
                "sha256": self.sha256, "notes": self.notes}


# -- built-in sources ---------------------------------------------------------------------------
def prose_docs() -> list[str]:
    import pydoc_data.topics

    return [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]


def code_docs(limit_bytes: int = 600_000) -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        docs.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    return docs


GROFF = [(re.compile(r"\\f[BIRP]|\\f\(..|\\\(..|\\[&|^~e-]"), ""), (re.compile(r"^\.\S+\s?"), "")]


def strip_groff(page: str) -> str:
    lines = []
    for line in page.splitlines():
        if line.startswith(('.\\"', "'\\\"")):
            continue
        for pattern, repl in GROFF:
            line = pattern.sub(repl, line)
        if line.strip():
            lines.append(line.strip())
    return "\n".join(lines)


def chinese_docs() -> list[str]:
    pages = sorted(ZH_MAN.glob("man*/*.gz"))
    if not pages:
        raise DatasetError(f"builtin:chinese reads the Debian package manpages-zh ({ZH_MAN} is empty or missing): "
                           "apt-get install manpages-zh")
    return [strip_groff(gzip.decompress(p.read_bytes()).decode("utf-8", errors="replace")) for p in pages]


def chat_docs() -> list[list[dict[str, str]]]:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return [[{"role": "user", "content": f"Explain “{name}” in Python, with an example."},
             {"role": "assistant", "content": topics[name].strip()[:4000]}] for name in sorted(topics)]


BUILTIN: dict[str, Callable[[], list[Any]]] = {
    "prose": prose_docs, "code": code_docs, "chinese": chinese_docs, "chat": chat_docs}


# -- files ---------------------------------------------------------------------------------------
def read_lines(path: Path) -> Iterator[tuple[int, str]]:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DatasetError(f"{path}: cannot read ({e.strerror or e})") from None
    for n, line in enumerate(raw.split(b"\n"), 1):
        try:
            yield n, line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DatasetError(f"{path}:{n}: not UTF-8 text (byte {e.start}: {line[e.start:e.start + 1]!r})") from None


def jsonl_docs(path: Path) -> list[Any]:
    docs: list[Any] = []
    for n, line in read_lines(path):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if isinstance(rec, dict) and isinstance(rec.get("text"), str):
            docs.append(rec["text"])
        elif isinstance(rec, dict) and isinstance(rec.get("messages"), list) and all(
                isinstance(m, dict) and "role" in m and "content" in m for m in rec["messages"]):
            docs.append(rec["messages"])
        else:
            raise DatasetError(f"{path}:{n}: each line needs \"text\" (a string) or \"messages\" "
                               "(a list of {role, content})")
    return docs


def text_docs(path: Path) -> list[str]:
    return ["\n".join(line for _, line in read_lines(path))]


# -- assembly ------------------------------------------------------------------------------------
class Encoder:
    """The model's own tokenizer and chat template."""

    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer

        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise DatasetError(f"{model_dir}: no tokenizer.json to encode the dataset with")
        self.tok = Tokenizer.from_file(str(path))
        self.model_dir = Path(model_dir)
        self.eos = self.tok.token_to_id("<|endoftext|>")
        self._chat: Any = None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def chat(self, messages: list[dict[str, str]]) -> str:
        if self._chat is None:
            from transformers import AutoTokenizer

            self._chat = AutoTokenizer.from_pretrained(self.model_dir)
            if not getattr(self._chat, "chat_template", None):
                raise DatasetError(f"{self.model_dir}: the tokenizer has no chat template for \"messages\" records")
        return str(self._chat.apply_chat_template(messages, tokenize=False))


def load_docs(spec: str) -> tuple[list[Any], str]:
    if spec.startswith("builtin:"):
        names = spec.removeprefix("builtin:").split("+")
        docs: list[list[Any]] = []
        for name in names:
            if name not in BUILTIN:
                raise DatasetError(f"unknown built-in dataset {name!r} (known: {', '.join(BUILTIN)}; mix with '+')")
            docs.append(BUILTIN[name]())
        # Interleave so that a mix stays a mix whatever num_samples cuts off.
        mixed = [d for group in zip_longest_drop(docs) for d in group]
        return mixed, spec
    path = Path(spec)
    if path.is_dir():
        raise DatasetError(f"{path} is a directory: --dataset takes a JSONL or text file, or "
                           f"builtin:{'|'.join(BUILTIN)}")
    if not path.is_file():
        raise DatasetError(f"{path}: dataset file not found (or use builtin:{'|'.join(BUILTIN)})")
    docs_ = jsonl_docs(path) if path.suffix in (".jsonl", ".json") else text_docs(path)
    if not docs_ or not any((d.strip() if isinstance(d, str) else d) for d in docs_):
        raise DatasetError(f"{path}: the dataset is empty")
    return docs_, str(path)


def zip_longest_drop(groups: list[list[Any]]) -> Iterator[list[Any]]:
    for i in range(max(map(len, groups))):
        yield [g[i] for g in groups if i < len(g)]


def windows(spec: str, model_dir: Path, *, num_samples: int, seq_len: int) -> Windows:
    """`num_samples` windows of exactly `seq_len` tokens from `spec` (fewer, with a note, if it is short)."""
    docs, source = load_docs(spec)
    enc = Encoder(model_dir)
    stream: list[int] = []
    h = hashlib.sha256()
    need = num_samples * seq_len
    used = 0
    for doc in docs:
        text = enc.chat(doc) if isinstance(doc, list) else doc
        h.update(text.encode("utf-8"))
        stream += enc.encode(text)
        if enc.eos is not None:
            stream.append(enc.eos)
        used += 1
        if len(stream) >= need:
            break
    n = len(stream) // seq_len
    out = Windows([stream[i * seq_len:(i + 1) * seq_len] for i in range(min(n, num_samples))], source, used,
                  len(stream), h.hexdigest())
    if n < num_samples:
        out.notes.append(f"{source} gives {len(stream)} tokens: {n} sample{'s' if n != 1 else ''} of {seq_len} "
                         f"tokens, not the {num_samples} asked for")
    if not out.samples:
        raise DatasetError(f"{source}: {len(stream)} tokens is less than one sample of {seq_len}; "
                           "lower --seq-len or add text")
    return out
