"""Evaluation: retrieval metrics, exact search, feature extraction, pictures, re-ranking.

``fedreid.eval.metrics.evaluate`` is the entry point other code calls; the
submodules are imported lazily by their users (faiss, cv2 and matplotlib are
only needed by ``retrieval``, ``visualize``).
"""

from fedreid.eval.metrics import EvalDataError, accuracy, evaluate, evaluate_cuhk03_single_shot, evaluate_scores

__all__ = ["EvalDataError", "accuracy", "evaluate", "evaluate_cuhk03_single_shot", "evaluate_scores"]
