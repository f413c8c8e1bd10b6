"""One model factory over both registries: ``create_model(name, **kw)`` (timm-style).

The ReID track's IDE model (:func:`~fedreid.models.reid.create_reid_model`,
a timm backbone + shared bottleneck + private identity head) and the
classification track's classifiers (:func:`~fedreid.models.classifiers.create_classifier`,
our registry first, then timm) are built through the same entry point; the
name says which, with a prefix as timm's ``hf-hub:`` does:

=====================  =====================================================
name                   builds
=====================  =====================================================
``reid:<backbone>``    ``create_reid_model(<backbone>, **kw)``: ``num_classes``
                       (0: no head, the server's model), ``pretrained``,
                       ``last_stride``, ``bottleneck_dim``, ``dropout``, ``seed``
``classifier:<name>``  ``create_classifier(<name>, **kw)``: ``num_classes``,
                       ``in_channels``, ``image_size``, ``seed``,
                       ``pretrained``, the architecture's options
anything else          a classifier, as ``classifier:<name>`` (``cnn_lmd``,
                       ``resnet18_cifar``, ``timm:<timm name>``, a timm name...)
=====================  =====================================================

A bare timm name (``resnet50``) is a classifier: the ReID model is always asked
for with ``reid:``, so one name never means two models. The underlying
factories stay public and unchanged; this is a thin dispatcher, so both
registries keep their own validation and error messages.

    >>> create_model("cnn_lmd", num_classes=10, in_channels=1, image_size=28, seed=0)   # doctest: +SKIP
    >>> create_model("reid:resnet50", num_classes=751, last_stride=1, seed=0)           # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Union

from fedreid.models.classifiers import (
    ClassificationModel,
    ModelConfigError,
    UnknownModelError,
    create_classifier,
    list_classifiers,
)
from fedreid.models.reid import ReIDModel, create_reid_model

#: Prefix of the ReID model's names: ``reid:<timm backbone>``.
REID_PREFIX = "reid:"
#: Optional prefix of a classifier's name: ``classifier:<name>``.
CLASSIFIER_PREFIX = "classifier:"


def create_model(name: str, **kw: Any) -> Union[ReIDModel, ClassificationModel]:
    """Build the model ``name`` (see the module docstring) with the keyword options of its factory.

    Raises :class:`~fedreid.models.classifiers.UnknownModelError` for an
    unknown classifier or an empty ``reid:`` backbone; the ReID factory's own
    errors (e.g. an unknown timm backbone) pass through unchanged; a
    classifier without ``num_classes`` raises
    :class:`~fedreid.models.classifiers.ModelConfigError`.
    """
    if not isinstance(name, str) or not name:
        raise UnknownModelError(f"model name must be a non-empty string, got {name!r}")
    if name.startswith(REID_PREFIX):
        backbone = name[len(REID_PREFIX):]
        if not backbone:
            raise UnknownModelError(f"model {name!r}: name a timm backbone after {REID_PREFIX!r}, e.g. 'reid:resnet50'")
        return create_reid_model(backbone, **kw)
    if name.startswith(CLASSIFIER_PREFIX):
        name = name[len(CLASSIFIER_PREFIX):]
    if "num_classes" not in kw:
        raise ModelConfigError(f"create_model({name!r}): a classifier needs num_classes=")
    return create_classifier(name, **kw)


def list_models() -> list[str]:
    """Our registered names: the classifiers, and ``reid:<backbone>`` as a pattern (any timm CNN)."""
    return [*list_classifiers(), f"{REID_PREFIX}<timm backbone>"]


__all__ = ["CLASSIFIER_PREFIX", "REID_PREFIX", "create_model", "list_models"]
