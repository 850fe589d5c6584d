"""Accuracy as a local `evaluate` module, so the example scripts report it without the hub.

``evaluate.load("accuracy")`` needs the network (the pip package ships no metric scripts);
``evaluate.load("examples/metrics/accuracy")`` loads this file instead. Same inputs and output
as the hub's ``accuracy`` metric: ``predictions``, ``references``, optional ``sample_weight``
and ``normalize``; returns ``{"accuracy": float}``.
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "The fraction of predictions equal to their reference: (TP + TN) / N for binary labels."
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int): predicted labels.
    references (list of int): ground-truth labels.
    normalize (bool, default True): return the fraction correct; if False, the (weighted) count.
    sample_weight (list of float, optional): per-example weights.
Returns:
    accuracy (float)
Example:
    >>> metric = evaluate.load("examples/metrics/accuracy")
    >>> metric.compute(predictions=[0, 1, 1], references=[0, 1, 0])
    {'accuracy': 0.6666666666666666}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        predictions = np.asarray(predictions)
        references = np.asarray(references)
        if predictions.shape != references.shape:
            raise ValueError(f"predictions {predictions.shape} and references {references.shape} differ in shape.")
        weights = np.ones(len(predictions)) if sample_weight is None else np.asarray(sample_weight, dtype=float)
        correct = float(np.sum(weights * (predictions == references)))
        if not normalize:
            return {"accuracy": correct}
        total = float(np.sum(weights))
        return {"accuracy": correct / total if total else 0.0}
