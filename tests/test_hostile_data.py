"""Datasets and chat templates are untrusted (issue 21): bounded reading, special files, deep JSON,
runaway or failing templates. Each case ends in a DatasetError naming the file, never a hang."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

import qwen2om.datasets as ds
from qwen2om.datasets import DatasetError, windows

# Runs in a fresh interpreter: a warm-up read first (tokenizer loaded, caches filled), then the big
# file, with what it read (/proc/self/io), its peak RSS growth and its peak Python allocation.
MEASURE = textwrap.dedent("""
    import json, os, resource, sys, time, tracemalloc
    from qwen2om.datasets import windows
    big, small, model = sys.argv[1:4]
    windows(small, model, num_samples=1, seq_len=16)
    def rchar():
        if not os.path.exists("/proc/self/io"):
            return 0
        return int(dict(l.split(": ") for l in open("/proc/self/io").read().splitlines())["rchar"])
    rss, read, began = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, rchar(), time.monotonic()
    tracemalloc.start()
    w = windows(big, model, num_samples=1, seq_len=256)
    print(json.dumps({"samples": [len(s) for s in w.samples], "documents": w.documents,
                      "python_peak": tracemalloc.get_traced_memory()[1], "read": rchar() - read,
                      "rss_growth": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) * 1024,
                      "seconds": time.monotonic() - began}))
