"""fedreid: federated person re-identification and retrieval."""

import os

# albumentations asks PyPI for a newer version when it is first imported; offline
# (GPU boxes, air-gapped sites) that prints a warning on every tool run and waits on
# the network. The library never downloads anything at run time, so the check is off
# before any submodule can import albumentations. A user's explicit setting wins.
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

__version__ = "0.1.0"
