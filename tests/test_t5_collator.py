"""T5 span corruption (examples/t5_span_corruption.py) against the T5 reference behaviour.

* lengths: `compute_input_and_target_lengths` against values worked out from T5's
  ``random_spans_helper`` and against a brute-force search, and every collated row has exactly
  those lengths;
* reconstruction: substituting each sentinel of the input by the span the target gives for it
  recovers the original block, for many random masks and settings;
* statistics: the noise fraction and the mean span length are honoured over many samples, spans
  land uniformly away from the block's edges, and span lengths vary;
* the collator works with a real tokenizer (the embedded Unigram one with 100 sentinels).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

from t5_span_corruption import (  # noqa: E402
    DataCollatorForT5SpanCorruption,
    compute_input_and_target_lengths,
    corrupt_spans,
    random_spans_noise_mask,
)

EOS = 1
PAD = 0
SENTINELS = list(range(1000, 1100))  # ids that never occur as ordinary tokens below


def reconstruct(inputs: list[int], targets: list[int], sentinels: list[int], eos: int) -> list[int]:
    """Puts each span of ``targets`` back in place of its sentinel in ``inputs``."""
    assert inputs[-1] == eos and targets[-1] == eos
    spans: dict[int, list[int]] = {}
    current = None
    for token in targets[:-1]:
        if token in sentinels:
            assert token not in spans, "each sentinel starts exactly one span"
            current = token
            spans[current] = []
        else:
            assert current is not None, "targets start with a sentinel"
            spans[current].append(token)
    out: list[int] = []
    for token in inputs[:-1]:
        out.extend(spans.pop(token) if token in sentinels else [token])
    assert not spans, "every target span has its sentinel in the input"
    return out


def spans_of(mask: torch.Tensor) -> list[int]:
    """Lengths of the runs of True in a bool mask."""
    edges = np.diff(np.concatenate([[0], np.asarray(mask, dtype=np.int8), [0]]))
    return (np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)).tolist()


# ------------------------------------------------------------------------------------ lengths
def _brute_force_lengths(inputs_length: int, density: float, mean_span: float) -> tuple[int, int]:
    """Largest raw length whose corrupted input fits, straight from T5's bookkeeping."""
    def lengths(n):
        noise = int(round(n * density))
        spans = int(round(noise / mean_span))
        return n - noise + spans + 1, noise + spans + 1

    best = max(n for n in range(1, 4 * inputs_length) if lengths(n)[0] <= inputs_length)
    targets = lengths(best)[1]
    if density == 0.5 and targets > inputs_length:
        best, targets = best - 1, targets - 1
    return best, targets


@pytest.mark.parametrize(
    "inputs_length, density, mean_span, expected",
    [
        (512, 0.15, 3.0, (568, 114)),  # T5's default: 568 raw tokens -> 512 inputs, 114 targets
        (128, 0.15, 3.0, (141, 29)),
        (512, 0.5, 3.0, (766, 512)),
        (10, 0.15, 3.0, (10, 4)),
    ],
)
def test_lengths_match_t5_formula(inputs_length, density, mean_span, expected):
    assert compute_input_and_target_lengths(inputs_length, density, mean_span) == expected


@pytest.mark.parametrize("inputs_length", [16, 32, 64, 100, 128, 256, 512, 1024])
@pytest.mark.parametrize("density, mean_span", [(0.15, 3.0), (0.3, 5.0), (0.5, 3.0), (0.1, 1.0)])
def test_lengths_match_brute_force(inputs_length, density, mean_span):
    assert compute_input_and_target_lengths(inputs_length, density, mean_span) == _brute_force_lengths(
        inputs_length, density, mean_span
    )


@pytest.mark.parametrize("inputs_length, density, mean_span", [(512, 0.15, 3.0), (128, 0.15, 3.0), (64, 0.3, 5.0)])
def test_collated_rows_have_the_computed_lengths(inputs_length, density, mean_span):
    tokens_length, targets_length = compute_input_and_target_lengths(inputs_length, density, mean_span)
    collator = DataCollatorForT5SpanCorruption(
        sentinel_ids=SENTINELS, eos_token_id=EOS, pad_token_id=PAD, noise_density=density,
        mean_noise_span_length=mean_span, generator=torch.Generator().manual_seed(0),
    )
    g = torch.Generator().manual_seed(1)
    examples = [{"input_ids": torch.randint(2, 1000, (tokens_length,), generator=g).tolist()} for _ in range(8)]
    batch = collator(examples)
    assert batch["input_ids"].shape == (8, inputs_length)
    assert batch["labels"].shape == (8, targets_length)
    assert batch["attention_mask"].all(), "fixed-length blocks need no padding"
    assert (batch["labels"] != -100).all()


# ----------------------------------------------------------------------------- reconstruction
@pytest.mark.parametrize("length, density, mean_span", [(568, 0.15, 3.0), (37, 0.15, 3.0), (200, 0.3, 5.0), (50, 0.5, 1.0), (2, 0.15, 3.0)])
def test_sentinels_substituted_back_reconstruct_the_original(length, density, mean_span):
    g = torch.Generator().manual_seed(length)
    for _ in range(50):
        tokens = torch.randint(2, 1000, (length,), generator=g).tolist()
        mask = random_spans_noise_mask(length, density, mean_span, generator=g)
        inputs, targets = corrupt_spans(tokens, mask, SENTINELS, EOS)
        assert reconstruct(inputs, targets, SENTINELS, EOS) == tokens
        used_in = [t for t in inputs if t in SENTINELS]
        used_out = [t for t in targets if t in SENTINELS]
        # Span k gets sentinel k, in order, in both the input and the target.
        assert used_in == used_out == SENTINELS[: len(spans_of(mask))]
        assert targets[0] == SENTINELS[0]


