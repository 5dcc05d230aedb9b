# The two commands a newcomer needs: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
# requirements.txt (the whole stack: make run) is requirements/run.txt under the constraints;
# requirements/: base (every process), api, worker; run.txt (make run) and dev.txt (tests,
# benchmarks) gather them. requirements/constraints.txt pins everything they bring (Celery's
# billiard, vine, amqp, click...): every install here uses it (docs/upgrading.md).
CONSTRAINTS := requirements/constraints.txt
RUN_REQS := requirements.txt $(CONSTRAINTS) requirements/base.txt requirements/api.txt \
	requirements/worker.txt requirements/run.txt
RUN_STAMP := $(VENV)/.run-$(shell cat $(RUN_REQS) | cksum | cut -d' ' -f1)
# The benchmark's peer; it declares celery<5.7 but works on 5.7, so it goes in --no-deps (its
# version: the constraints').
DEV_STAMP := $(VENV)/.dev-$(shell cat $(RUN_REQS) requirements/dev.txt | cksum | cut -d' ' -f1)

.PHONY: run users reload test test-long test-setup test-tools docs bench bench-quick gameday gpu-check gpu-bench container-check clean

run: $(RUN_STAMP)
	scripts/run.sh

# As root: the system users IQ_RUN_USERS=separate runs each part as (iq-redis, iq-api,
# iq-worker, iq-deliverer, iq-flower: scripts/run_users.py); those that exist are kept.
users: $(RUN_STAMP)
	$(VENV)/bin/python -m scripts.run_users

# The models file taken up by the running stack without a restart (scripts/reload.py);
# FILE=path installs that file in its place first (a rollback: FILE=config/models.yaml.previous).
reload: $(RUN_STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/python -m scripts.reload $(FILE)

# The checkout's own bytecode first: every process the tests start then reads it (under
# PYTHONDONTWRITEBYTECODE each would compile what it imports anew: scripts/compile_env.py).
test: test-setup
	$(VENV)/bin/python -m scripts.compile_env --project
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(VENV)/bin/python -m pytest $(PYTEST_ARGS)

# The long checks `make test` leaves out (pytest.ini's `long` marker), a shorter one of each kind
# running there.
test-long: test-setup
	$(VENV)/bin/python -m scripts.compile_env --project
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(VENV)/bin/python -m pytest -m long $(PYTEST_ARGS)

# What the tests need, installed before they start: the environment (pip) and the system tools
# (apt-get) side by side, neither waiting on the other.
test-setup:
	@$(MAKE) --no-print-directory -j2 $(DEV_STAMP) test-tools

# The system tools the tests drive (Chromium, iptables, faketime), installed once before the
# tests as root (Debian); a test then fails, naming its tool, if one is still missing. The
# script needs only the standard library: it runs on the machine's Python, with no environment.
test-tools:
	$(PYTHON) -m scripts.test_tools

# The documentation site (mkdocs.yml, docs/), served with live reload on DOCS_ADDR; the tests
# build it with --strict (tests/integration/test_docs_site.py).
DOCS_ADDR ?= 127.0.0.1:8001
docs: $(DEV_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/python -m mkdocs serve --dev-addr $(DOCS_ADDR)

bench: $(DEV_STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/python -m bench $(BENCH_ARGS)

bench-quick: $(DEV_STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/python -m bench --quick $(BENCH_ARGS)

# Builds the images (Containerfile), starts compose.yaml's stack with podman, checks that it
# serves a job (scripts/container_check.sh).
container-check:
	scripts/container_check.sh

# The stack as make run starts it, under open-loop traffic, with a fault a minute (10 minutes;
# GAMEDAY_ARGS='--minutes 3 --faults redis-frozen,child-killed' to choose): bench/README.md.
gameday: $(DEV_STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(VENV)/bin/python -m bench.gameday $(GAMEDAY_ARGS)

gpu-check: $(RUN_STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/python -m scripts.gpu_check

# A short benchmark on a GPU host (~4 minutes): minilm-embed on the GPU (device auto), the
# service with one child and with two children on the device, beside the raw model on the same
# device; every point with the device's busy share. Its results go to GPU_BENCH_OUT, never into
# bench/README.md's CPU tables.
GPU_BENCH_OUT ?= var/gpu-bench
gpu-bench: $(DEV_STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/python -m bench --name gpu --models minilm-embed \
		--configs service two-children --clients 1 16 64 --duration 3 --rounds 2 --no-rss \
		--out $(GPU_BENCH_OUT) $(BENCH_ARGS)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip

$(RUN_STAMP): $(RUN_REQS) | $(VENV)/bin/python
	$(VENV)/bin/pip install -q -r requirements.txt
	touch $@

# The tests' environment is installed by uv (itself installed by pip, pinned), from where pip's
# configuration says packages come from (scripts/uv_install.py): ~10 s where pip took ~90 s of
# one core. Neither compiles what it installs: the environment's bytecode is compiled after, on
# every core (scripts/compile_env.py).
$(DEV_STAMP): $(RUN_REQS) requirements/dev.txt | $(VENV)/bin/python
	$(VENV)/bin/pip install -q -c $(CONSTRAINTS) uv
	$(VENV)/bin/python -m scripts.uv_install -c $(CONSTRAINTS) -r requirements/dev.txt
	$(VENV)/bin/python -m scripts.uv_install --no-deps -c $(CONSTRAINTS) celery-batches
	$(VENV)/bin/python -m scripts.compile_env
	touch $@ $(RUN_STAMP)

clean:
	rm -rf $(VENV) var .pytest_cache
