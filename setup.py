import os
from pathlib import Path

from setuptools import find_packages, setup

# faiss-cpu and faiss-gpu ship the same `faiss` module, so only one may be
# installed: FEDREID_FAISS=gpu swaps the CPU build for the GPU one (see README, "On a GPU").
FAISS = {"cpu": "faiss-cpu", "gpu": "faiss-gpu-cu12"}
faiss_build = os.environ.get("FEDREID_FAISS", "cpu")
if faiss_build not in FAISS:
    raise SystemExit(f"FEDREID_FAISS={faiss_build!r}: expected one of {sorted(FAISS)}")

# Exporting to ONNX (torch.onnx's TorchScript-based exporter) and running exports with ONNX Runtime;
# tested with onnx 1.23.2 and onnxruntime 1.32.0.
ONNX = ["onnx>=1.16,<2", "onnxruntime>=1.18,<2"]
# The search service (`tools/eval_reid.py serve`); tested with fastapi 0.138.2, uvicorn 0.49.0,
# python-multipart 0.0.34.
SERVE = ["fastapi>=0.115", "uvicorn>=0.29", "python-multipart>=0.0.9"]

version = {}
exec((Path(__file__).parent / "fedreid" / "__init__.py").read_text(), version)

setup(
    name="fedreid",
    version=version["__version__"],
    description="Federated person re-identification and retrieval: FedPav, CDW, KD, FedFTG, FedLMD",
    long_description=Path("README.md").read_text() if Path("README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["fedreid", "fedreid.*"]),
    package_data={"fedreid.flower": ["project/pyproject.toml"], "fedreid.retrieval": ["web/*"]},
    install_requires=[
        "torch>=2.2",
        "torchvision",
        "timm",
        FAISS[faiss_build],
        "opencv-python-headless",
        "albumentations",
        "pyyaml",
        "tqdm",
        "numpy",
        "pillow",
        "matplotlib",
    ],
    extras_require={
        # tensorboard: the run logger's TensorBoard path is tested too.
        # onnx + onnxruntime: the exported-extractor tests (tests/inference/test_export.py) run in CI;
        # the service's tests need its packages, httpx (FastAPI's TestClient) and selenium (driving
        # Debian's chromium through /usr/bin/chromedriver; nothing is downloaded at run time).
        "test": ["pytest>=7", "scikit-learn", "ruff", "tensorboard", *ONNX, *SERVE, "httpx", "selenium>=4.10"],
        "tensorboard": ["tensorboard"],
        # `tools/eval_reid.py export --format onnx` and the onnx backend (ONNX Runtime, CPU).
        "onnx": ONNX,
        "serve": SERVE,
        # Install as `FEDREID_FAISS=gpu pip install -e .[gpu]` so that faiss-cpu is not
        # installed beside it (one `faiss` module, two packages would overwrite each other).
        "gpu": [FAISS["gpu"]],
        "flower": ["flwr>=1.41,<2"],
        # Flower's simulation engine (Ray) for `tools/flower_fed.py simulate`.
        "flower-sim": ["flwr[simulation]>=1.41,<2"],
    },
    # `fedreid <command>` (also `python -m fedreid <command>`) and one `fedreid-<command>` per tool,
    # the names of fedreid.commands.COMMANDS; tools/*.py run the same code from a checkout.
    entry_points={
        "console_scripts": [
            "fedreid=fedreid.__main__:cli",
            "fedreid-prepare=fedreid.commands.prepare_datasets:cli",
            "fedreid-train=fedreid.commands.train_fed:cli",
            "fedreid-eval=fedreid.commands.eval_reid:cli",
            "fedreid-reproduce=fedreid.commands.reproduce:cli",
            "fedreid-flower=fedreid.commands.flower_fed:cli",
        ],
    },
)
