# fedmq: two commands do all set-up: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
EXTRAS ?= cpu,dev
STAMP  := $(VENV)/.installed

.PHONY: demo test bench lint venv mosquitto clean help soak

help:
	@echo "make demo   - create .venv, install, run a small simulated fleet over a real broker"
	@echo "make test   - create .venv, install, make sure mosquitto exists, run the whole suite"
	@echo "make bench  - run the benchmarks, figures go to bench/results/*.json"
	@echo "make lint   - ruff"

venv: $(STAMP)

# Reinstall when the project's requirements change.
$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e ".[$(EXTRAS)]"
	@touch $(STAMP)

mosquitto:
	@$(PYTHON) scripts/ensure_test_tools.py

demo: venv
	$(VENV)/bin/fedmq demo $(DEMO_ARGS)

# Three workers on two cores: the tests wait on brokers and subprocesses, so one worker took
# 17 min and two 11.5; with three both cores are ~92 % busy (pytest 711 s against 751-765 s
# with two, same commit, idle machine). worksteal evens out the long documented-command tests.
# No cache provider: a run leaves no .pytest_cache in the checkout.
PYTEST_ARGS ?= -n 3 --dist worksteal -p no:cacheprovider

# The venv (pip, ~1.5 min for torch on a fresh machine) and the test tools (apt: Mosquitto,
# RabbitMQ, Prometheus) are independent: made side by side.
test:
	@$(MAKE) --no-print-directory -j2 venv mosquitto
	$(VENV)/bin/ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

bench: venv mosquitto
	$(PY) -m bench $(BENCH_ARGS)

# Long fault, fuzz and load runs (docs/reliability.md); figures go to soak/results/*.json.
soak: venv mosquitto
	$(PY) -m soak.kill_aggregator --agents 20 --updates 30 --kills 20
	$(PY) -m soak.fuzz_uplink --messages 50000
	$(PY) -m soak.load_burst --agents 1000
	$(PY) -m soak.broker_window
	$(PY) -m soak.flood_fairness
	$(PY) -m soak.poisoning
	$(PY) -m soak.attacks
	$(PY) -m soak.cluster_failover
	$(PY) -m soak.cluster_fleet

lint: venv
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
