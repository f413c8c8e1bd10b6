"""Models: timm backbones, the FedReID IDE model (shared backbone + bottleneck, private head),
classifiers for the classification track; :func:`create_model` builds either by name
(``"reid:resnet50"``, ``"cnn_lmd"``, see :mod:`fedreid.models.factory`)."""

from fedreid.models.backbones import (
    BackboneError,
    PretrainedWeightsError,
    UnknownBackboneError,
    create_backbone,
    load_pretrained,
    read_state_dict,
    set_last_stride,
    torchvision_to_timm,
)
from fedreid.models.classifiers import (
    ClassificationModel,
    ModelConfigError,
    UnknownModelError,
    count_parameters,
    create_classifier,
    list_classifiers,
    register_classifier,
)
from fedreid.models.factory import CLASSIFIER_PREFIX, REID_PREFIX, create_model, list_models
from fedreid.models.reid import (
    PRIVATE_PREFIXES,
    SHARED_PREFIXES,
    ReIDModel,
    StateMismatchError,
    create_reid_model,
    load_shared_state,
    private_state,
    replace_classifier,
    shared_state,
)

__all__ = [
    "CLASSIFIER_PREFIX",
    "REID_PREFIX",
    "create_model",
    "list_models",
    "ClassificationModel",
    "ModelConfigError",
    "UnknownModelError",
    "count_parameters",
    "create_classifier",
    "list_classifiers",
    "register_classifier",
    "PRIVATE_PREFIXES",
    "SHARED_PREFIXES",
    "BackboneError",
    "PretrainedWeightsError",
    "ReIDModel",
    "UnknownBackboneError",
    "StateMismatchError",
    "create_backbone",
    "create_reid_model",
    "load_pretrained",
    "load_shared_state",
    "private_state",
    "read_state_dict",
    "replace_classifier",
    "set_last_stride",
    "shared_state",
    "torchvision_to_timm",
]
