# The two commands: `make run` (papermill reproduction, CPU/gloo default) and `make test`.
# Both create .venv and install everything on first use. `make test-browser` runs the workbook in
# JupyterLab in chromium; `make report` refreshes the committed CPU report in results/reports/ and the
# executed notebooks' HTML beside it (results/reports/notebooks/).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.cadlib-installed
RUN_ARGS ?=
# pytest workers (pytest-xdist): one per core, at most 4, as the multi-process tests start up to 8 ranks each
TEST_WORKERS ?= auto
XDIST  := -n $(TEST_WORKERS) --maxprocesses=4

.PHONY: run report test test-layers test-wheel test-unit test-notebooks test-browser browser lab venv lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml scripts/bootstrap.sh
	VENV=$(VENV) bash scripts/bootstrap.sh
	touch $@

run: $(STAMP)
	$(PY) scripts/reproduce.py $(RUN_ARGS)

report: $(STAMP)
	$(PY) scripts/reproduce.py --profile cpu --publish results/reports

test: test-layers test-wheel test-unit test-notebooks

# the one-way layers of pyproject.toml's [tool.importlinter] contracts (docs/design.md)
test-layers: $(STAMP)
	$(VENV)/bin/lint-imports --no-cache

# the wheel built from this checkout holds every module and imports them from where it is installed
test-wheel: $(STAMP)
	$(PY) scripts/check_wheel.py

# pytest exits 5 when it collected no test; that is a failure for us (tests must exist), so no masking
# here -- the notebooks target below handles its own case explicitly.
test-unit: $(STAMP)
	$(PY) -m pytest -q $(XDIST) --dist worksteal tests

test-notebooks: $(STAMP)
	@nb=$$(find notebooks -name '*.ipynb' -not -path '*/.ipynb_checkpoints/*' | sort); \
	if [ -z "$$nb" ]; then echo "no notebooks to validate"; exit 0; fi; \
	$(PY) -m pytest -q -p no:cacheprovider $(XDIST) --dist loadscope --nbval-lax $$nb

# Debian's chromium (installed when missing; CI runs as root) driven by the playwright package of the
# dev extra, pointed at that browser: no browser download.
test-browser: $(STAMP) browser
	CADLIB_BROWSER_TEST=1 $(PY) -m pytest -q -p no:cacheprovider tests/test_browser.py

browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" -eq 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q chromium; }

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks

lint: $(STAMP)
	$(VENV)/bin/ruff check cadlib scripts tests

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
