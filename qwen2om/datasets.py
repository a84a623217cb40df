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

Files and checkpoints are untrusted: a dataset must be a regular file (a FIFO or device is refused
before it is opened), it is read lazily and left once the windows are full, a document longer than
PIECE_CHARS is tokenised in pieces cut where its tokens do not change, and a chat template renders
under a time limit. Every failure is a DatasetError naming the file (and line, or template).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import hashlib
import json
import os
import re
import stat
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from qwen2om.errors import Qwen2omError
from qwen2om.runtime.standalone import TEMPLATE_SECONDS, ChatTemplate, RuntimeInputError

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
# A dataset file is read in blocks and its documents handed on one at a time, so that reading stops
# as soon as the windows are full: a 100 MB one-line file asked for one window reads a megabyte.
READ_BYTES = 1 << 20

KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
         stat.S_IFSOCK: "a socket"}


def open_regular(path: Path) -> BinaryIO:
    """`path` opened for reading, refused unless it is a regular file: a FIFO or a device would block
    or never end. Checked before opening, and again on the open descriptor in case it was swapped."""
    hint = f"--dataset takes a JSONL or text file, or builtin:{'|'.join(BUILTIN)}"
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise DatasetError(f"{path}: dataset file not found (or use builtin:{'|'.join(BUILTIN)})") from None
    except OSError as e:
        raise DatasetError(f"{path}: cannot read ({e.strerror or e})") from None
    if stat.S_ISDIR(mode):
        raise DatasetError(f"{path} is a directory, not a regular file: {hint}")
    if not stat.S_ISREG(mode):
        raise DatasetError(f"{path}: not a regular file ({KINDS.get(stat.S_IFMT(mode), 'a special file')}): {hint}")
    nonblock = getattr(os, "O_NONBLOCK", 0)
    try:
        # O_NONBLOCK: if a FIFO replaced the file since the stat, opening it must not wait for a writer.
        fd = os.open(path, os.O_RDONLY | nonblock)
    except OSError as e:
        raise DatasetError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise DatasetError(f"{path}: not a regular file: {hint}")
        if nonblock:
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def not_utf8(path: Path, line: int, column: int, byte: bytes) -> DatasetError:
    """The error for an invalid `byte` at byte `column` (from 0) of line `line`."""
    return DatasetError(f"{path}:{line}: not UTF-8 text (byte {column}: {byte!r})")


def text_pieces(path: Path, f: BinaryIO) -> Iterator[str]:
    """A text file's content, decoded block by block; its concatenation is the whole file."""
    line, column, tail = 1, 0, b""  # line and byte column where `data` starts; bytes of a split character
    while block := f.read(READ_BYTES):
        data = tail + block
        try:
            text, tail = data.decode("utf-8"), b""
        except UnicodeDecodeError as e:
            if e.reason != "unexpected end of data" or e.end != len(data):
                bad, nl = e.start, data.rfind(b"\n", 0, e.start)
                raise not_utf8(path, line + data.count(b"\n", 0, bad), bad - nl - 1 if nl >= 0 else column + bad,
                               data[bad:bad + 1]) from None
            text, tail = data[:e.start].decode("utf-8"), data[e.start:]  # a character cut by the block end
        done = data[:len(data) - len(tail)]
        nl = done.rfind(b"\n")
        line += done.count(b"\n")
        column = len(done) - nl - 1 if nl >= 0 else column + len(done)
        yield text
    if tail:  # the file ends inside a character
        raise not_utf8(path, line, column, tail[:1])


def jsonl_docs(path: Path, f: BinaryIO) -> Iterator[str | list[dict[str, str]]]:
    """The records of a JSONL file, one line read and checked at a time."""
    for n, raw in enumerate(f, 1):
        try:
            line = raw.removesuffix(b"\n").decode("utf-8")
        except UnicodeDecodeError as e:
            raise not_utf8(path, n, e.start, raw[e.start:e.start + 1]) from None
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        except RecursionError:  # `[[[[…` 200k deep: the decoder recurses once per level
            raise DatasetError(f"{path}:{n}: not valid JSON (nested too deeply)") from None
        except ValueError as e:  # e.g. an integer longer than Python's int-conversion digit limit
            raise DatasetError(f"{path}:{n}: not valid JSON ({e})") from None
        if isinstance(rec, dict) and isinstance(rec.get("text"), str):
            yield rec["text"]
        elif isinstance(rec, dict) and isinstance(rec.get("messages"), list) and all(
                isinstance(m, dict) and "role" in m and "content" in m for m in rec["messages"]):
            yield rec["messages"]
        else:
            raise DatasetError(f"{path}:{n}: each line needs \"text\" (a string) or \"messages\" "
                               "(a list of {role, content})")


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
        self._chat: ChatTemplate | None = None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def chat(self, messages: list[dict[str, str]]) -> str:
        """One whole conversation (no generation prompt) rendered with the checkpoint's template by run.py's
        own renderer (ChatTemplate), so that calibration and evaluation see the text `run --chat` feeds the
        model; under TEMPLATE_SECONDS (this module's, read at each call). Whatever the template does wrong
        (a syntax error, raise_exception, a runaway loop) is a DatasetError naming its file."""
        try:
            if self._chat is None:
                template = ChatTemplate.load(self.model_dir)
                if template.file is None:  # a record's format would be a guess: ChatML is run's fallback only
                    raise DatasetError(f"{self.model_dir}: no chat template (chat_template.jinja or "
                                       "tokenizer_config.json's chat_template) for \"messages\" records")
                self._chat = template
            return self._chat.render(messages, add_generation_prompt=False, seconds=TEMPLATE_SECONDS)
        except RuntimeInputError as e:  # ChatTemplateError, a message that is not an object, jinja2 missing
            raise DatasetError(str(e)) from None


