"""The trained builtins (`builtin:tiny-qwen3-trained`, `-code`, `-zh`): each committed checkpoint loads, has
learned, and is reproducible."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer

from qwen2om.builtin import builtin_names, cache_root, resolve_model
from qwen2om.fixtures import trained
from qwen2om.fixtures.tokenizer import format_chatml
from qwen2om.fixtures.trained import Corpus

# Held-out perplexity of each committed model (fp32 compute on the bf16 weights; the window count and
# the rest are in fixtures/data/NAME.json), the bound a test run must beat, and a prompt to continue.
# The bounds leave 1.6x for another Python's stdlib or another Debian's zh_CN pages and catalogs (a
# partly different held-out text) and another CPU's float rounding; a random model scores about its
# vocabulary size (3,072 / 4,096 / 6,144), more than 10x any bound.
PPL_MEASURED = 151.9  # tiny-qwen3-trained, 35 windows of 256 tokens (8,925 scored) on Python 3.11.7
PPL_BOUND = 250.0
CODE_PPL = 141.8  # tiny-qwen3-code, 83 windows (21,165 scored), Python 3.11.7; untrained 4,250
ZH_PPL = 305.4  # tiny-qwen3-zh, 190 windows (48,450 scored), Debian 12.11; untrained 6,458


@dataclasses.dataclass(frozen=True)
class Case:
    corpus: Corpus
    ppl_measured: float
    ppl_bound: float
    prompt: str
    differs: str  # why the text may differ from the recorded one


CASES = [
    Case(trained.PROSE, PPL_MEASURED, PPL_BOUND, "The assert statement",
         "this Python's topics.py and docstrings differ from the ones the weights were trained on"),
    Case(trained.CODE, CODE_PPL, CODE_PPL * 1.6, "def main():\n    ",
         "this Python's stdlib sources differ from the ones the weights were trained on"),
    Case(trained.ZH, ZH_PPL, ZH_PPL * 1.6, "显示帮助信息",
         "this machine's zh_CN man pages or gettext catalogs differ from the ones the weights were trained on"),
]


@pytest.fixture(scope="module", params=CASES, ids=[c.corpus.name for c in CASES])
def case(request: pytest.FixtureRequest) -> Case:
    return request.param


@pytest.fixture(scope="module")
def ckpt(case: Case) -> Path:
    return resolve_model(f"builtin:{case.corpus.name}")


@pytest.fixture(scope="module")
def model(ckpt: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(ckpt: Path) -> Tokenizer:
    return Tokenizer.from_file(str(ckpt / "tokenizer.json"))


def test_builtin_resolves_to_a_copy_of_the_committed_files(case: Case, ckpt: Path) -> None:
    corpus = case.corpus
    assert corpus.name in builtin_names()
    assert ckpt.is_relative_to(cache_root())  # a copy: nothing writes into the package
    record = trained.committed_record(corpus)
    for name in trained.CHECKPOINT_FILES:
        assert hashlib.sha256((ckpt / name).read_bytes()).hexdigest() == record["files"][name], name
    assert (corpus.data_dir / "model.safetensors").stat().st_size <= 10_000_000
    assert resolve_model(f"builtin:{corpus.name}") == ckpt  # cached


def test_transformers_loads_it(case: Case, ckpt: Path, model: transformers.PreTrainedModel) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"] is True
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.vocab_size == case.corpus.vocab_size and model.config.vocab_size % 128 == 0
    assert (model.config.num_hidden_layers, model.config.hidden_size, model.config.head_dim) == (4, 256, 64)


def test_split_is_disjoint_and_matches_the_recorded_text(case: Case) -> None:
    corpus = case.corpus
    train, held = corpus.train_text(), corpus.heldout_text()
    if corpus is trained.PROSE:
        held_paras = held.split("\n\n")
        topic_paras = {p.strip("\n") for doc in trained._topics() for p in doc.split("\n\n")} - {""}
        assert 0.07 < len(held_paras) / len(topic_paras) < 0.13  # ~1 in 10 by hash
        assert not [p for p in held_paras if len(p) > 40 and p in train]
    elif corpus is trained.CODE:  # chunks: bucket 0 of 100 held out, 10-29 trained on
        assert 0.02 < len(held) / len(train) < 0.08
        assert "def " in held and "class " in held
    else:  # paragraphs: 1 in 10 held out; the man pages' held-out ones come first
        assert 0.07 < len(held) / len(train) < 0.16
        assert sum("\u4e00" <= c <= "\u9fff" for c in held) > len(held) / 3
        man = trained._zh_man_pages()
        man_held = [p for page in man for p in page.split("\n\n") if p.strip("\n") and trained._held_out(p)]
        assert man_held and held.startswith(man_held[0].strip("\n"))
        assert not [p for p in man_held if len(p) > 40 and p.strip("\n") in train]
    recorded = trained.committed_record(corpus)["text"]
    if trained.sha256_text(train) != recorded["train_sha256"]:
        pytest.skip(f"{case.differs} (Python {trained.committed_record(corpus)['python']})")
    assert trained.sha256_text(held) == recorded["heldout_sha256"]


@pytest.mark.numerics
def test_heldout_perplexity_is_far_below_random(case: Case, model: transformers.PreTrainedModel,
                                                tok: Tokenizer) -> None:
    text = case.corpus.heldout_text()
    ids = torch.tensor(tok.encode(text).ids)
    # At most 40 windows: the prose text has 35; the Chinese one's 190 took a minute (twice in CI: the
    # numerics lane runs it again on one thread), and 40 windows (10k tokens) already bound it.
    ppl, scored, windows = trained.perplexity(model, ids, max_windows=40)
    assert windows >= 20 and scored == windows * (trained.SEQ_LEN - 1)
    # The zh text comes from the installed zh_CN man pages and gettext catalogs, which another machine's
    # packages change (CI installs manpages-zh where zh_CN is missing): on another text, the bound is
    # "learned", a quarter of the vocabulary (random weights score about the vocabulary size).
    same = trained.sha256_text(text) == trained.committed_record(case.corpus)["text"]["heldout_sha256"]
    bound = case.ppl_bound if same else max(case.ppl_bound, case.corpus.vocab_size / 4)
    assert ppl < bound, f"held-out perplexity {ppl:.1f} over {scored} tokens ({windows} windows)"
    torch.manual_seed(0)
    random = transformers.Qwen3ForCausalLM(model.config).eval()
    assert trained.perplexity(random, ids, max_windows=4)[0] > 10 * case.ppl_bound
    assert ppl > case.ppl_measured / 1.6 or not same  # far lower would mean held-out text leaked into training


def test_tokenizer_round_trips_and_has_the_chatml_specials(case: Case, ckpt: Path, tok: Tokenizer) -> None:
    corpus = case.corpus
    text = corpus.heldout_text()[:5000] + "\nnon-ASCII: café, 漢字, emoji 🙂\n"
    assert tok.decode(tok.encode(text).ids) == text
    assert [tok.token_to_id(s) for s in trained.SPECIALS] == [corpus.endoftext_id, corpus.im_start_id,
                                                              corpus.im_end_id]
    auto = transformers.AutoTokenizer.from_pretrained(ckpt)
    assert auto(text)["input_ids"] == tok.encode(text).ids
    assert (auto.eos_token_id, auto.pad_token_id, len(auto)) == (corpus.im_end_id, corpus.endoftext_id,
                                                                  corpus.vocab_size)
    messages = [{"role": "user", "content": "What does assert do?"}]
    rendered = auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == format_chatml(messages)
    ids = tok.encode(rendered).ids
    assert ids[0] == corpus.im_start_id and ids.count(corpus.im_end_id) == 1


@pytest.mark.numerics
def test_greedy_generation_is_not_degenerate(case: Case, model: transformers.PreTrainedModel,
                                             tok: Tokenizer) -> None:
    prompt = torch.tensor([tok.encode(case.prompt).ids])
    out = model.generate(prompt, max_new_tokens=32, do_sample=False)[0, prompt.shape[1]:].tolist()
    text = tok.decode(out)
    # Committed prose weights: "The assert statement.\n\nThe default of the same argument is a string of
    # the same..." (15 distinct tokens of 32, none more than 4 times). A stuck model repeats one token.
    assert len(out) == 32 and len(set(out)) >= 8, text
    assert max(out.count(t) for t in set(out)) <= 12, text


def test_tokenizer_and_training_are_deterministic(case: Case) -> None:
    """The full regeneration takes minutes (`python -m qwen2om.fixtures.trained --corpus NAME --check`);
    these are the cheap parts: the tokenizer retrains bit-exact, and two short training runs agree bit for bit."""
    corpus = case.corpus
    text = corpus.train_text()
    tok = trained.train_tokenizer(text, corpus)
    if trained.sha256_text(text) == trained.committed_record(corpus)["text"]["train_sha256"]:
        committed = Tokenizer.from_file(str(corpus.data_dir / "tokenizer.json"))
        assert tok.to_str() == committed.to_str()
    config_text = json.dumps(trained._tokenizer_config(corpus), indent=2) + "\n"
    assert config_text == (corpus.data_dir / "tokenizer_config.json").read_text()
    ids = torch.tensor(tok.encode(text[:20_000]).ids)
    states = []
    for _ in range(2):
        with trained.deterministic_torch(corpus.threads):
            model = trained.build_model(corpus)
            losses = trained.train(model, ids, steps=2, batch=1)
        states.append((losses, [p.detach().clone() for p in model.parameters()]))
    assert states[0][0] == states[1][0]
    assert all(torch.equal(a, b) for a, b in zip(states[0][1], states[1][1], strict=True))
