# Everything a fresh machine needs: `make demo` and `make test` create .venv when missing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
OUT ?= out/tiny-qwen3
PROMPT ?= Once upon a time

# -v: every test's name as it starts (no silent stretch); the 15 slowest listed at the end.
# -n: test files spread over JOBS worker processes (pytest-xdist), each file whole on one worker so its
# module fixtures are built once. One process kept one of two cores busy on average (user+sys ≈ wall).
# JOBS: the CPUs, at most 4 (each worker builds the session's shared conversions again). JOBS=0: one process.
JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)
PYTEST := $(VENV)/bin/pytest -v --durations=15 -n $(JOBS) --dist loadfile
# Other float kernels for the tests whose outcome rests on rounding (marker `numerics`): ATen's
# portable non-SIMD kernels, MKL's conditional-reproducibility code path, one thread for torch and
# for ONNX Runtime. A test that only passes on one CPU kind fails here too.
OTHER_KERNELS := ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE OMP_NUM_THREADS=1 QWEN2OM_THREADS=1

.PHONY: install demo test test-fast test-numerics lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first, pinned: the CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,ray]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/qwen2om convert builtin:tiny-qwen3 -o $(OUT) --max-seq-len 512 --force
	$(VENV)/bin/qwen2om run $(OUT) --prompt "$(PROMPT)" --max-new-tokens 32 --greedy
	$(VENV)/bin/qwen2om verify $(OUT) --reference builtin:tiny-qwen3

test: install
	$(PYTEST)

test-fast: install
	$(PYTEST) -m "not slow"

test-numerics: install
	$(OTHER_KERNELS) $(PYTEST) -m numerics

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) bench/decode.py

clean:
	rm -rf out .pytest_cache
