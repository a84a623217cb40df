# Everything a fresh machine needs: `make demo` and `make test` create .venv when missing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
OUT ?= out/tiny-qwen3
PROMPT ?= Once upon a time

.PHONY: install demo test test-fast lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first, pinned: the CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/qwen2om convert builtin:tiny-qwen3 -o $(OUT) --max-seq-len 512 --force
	$(VENV)/bin/qwen2om run $(OUT) --prompt "$(PROMPT)" --max-new-tokens 32 --greedy
	$(VENV)/bin/qwen2om verify $(OUT) --reference builtin:tiny-qwen3

test: install
	$(VENV)/bin/pytest -q

test-fast: install
	$(VENV)/bin/pytest -q -m "not slow"

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) bench/decode.py

clean:
	rm -rf out .pytest_cache