def test_collator_batch_reconstructs_and_pads_variable_lengths():
    collator = DataCollatorForT5SpanCorruption(
        sentinel_ids=SENTINELS, eos_token_id=EOS, pad_token_id=PAD, generator=torch.Generator().manual_seed(3)
    )
    g = torch.Generator().manual_seed(4)
    examples = [{"input_ids": torch.randint(2, 1000, (n,), generator=g).tolist()} for n in (30, 57, 12)]
    batch = collator(examples)
    for row, ex in enumerate(examples):
        n_in = int(batch["attention_mask"][row].sum())
        inputs = batch["input_ids"][row, :n_in].tolist()
        assert (batch["input_ids"][row, n_in:] == PAD).all()
        labels = batch["labels"][row]
        targets = labels[labels != -100].tolist()
        assert reconstruct(inputs, targets, SENTINELS, EOS) == ex["input_ids"]


# --------------------------------------------------------------------------------- statistics
@pytest.mark.parametrize("length, density, mean_span", [(568, 0.15, 3.0), (256, 0.3, 5.0), (128, 0.15, 2.0)])
def test_noise_density_and_mean_span_length_are_honoured(length, density, mean_span):
    g = torch.Generator().manual_seed(0)
    n_samples = 2000
    masks = torch.stack([random_spans_noise_mask(length, density, mean_span, generator=g) for _ in range(n_samples)])
    span_lengths = [s for m in masks for s in spans_of(m)]

    # Density: exactly round(length * density) noise tokens per sample, as in T5.
    assert (masks.sum(dim=1) == round(length * density)).all()
    assert masks.float().mean().item() == pytest.approx(density, abs=0.5 / length + 1e-9)
    # Mean span length over all spans of all samples. T5 rounds the span count, round(noise / mean),
    # which moves the mean by at most a relative 0.5 * mean / noise (5% for 19 noise tokens, mean 2).
    num_noise = round(length * density)
    assert sum(span_lengths) / len(span_lengths) == pytest.approx(mean_span, rel=0.5 * mean_span / num_noise + 1e-9)
    # The lengths are random, not all equal to the mean.
    assert len(set(span_lengths)) > 3
    # T5 starts every block with a kept span and ends it with a noise span, so the edges are biased
    # (position 0 never noise, the last position always). Away from the edges a token is noise
    # with probability close to the density wherever it is. With 2000 samples the standard error
    # of a position's rate is about 0.008-0.01, so 0.06 is more than 5 sigma.
    assert not masks[:, 0].any() and masks[:, -1].all()
    interior = masks[:, length // 10 : length - length // 10].float().mean(dim=0)
    assert (interior - density).abs().max().item() < 0.06
    # Spans are separated by at least one kept token, so the count of runs is the span count.
    assert all(len(spans_of(m)) == max(round(round(length * density) / mean_span), 1) for m in masks[:50])


def test_masks_are_random_and_reproducible():
    a = [random_spans_noise_mask(100, generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(a[0], a[1])
    g = torch.Generator().manual_seed(7)
    b = [random_spans_noise_mask(100, generator=g) for _ in range(5)]
    assert len({tuple(m.tolist()) for m in b}) == 5


def test_too_many_spans_for_the_sentinels_is_a_clear_error():
    mask = random_spans_noise_mask(200, 0.5, 1.0, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="sentinel"):
        corrupt_spans(list(range(2, 202)), mask, SENTINELS[:10], EOS)


def test_invalid_settings_are_refused():
    with pytest.raises(ValueError, match="noise_density"):
        DataCollatorForT5SpanCorruption(sentinel_ids=SENTINELS, eos_token_id=EOS, pad_token_id=PAD, noise_density=0.0)
    with pytest.raises(ValueError, match="mean_noise_span_length"):
        DataCollatorForT5SpanCorruption(
            sentinel_ids=SENTINELS, eos_token_id=EOS, pad_token_id=PAD, mean_noise_span_length=0.5
        )


# ---------------------------------------------------------------------------- real tokenizer
def test_with_the_embedded_t5_tokenizer():
    import embedded_default

    texts = ["Return the value of the header.", "Run the event loop until the future is done."] * 20
    tokenizer = embedded_default._train_tokenizer("t5", texts, vocab_size=120)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1)
    collator = DataCollatorForT5SpanCorruption.from_tokenizer(tokenizer, generator=torch.Generator().manual_seed(0))
    assert len(collator.sentinel_ids) == 100
    assert tokenizer.convert_ids_to_tokens(collator.sentinel_ids[:2]) == ["<extra_id_0>", "<extra_id_1>"]
    ids = tokenizer(" ".join(texts), add_special_tokens=False)["input_ids"][:60]
    batch = collator([{"input_ids": ids}])
    inputs, targets = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    assert reconstruct(inputs, targets, collator.sentinel_ids, tokenizer.eos_token_id) == ids
    text = tokenizer.decode(inputs)
    assert "<extra_id_0>" in text and text.endswith("</s>")