Document = str | list[dict[str, str]] | Iterator[str]  # text, a conversation, or text read from a file


@contextlib.contextmanager
def open_docs(spec: str) -> Iterator[tuple[Iterator[Document], str]]:
    """The documents of `spec`, produced lazily, and the name to report it under. A file is checked
    (and opened) on entry, so a bad path fails before the tokenizer loads, and closed on exit."""
    if spec.startswith("builtin:"):
        names = builtin_names(spec)
        # Interleave so that a mix stays a mix whatever num_samples cuts off.
        yield (d for group in zip_longest_drop([BUILTIN[name]() for name in names]) for d in group), spec
        return
    path = Path(spec)
    with open_regular(path) as f:
        # A text file is one document (lines joined by "\n", as written), streamed in blocks.
        docs = jsonl_docs(path, f) if path.suffix in (".jsonl", ".json") else iter([text_pieces(path, f)])
        yield docs, str(path)


def builtin_names(spec: str) -> list[str]:
    """The built-in sets a `builtin:A+B` spec mixes, each checked to exist."""
    names = spec.removeprefix("builtin:").split("+")
    for name in names:
        if name not in BUILTIN:
            raise DatasetError(f"unknown built-in dataset {name!r} (known: {', '.join(BUILTIN)}; mix with '+')")
    return names


def check_source(spec: str) -> None:
    """Fail now, before a model is loaded, if `spec` names an unknown built-in or a path that is not a
    regular file; reads no text."""
    if spec.startswith("builtin:"):
        builtin_names(spec)
    else:
        open_regular(Path(spec)).close()


def zip_longest_drop(groups: list[list[Any]]) -> Iterator[list[Any]]:
    for i in range(max(map(len, groups))):
        yield [g[i] for g in groups if i < len(g)]


# -- cutting long documents ----------------------------------------------------------------------
# A document longer than this many characters is tokenised in pieces: the tokenizers library holds
# ~100 bytes per character while encoding (4 M characters: 0.5 GB), and windows usually need far
# fewer tokens than one big document gives. Every built-in document is shorter, so is tokenised whole.
PIECE_CHARS = 1 << 20

# Where a text may be cut without changing its tokens: before a space that follows a non-space, or
# after a newline between two non-spaces. No pre-token of Qwen's split regex (nor GPT-2's or
# Llama 3's) runs across either place: a word takes a space only in front of it, punctuation takes
# only newlines after it, whitespace runs hold no non-space. NFC cannot join across them either.
CUT = re.compile(r"(?<=\S)(?= )|(?<=\S\n)(?=\S)")


def cut_point(text: str, start: int, end: int) -> int:
    """The last cut point in text(start, end], looking near `end` first; `end` itself if there is none
    in the second half (a text without spaces or newlines is then cut where it must)."""
    for lo in (end - 4096, start + (end - start) // 2):
        last = None
        for m in CUT.finditer(text, max(lo, start + 1), end):
            last = m
        if last is not None:
            return last.start()
    return end


def segments(pieces: Iterable[str], limit: int) -> Iterator[tuple[str, bool]]:
    """One document's text (given in pieces of any size) as (segment, is_last): a document of at most
    `limit` characters is a single segment, a longer one is cut at cut points into segments of at most
    `limit` characters, produced as the pieces arrive."""
    buf: list[str] = []
    size = 0
    for piece in pieces:
        buf.append(piece)
        size += len(piece)
        if size <= limit:
            continue
        text, start = "".join(buf), 0
        while len(text) - start > limit:
            at = cut_point(text, start, start + limit)
            yield text[start:at], False  # not last: text[at:] is not empty
            start = at
        buf, size = [text[start:]], len(text) - start
    yield "".join(buf), True


def windows(spec: str, model_dir: Path, *, num_samples: int, seq_len: int) -> Windows:
    """`num_samples` windows of exactly `seq_len` tokens from `spec` (fewer, with a note, if it is short).

    Reading stops once the windows are full: at the end of a document, or inside one longer than
    PIECE_CHARS. The sha256 covers the text tokenised, so it is the old whole-document hash unless a
    document was left part-read (for one longer than PIECE_CHARS, which before was always read whole);
    `tokens` counts the tokens gathered. A bad line after the windows are full is not read, so not reported.
    """
    need = num_samples * seq_len
    stream: list[int] = []
    h = hashlib.sha256()
    used, content = 0, False
    with open_docs(spec) as (docs, source):
        enc = Encoder(model_dir)
        for doc in docs:
            used += 1
            if isinstance(doc, list):
                content = content or bool(doc)
            pieces = [enc.chat(doc)] if isinstance(doc, list) else [doc] if isinstance(doc, str) else doc
            for text, last in segments(pieces, PIECE_CHARS):
                content = content or (bool(text) and not text.isspace())
                h.update(text.encode("utf-8"))
                stream += enc.encode(text)
                if not last and len(stream) >= need:
                    break
            else:
                if enc.eos is not None:
                    stream.append(enc.eos)
                if len(stream) < need:
                    continue
            break
    if not content:
        raise DatasetError(f"{source}: the dataset is empty")
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