""")


def test_a_huge_one_line_file_gives_one_window_without_reading_it_all(tmp_path, checkpoint) -> None:
    """`eval ppl --max-windows 1` on a 100 MB one-line file took > 4 GB: the file was read whole and the
    whole line tokenised before windowing. Now it is read in blocks, tokenised in pieces, and left
    as soon as one window is full. (Memory is measured here only as a bound that fails the old way.)"""
    big = tmp_path / "one-line.txt"
    big.write_bytes(b"The quick brown fox jumps over the lazy dog; 0123 pack my box with five dozen jugs. " * 760_000)
    size = big.stat().st_size  # ~64 MB, no newline
    small = tmp_path / "small.txt"
    small.write_text("warm up the tokenizer " * 20)
    run = subprocess.run([sys.executable, "-c", MEASURE, str(big), str(small), str(checkpoint("tiny-qwen3"))],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    assert got["samples"] == [256] and got["documents"] == 1
    if sys.platform == "linux":  # the tokenizer.json (8 MB) is read again too; the text, a megabyte or so
        assert got["read"] < size / 2, got
    # ~20 MB: a megabyte of text and its ~250k token ids. The old read_bytes + decode alone held twice
    # the file, and its whole-line encode grew the process by tens of times the file.
    assert got["python_peak"] < size / 2 and got["rss_growth"] < 2 * size, got


def test_reading_stops_once_the_windows_are_full(tmp_path, checkpoint) -> None:
    """Lines after the windows are full are never read: a broken one there is not reached (it used to
    fail the run after every line had been parsed into memory)."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "enough words for two short windows " * 20}) + "\n{broken\n")
    w = windows(str(data), checkpoint("tiny-qwen3"), num_samples=2, seq_len=16)
    assert [len(s) for s in w.samples] == [16, 16] and w.documents == 1
    with pytest.raises(DatasetError, match=rf"^{data}:2: not valid JSON"):
        windows(str(data), checkpoint("tiny-qwen3"), num_samples=1000, seq_len=16)  # needs line 2


@pytest.mark.parametrize("spec", ["builtin:prose", "builtin:code", "text"])
def test_long_documents_are_cut_without_changing_a_token(spec: str, tmp_path, checkpoint, monkeypatch) -> None:
    """Cut into pieces of 2,000 characters, every document tokenises to the same ids as whole, and when
    all of it is read the sha256 is the whole-document one (recorded in calibration reports)."""
    if spec == "text":
        path = tmp_path / "prose.txt"
        path.write_text("\n\n".join(ds.prose_docs()[:60]), encoding="utf-8")
        spec = str(path)
    model = checkpoint("tiny-qwen3")
    whole = windows(spec, model, num_samples=10_000, seq_len=64)
    monkeypatch.setattr(ds, "PIECE_CHARS", 2000)
    cut = windows(spec, model, num_samples=10_000, seq_len=64)
    assert cut.samples == whole.samples and cut.sha256 == whole.sha256 and cut.tokens == whole.tokens
    few = windows(spec, model, num_samples=2, seq_len=64)
    assert few.samples == whole.samples[:2]


def test_segments_join_back_and_stay_under_the_limit() -> None:
    text = "word " * 1000 + "x" * 5000 + "\nline\n" * 300
    parts = list(ds.segments(iter([text[:777], text[777:]]), 1000))
    assert "".join(t for t, _ in parts) == text
    assert all(0 < len(t) <= 1000 for t, _ in parts) and [last for _, last in parts][-1]
    assert not any(last for _, last in parts[:-1])
    assert list(ds.segments(iter(["short"]), 1000)) == [("short", True)]
    assert list(ds.segments(iter([]), 1000)) == [("", True)]


def test_text_read_in_tiny_blocks_reports_the_same_line_and_byte(tmp_path, checkpoint, monkeypatch) -> None:
    """Blocks split lines and multi-byte characters; errors still name the line and the byte in it."""
    model = checkpoint("tiny-qwen3")
    good = tmp_path / "good.txt"
    good.write_text("héllo wörld — 汉字 ok\n" * 40, encoding="utf-8")
    whole = windows(str(good), model, num_samples=4, seq_len=16)
    monkeypatch.setattr(ds, "READ_BYTES", 3)
    assert windows(str(good), model, num_samples=4, seq_len=16).samples == whole.samples
    bad = tmp_path / "bad.txt"
    bad.write_bytes("first ünïcode line\n".encode() * 3 + b"fourth caf\xe9 line\n")
    with pytest.raises(DatasetError, match=rf"^{bad}:4: not UTF-8 text \(byte 10: b'\\xe9'\)$"):
        windows(str(bad), model, num_samples=99, seq_len=16)
    bad.write_bytes(b"abc\ndef\xc3")  # ends inside a character
    with pytest.raises(DatasetError, match=rf"^{bad}:2: not UTF-8 text \(byte 3: b'\\xc3'\)$"):
        windows(str(bad), model, num_samples=99, seq_len=16)


def within(seconds: float, fn: Callable[[], object]) -> BaseException | None:
    """Run `fn` in a daemon thread; the exception it raised, failing the test if it is still blocked."""
    caught: list[BaseException | None] = [None]

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            caught[0] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still blocked after {seconds} s"
    return caught[0]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_special_files_are_refused_before_they_are_opened(tmp_path, checkpoint, cli) -> None:
    """A FIFO was reported as "not found" (and one that passed the check would block on open)."""
    model = checkpoint("tiny-qwen3")
    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    e = within(10, lambda: windows(str(fifo), model, num_samples=1, seq_len=8))
    assert isinstance(e, DatasetError) and str(e).startswith(f"{fifo}: not a regular file (a FIFO)"), e
    link = tmp_path / "link.txt"
    link.symlink_to(fifo)
    e = within(10, lambda: windows(str(link), model, num_samples=1, seq_len=8))
    assert isinstance(e, DatasetError) and "not a regular file (a FIFO)" in str(e), e
    if Path("/dev/null").exists():
        e = within(10, lambda: windows("/dev/null", model, num_samples=1, seq_len=8))
        assert isinstance(e, DatasetError) and "/dev/null: not a regular file (a character device)" in str(e), e
    with pytest.raises(DatasetError, match="is a directory, not a regular file"):
        windows(str(tmp_path), model, num_samples=1, seq_len=8)
    with pytest.raises(DatasetError, match="dataset file not found"):
        windows(str(tmp_path / "missing.txt"), model, num_samples=1, seq_len=8)
    # Through the CLI: one line, exit 2, and refused before the model is loaded.
    code, _, err = cli("eval", "ppl", "builtin:tiny-qwen3", "--dataset", fifo, "--max-windows", "1")
    assert code == 2 and f"{fifo}: not a regular file (a FIFO)" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_hostile_json_lines_name_their_line(tmp_path, checkpoint) -> None:
    """A 200k-deep `[[[…` raised RecursionError; an integer past Python's digit limit, ValueError."""
    model = checkpoint("tiny-qwen3")
    data = tmp_path / "deep.jsonl"
    data.write_text('{"text": "hi"}\n' + "[" * 200_000 + "]" * 200_000 + "\n")
    with pytest.raises(DatasetError, match=rf"^{data}:2: not valid JSON \(nested too deeply\)$"):
        windows(str(data), model, num_samples=1, seq_len=64)
    data.write_text('{"text": "hi", "n": ' + "9" * 5000 + "}\n")
    with pytest.raises(DatasetError, match=rf"^{data}:1: not valid JSON"):
        windows(str(data), model, num_samples=1, seq_len=64)


# -- chat templates ------------------------------------------------------------------------------
CHAT = json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]})


