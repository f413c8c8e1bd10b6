import os
from pathlib import Path

from setuptools import find_packages, setup

# faiss-cpu and faiss-gpu ship the same `faiss` module, so only one may be
# installed: FEDREID_FAISS=gpu swaps the CPU build for the GPU one (see README, "On a GPU").
FAISS = {"cpu": "faiss-cpu", "gpu": "faiss-gpu-cu12"}
faiss_build = os.environ.get("FEDREID_FAISS", "cpu")
if faiss_build not in FAISS:
    raise SystemExit(f"FEDREID_FAISS={faiss_build!r}: expected one of {sorted(FAISS)}")

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
    package_data={"fedreid.flower": ["project/pyproject.toml"]},
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
        "test": ["pytest>=7", "scikit-learn", "ruff", "tensorboard"],
        "tensorboard": ["tensorboard"],
        # Install as `FEDREID_FAISS=gpu pip install -e .[gpu]` so that faiss-cpu is not
        # installed beside it (one `faiss` module, two packages would overwrite each other).
        "gpu": [FAISS["gpu"]],
        "flower": ["flwr>=1.41,<2"],
        # Flower's simulation engine (Ray) for `tools/flower_fed.py simulate`.
        "flower-sim": ["flwr[simulation]>=1.41,<2"],
    },
    scripts=["tools/prepare_datasets.py", "tools/train_fed.py", "tools/eval_reid.py", "tools/flower_fed.py"],
)
