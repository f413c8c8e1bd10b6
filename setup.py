from pathlib import Path

from setuptools import find_packages, setup

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
        "faiss-cpu",
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
        # faiss-gpu replaces faiss-cpu: install with `pip uninstall faiss-cpu` first.
        "gpu": ["faiss-gpu-cu12"],
        "flower": ["flwr>=1.41,<2"],
        # Flower's simulation engine (Ray) for `tools/flower_fed.py simulate`.
        "flower-sim": ["flwr[simulation]>=1.41,<2"],
    },
    scripts=["tools/prepare_datasets.py", "tools/train_fed.py", "tools/eval_reid.py", "tools/flower_fed.py"],
)