def tokenizer_with(tmp_path: Path, checkpoint: Callable[[str], Path], template: str,
                   jinja: str | None = None) -> Path:
    """A tokenizer directory (tiny-qwen3's) whose tokenizer_config.json carries `template`, and
    optionally a chat_template.jinja (which transformers prefers)."""
    src, out = checkpoint("tiny-qwen3"), tmp_path / "tok"
    out.mkdir()
    shutil.copy(src / "tokenizer.json", out)
    config = json.loads((src / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    if jinja is not None:
        (out / "chat_template.jinja").write_text(jinja)
    return out


RUNAWAY = textwrap.dedent("""
    import sys, time
    import qwen2om.datasets as ds
    ds.TEMPLATE_SECONDS = 2
    began = time.monotonic()
    try:
        ds.windows(sys.argv[1], sys.argv[2], num_samples=1, seq_len=4)
    except ds.DatasetError as e:
        print(f"{time.monotonic() - began:.1f}", e)
""")


def test_a_runaway_chat_template_is_stopped_and_named(tmp_path, checkpoint) -> None:
    """10^10 loop iterations used to render forever; the render is now cut off at TEMPLATE_SECONDS."""
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"
    model = tokenizer_with(tmp_path, checkpoint, loops)
    data = tmp_path / "chat.jsonl"
    data.write_text(CHAT + "\n")
    run = subprocess.run([sys.executable, "-c", RUNAWAY, str(data), str(model)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    seconds, message = run.stdout.strip().split(" ", 1)
    assert message == (f"{model / 'tokenizer_config.json'}: the chat template did not finish rendering one "
                       "conversation in 2 s"), run.stdout
    assert float(seconds) < 60


@pytest.mark.parametrize(("template", "jinja", "file", "says"), [
    ("{{ raise_exception('no system role here') }}", None, "tokenizer_config.json",
     "the chat template failed: no system role here"),
    ("{{ messages[0]['content'] }}", "{{ raise_exception('from the jinja file\x1b[2J') }}", "chat_template.jinja",
     r"the chat template failed: from the jinja file\x1b[2J"),
    ("{% for m in messages %}{{ m.content }}", None, "tokenizer_config.json",
     "the chat template has a syntax error (template line 1: Unexpected end of template"),
    ("{{ 1 / 0 }}", None, "tokenizer_config.json", "the chat template failed (ZeroDivisionError: division by zero)"),
], ids=["raise_exception", "jinja-file", "syntax-error", "zero-division"])
def test_a_failing_chat_template_is_named(template: str, jinja: str | None, file: str, says: str, tmp_path,
                                          checkpoint) -> None:
    """These raised jinja2's exceptions through transformers: a traceback, not an error. Escape sequences
    in a template's message are printed escaped."""
    model = tokenizer_with(tmp_path, checkpoint, template, jinja)
    data = tmp_path / "chat.jsonl"
    data.write_text(CHAT + "\n")
    with pytest.raises(DatasetError) as e:
        windows(str(data), model, num_samples=1, seq_len=4)
    assert str(e.value).startswith(f"{model / file}: {says}"), str(e.value)


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="no interval timers on this platform")
def test_the_time_limit_leaves_an_outer_alarm_and_other_threads_alone(tmp_path, checkpoint) -> None:
    model = tokenizer_with(tmp_path, checkpoint, "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    data = tmp_path / "chat.jsonl"
    data.write_text(CHAT + "\n")
    fired: list[int] = []

    def outer(signum: int, frame: object) -> None:
        fired.append(signum)

    old = signal.signal(signal.SIGALRM, outer)
    try:
        signal.setitimer(signal.ITIMER_REAL, 600)
        w = windows(str(data), model, num_samples=1, seq_len=4)
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 0 < remaining <= 600 and not fired  # put back, still counting down
        assert signal.getsignal(signal.SIGALRM) is outer
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    # Off the main thread there is no signal to use: the render runs without a limit, and works.
    got: list[list[list[int]]] = []
    assert within(60, lambda: got.append(windows(str(data), model, num_samples=1, seq_len=4).samples)) is None
    assert got == [w.samples]

