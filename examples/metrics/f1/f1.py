"""F1 as a local `evaluate` module, so the example scripts report it without the hub.

Same inputs and output as the hub's ``f1`` metric for the common cases: ``predictions``,
``references``, ``pos_label`` (default 1), ``average`` in ``"binary"`` (default), ``"micro"``,
``"macro"``, ``"weighted"`` or ``None`` (per label), optional ``sample_weight``; returns
``{"f1": float}`` (an array for ``average=None``). A label with no true and no predicted
positives has F1 0, as in scikit-learn with ``zero_division=0``.
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "F1 = 2 * precision * recall / (precision + recall), the harmonic mean of precision and recall."
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int): predicted labels.
    references (list of int): ground-truth labels.
    labels (list of int, optional): labels to include for multiclass averages (default: all seen).
    pos_label (int, default 1): the positive class for average="binary".
    average (str or None, default "binary"): "binary", "micro", "macro", "weighted" or None.
    sample_weight (list of float, optional): per-example weights.
Returns:
    f1 (float, or array of float for average=None)
Example:
    >>> metric = evaluate.load("examples/metrics/f1")
    >>> metric.compute(predictions=[0, 1, 1, 0], references=[0, 1, 0, 0])
    {'f1': 0.6666666666666666}
"""


def _f1(tp: float, fp: float, fn: float) -> float:
    denom = 2 * tp + fp + fn
    return 2 * tp / denom if denom else 0.0


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class F1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references, labels=None, pos_label=1, average="binary", sample_weight=None):
        pred = np.asarray(predictions)
        ref = np.asarray(references)
        w = np.ones(len(pred)) if sample_weight is None else np.asarray(sample_weight, dtype=float)
        if average == "binary":
            extra = sorted(set(np.unique(np.concatenate([pred, ref])).tolist()) - {0, 1, pos_label})
            if extra:
                raise ValueError(f"average='binary' needs binary labels; also saw {extra}. Pass average='macro'.")
            labels = [pos_label]
        elif labels is None:
            labels = sorted(np.unique(np.concatenate([pred, ref])).tolist())
        counts = []
        for label in labels:
            tp = float(np.sum(w * ((pred == label) & (ref == label))))
            fp = float(np.sum(w * ((pred == label) & (ref != label))))
            fn = float(np.sum(w * ((pred != label) & (ref == label))))
            counts.append((tp, fp, fn))
        if average == "binary":
            return {"f1": _f1(*counts[0])}
        if average == "micro":
            return {"f1": _f1(*(sum(c[i] for c in counts) for i in range(3)))}
        scores = np.array([_f1(*c) for c in counts])
        if average is None:
            return {"f1": scores}
        if average == "macro":
            return {"f1": float(scores.mean()) if len(scores) else 0.0}
        if average == "weighted":
            support = np.array([c[0] + c[2] for c in counts])
            return {"f1": float((scores * support).sum() / support.sum()) if support.sum() else 0.0}
        raise ValueError(f"average={average!r}; use 'binary', 'micro', 'macro', 'weighted' or None.")
