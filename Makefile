# Two entry points for a newcomer: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
CONFIG ?= config.example.yaml
# Test workers. The minutes-long crash drills run in two lanes (tests/conftest.py, DRILL_LANES: each an
# xdist group, so never more than two at once: they time their episodes); the third worker takes the
# other tests, which mostly wait on sockets and timers, and all three share what is left after.
PYTEST_WORKERS ?= 3

.PHONY: run serve test typecheck bench clean

$(VENV)/.installed-run: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[train]'
	touch $@

$(VENV)/.installed-test: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@ $(VENV)/.installed-run

# The main jobs: a checkpoint mid-episode, SIGKILL, restore, finish; then an RL loop through crashes.
run: $(VENV)/.installed-run
	$(VENV)/bin/tidelog demo --workdir demo-run
	$(VENV)/bin/tidelog demo-train --workdir demo-train-run

serve: $(VENV)/.installed-run
	$(VENV)/bin/tidelog --config $(CONFIG) migrate
	@echo "tidelog: serving with $(CONFIG); try: curl -s http://127.0.0.1:8470/v1/status"
	@echo "tidelog: participants: /v1/participants, audit trail: /v1/events or '$(VENV)/bin/tidelog --config $(CONFIG) events'"
	$(VENV)/bin/tidelog --config $(CONFIG) serve

# mypy runs beside the suite (its report is printed after it); either failing fails the target.
test: $(VENV)/.installed-test
	@$(PY) -m mypy > .mypy.out 2>&1 & mypy=$$!; \
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS); tests=$$?; \
	wait $$mypy; typed=$$?; echo "mypy:"; cat .mypy.out; rm -f .mypy.out; \
	test $$tests -eq 0 -a $$typed -eq 0

bench: $(VENV)/.installed-test
	$(PY) -m pip install --quiet -e '.[test,bench]'
	$(PY) bench/journal_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache tidelog.db tidelog.db-wal tidelog.db-shm demo-run demo-train-run
