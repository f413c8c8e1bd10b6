"""Model -> features, and nothing else: model files, batched extraction, exported extractors, images, devices.

* :mod:`fedreid.inference.model_io`: run folder / model file -> model, fingerprint, features of a loader;
* :mod:`fedreid.inference.features`: batched extraction (flip, L2, AMP, channels-last), the ``.npz`` format;
* :mod:`fedreid.inference.embed`: ``model.embed`` as a module, dataset batches in the extraction's loader contract;
* :mod:`fedreid.inference.dataset_features`: prepared datasets -> query/gallery features, their cache;
* :mod:`fedreid.inference.images`: image files, folders and in-memory images -> features, unreadable images;
* :mod:`fedreid.inference.export`: ONNX/TorchScript feature extractors and their runners;
* :mod:`fedreid.inference.devices`: the torch device and its CUDA speedups;
* :mod:`fedreid.inference.errors`: :class:`~fedreid.inference.errors.EvalInputError`.

Nothing here imports :mod:`fedreid.eval`, :mod:`fedreid.retrieval` or
:mod:`fedreid.fl`. Importing this package imports no submodule (and no torch).
"""
