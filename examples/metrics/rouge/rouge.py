"""ROUGE-1, ROUGE-2, ROUGE-L and ROUGE-Lsum as a local `evaluate` module, so the scripts score text offline.

``evaluate.load("rouge")`` needs the network and the ``rouge_score`` package; this module needs
neither. It follows Lin (2004), "ROUGE: A Package for Automatic Evaluation of Summaries", and the
definitions of Google's ``rouge_score``, which the hub metric wraps:

* **tokens**: the text lowercased, cut into maximal runs of letters and digits (punctuation,
  whitespace and ``_`` separate tokens); unlike ``rouge_score`` non-ASCII letters are kept;
* **ROUGE-N** (``rouge1``, ``rouge2``): clipped n-gram overlap; precision = overlap / candidate
  n-grams, recall = overlap / reference n-grams;
* **ROUGE-L** (``rougeL``): the longest common subsequence (LCS) of the two token sequences;
  precision = LCS / candidate tokens, recall = LCS / reference tokens;
* **ROUGE-Lsum** (``rougeLsum``): summary-level LCS, the texts split into sentences at newlines:
  for each reference sentence the union of its LCS with every candidate sentence, each token
  counted at most as often as it occurs in both texts;
* the score is the F-measure ``2PR / (P + R)`` (0 when both are 0). With several references per
  prediction, each type takes its best reference. ``use_aggregator=True`` (default) returns the
  mean over the examples; the hub metric returns the median of bootstrap means, which differs
  from the mean only by resampling noise.

No stemming: ``use_stemmer=True`` is refused (it needs NLTK's Porter stemmer).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Callable, Sequence

import datasets
import evaluate

_DESCRIPTION = "ROUGE-N and ROUGE-L (LCS) F-measures between generated and reference texts, as in rouge_score."
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): generated texts.
    references (list of str, or list of list of str): one reference per prediction, or several.
    rouge_types (list of str, optional): among "rouge1", "rouge2", "rougeL", "rougeLsum" (default: all four).
    use_aggregator (bool, default True): the mean over examples; if False, one score per example.
    use_stemmer (bool, default False): must be False; this offline module has no stemmer.
    tokenizer (callable, optional): text -> list of tokens, instead of the default.
Returns:
    rouge1, rouge2, rougeL, rougeLsum (float, or list of float with use_aggregator=False)
Example:
    >>> metric = evaluate.load("examples/metrics/rouge")
    >>> metric.compute(predictions=["the cat sat on the mat"], references=["the cat lay on the mat"],
    ...                rouge_types=["rouge1", "rougeL"])
    {'rouge1': 0.8333333333333334, 'rougeL': 0.8333333333333334}
"""

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")
_TOKEN = re.compile(r"[^\W_]+")


def tokenize(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


def f_measure(overlap: float, candidate_total: int, reference_total: int) -> float:
    precision = overlap / candidate_total if candidate_total else 0.0
    recall = overlap / reference_total if reference_total else 0.0
    return 2 * precision * recall / (precision + recall) if precision + recall else 0.0


def _ngrams(tokens: Sequence[str], n: int) -> Counter:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def rouge_n(candidate: Sequence[str], reference: Sequence[str], n: int) -> float:
    cand, ref = _ngrams(candidate, n), _ngrams(reference, n)
    overlap = sum((cand & ref).values())
    return f_measure(overlap, sum(cand.values()), sum(ref.values()))


def _lcs_table(a: Sequence[str], b: Sequence[str]) -> list[list[int]]:
    """``table[i][j]``: LCS length of ``a[:i]`` and ``b[:j]`` (dynamic programming, O(len(a) * len(b)))."""
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a, 1):
        row, above = table[i], table[i - 1]
        for j, y in enumerate(b, 1):
            row[j] = above[j - 1] + 1 if x == y else max(above[j], row[j - 1])
    return table


def rouge_l(candidate: Sequence[str], reference: Sequence[str]) -> float:
    lcs = _lcs_table(reference, candidate)[len(reference)][len(candidate)] if candidate and reference else 0
    return f_measure(lcs, len(candidate), len(reference))


def _lcs_positions(reference: Sequence[str], candidate: Sequence[str]) -> set[int]:
    """Positions in ``reference`` of one longest common subsequence with ``candidate``."""
    table = _lcs_table(reference, candidate)
    i, j, out = len(reference), len(candidate), set()
    while i and j:
        if reference[i - 1] == candidate[j - 1]:
            out.add(i - 1)
            i, j = i - 1, j - 1
        elif table[i - 1][j] >= table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return out


def rouge_lsum(candidate: str, reference: str, tokenizer: Callable[[str], list[str]]) -> float:
    cand_sents = [t for t in (tokenizer(s) for s in candidate.split("\n")) if t]
    ref_sents = [t for t in (tokenizer(s) for s in reference.split("\n")) if t]
    cand_counts = Counter(t for s in cand_sents for t in s)
    ref_counts = Counter(t for s in ref_sents for t in s)
    hits = 0
    for ref in ref_sents:
        union: set[int] = set()
        for cand in cand_sents:
            union |= _lcs_positions(ref, cand)
        for position in sorted(union):
            token = ref[position]
            if cand_counts[token] > 0 and ref_counts[token] > 0:
                hits += 1
                cand_counts[token] -= 1
                ref_counts[token] -= 1
    return f_measure(hits, sum(len(s) for s in cand_sents), sum(len(s) for s in ref_sents))


def score(candidate: str, reference: str, rouge_type: str, tokenizer: Callable[[str], list[str]] = tokenize) -> float:
    """The F-measure of one ``rouge_type`` for one candidate against one reference."""
    if rouge_type == "rougeLsum":
        return rouge_lsum(candidate, reference, tokenizer)
    cand, ref = tokenizer(candidate), tokenizer(reference)
    if rouge_type == "rougeL":
        return rouge_l(cand, ref)
    return rouge_n(cand, ref, int(rouge_type[len("rouge"):]))


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Rouge(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="Lin, C.-Y. (2004). ROUGE: A Package for Automatic Evaluation of Summaries. ACL workshop.",
            inputs_description=_KWARGS_DESCRIPTION,
            features=[
                datasets.Features(
                    {"predictions": datasets.Value("string"), "references": datasets.List(datasets.Value("string"))}
                ),
                datasets.Features({"predictions": datasets.Value("string"), "references": datasets.Value("string")}),
            ],
        )

    def _compute(self, predictions, references, rouge_types=None, use_aggregator=True, use_stemmer=False, tokenizer=None):
        rouge_types = list(ROUGE_TYPES if rouge_types is None else rouge_types)
        unknown = [t for t in rouge_types if t not in ROUGE_TYPES]
        if unknown:
            raise ValueError(f"rouge_types {unknown} are not supported; use some of {list(ROUGE_TYPES)}.")
        if use_stemmer:
            raise ValueError(
                "use_stemmer=True needs NLTK's Porter stemmer, which this offline module does not have; "
                "pass use_stemmer=False."
            )
        tokenizer = tokenizer or tokenize
        per_example: dict[str, list[float]] = {t: [] for t in rouge_types}
        for prediction, refs in zip(predictions, references):
            refs = [refs] if isinstance(refs, str) else list(refs)
            if not refs:
                raise ValueError(f"Prediction {prediction!r} has no reference.")
            for rouge_type in rouge_types:
                per_example[rouge_type].append(max(score(prediction, ref, rouge_type, tokenizer) for ref in refs))
        if not use_aggregator:
            return per_example
        return {t: sum(v) / len(v) if v else 0.0 for t, v in per_example.items()}
