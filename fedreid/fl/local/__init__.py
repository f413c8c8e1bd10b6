"""Client-side objectives. ``sgd``: plain cross-entropy SGD (FedPav's client)."""

from fedreid.fl.local.sgd import LocalResult, build_optimizer, epoch_lr_scale, train_local

#: Local objectives by name.
LOCAL_OBJECTIVES = {"sgd": train_local}

__all__ = ["LOCAL_OBJECTIVES", "LocalResult", "build_optimizer", "epoch_lr_scale", "train_local"]
