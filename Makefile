# The two commands: `make run` (papermill reproduction, CPU/gloo default) and `make test`.
# Both create .venv and install everything on first use.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.cadlib-installed
RUN_ARGS ?=

.PHONY: run test test-unit test-notebooks lab venv lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml scripts/bootstrap.sh
	VENV=$(VENV) bash scripts/bootstrap.sh
	touch $@

run: $(STAMP)
	$(PY) scripts/reproduce.py $(RUN_ARGS)

test: test-unit test-notebooks

# pytest exits 5 when it collected no test; that is a failure for us (tests must exist), so no masking
# here -- the notebooks target below handles its own case explicitly.
test-unit: $(STAMP)
	$(PY) -m pytest -q tests

test-notebooks: $(STAMP)
	@nb=$$(find notebooks -name '*.ipynb' -not -path '*/.ipynb_checkpoints/*' | sort); \
	if [ -z "$$nb" ]; then echo "no notebooks to validate"; exit 0; fi; \
	$(PY) -m pytest -q -p no:cacheprovider --nbval-lax $$nb

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks

lint: $(STAMP)
	$(VENV)/bin/ruff check cadlib scripts tests

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
