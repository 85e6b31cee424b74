# Two entry points that work on a fresh clone: `make demo` and `make test`.
# Each creates the virtual environment it needs (./.venv) on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-all bench venv clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[dev]'
	# The authors' own code the converter tests compare against (tests/test_convert.py):
	# Megvii's yolox sdist imports torch in its setup.py, so it builds without isolation.
	$(PY) -m pip install loguru thop opencv-python-headless
	$(PY) -m pip install --no-build-isolation --no-deps yolox==0.3.0
	touch $(STAMP)

venv: $(STAMP)

# The main job: train PP-YOLOE-s on the built-in demo dataset (GPU if present, else CPU)
# and print its COCO AP.
demo: $(STAMP)
	$(PY) -m fastdet.train --arch ppyoloe --size s --data demo --output-dir runs/demo

# The suite CI runs: everything but the tests marked slow (whole-model inductor builds and
# the ONNX exports of every family), which `make test-all` adds. Test files run in
# parallel, one pytest-xdist worker a core (`make test TEST_WORKERS=0`: one process);
# --dist loadfile keeps a file's tests, and the checkpoints its fixtures train, together;
# --no-loadscope-reorder starts the files in collection order, where tests/conftest.py
# puts the longest first.
TEST_WORKERS ?= auto
TEST_FLAGS = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(TEST_FLAGS) tests

test-all: $(STAMP)
	$(PY) -m pytest -q $(TEST_FLAGS) tests

bench: $(STAMP)
	$(PY) bench/throughput.py --quick

clean:
	rm -rf $(VENV) runs build *.egg-info
