"""T5's span-corruption objective as a PyTorch data collator.

T5 pretrains on "random spans" denoising (Raffel et al., 2020, JMLR 21(140), §3.1.4 and §3.3.4;
the reference implementation is ``random_spans_noise_mask``, ``random_spans_helper`` and
``noise_span_to_unique_sentinel`` in ``t5/data/preprocessors.py``). From a block of raw tokens:

* ``num_noise = round(length * noise_density)`` tokens are corrupted, in
  ``num_spans = round(num_noise / mean_noise_span_length)`` spans; the span lengths and the gaps
  between them are uniformly random segmentations, and the block starts with a kept gap;
* the **input** keeps the unmasked tokens and replaces span ``k`` with sentinel ``k``
  (``<extra_id_k>``), then ends with EOS;
* the **target** is each sentinel followed by the tokens it hides, then EOS.

For example, with ``x1 .. x8`` and spans ``{x3 x4}``, ``{x7}``::

    input:  x1 x2 <extra_id_0> x5 x6 <extra_id_1> x8 </s>
    target: <extra_id_0> x3 x4 <extra_id_1> x7 </s>

`compute_input_and_target_lengths` inverts the length bookkeeping: given the desired encoder input
length it returns how many raw tokens to feed per block and the resulting target length, so that
every corrupted input has exactly ``inputs_length`` tokens (e.g. 512 -> 568 raw tokens and 114
target tokens at the default 0.15 / 3.0). This is our own implementation of T5's
``random_spans_helper`` with one extra token per span on each side (the sentinel) and one EOS.

Randomness comes from torch (an optional `torch.Generator`), so `DataLoader` workers, which torch
seeds differently, draw different masks, and `transformers.set_seed` makes a run reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch


def _round(x: float) -> int:
    # Python's round() (half to even), as in T5's own helper; tf.round is also half to even.
    return int(round(x))


def _lengths_for(tokens_length: int, noise_density: float, mean_noise_span_length: float) -> tuple[int, int]:
    """(input length, target length) after corrupting ``tokens_length`` raw tokens."""
    num_noise = _round(tokens_length * noise_density)
    num_nonnoise = tokens_length - num_noise
    num_spans = _round(num_noise / mean_noise_span_length)
    # One sentinel per span on each side, plus one EOS.
    return num_nonnoise + num_spans + 1, num_noise + num_spans + 1


def compute_input_and_target_lengths(
    inputs_length: int, noise_density: float = 0.15, mean_noise_span_length: float = 3.0
) -> tuple[int, int]:
    """``(tokens_length, targets_length)``: raw tokens per block, and the target length they give.

    ``tokens_length`` is the largest number of raw tokens whose corrupted input (kept tokens,
    one sentinel per span, EOS) fits in ``inputs_length``. As in T5, when
    ``noise_density == 0.5`` and the targets come out longer than the inputs, one token is
    dropped so both have the same (presumably round) length.
    """
    if inputs_length < 2:
        raise ValueError(f"inputs_length={inputs_length} leaves no room for tokens and EOS; use >= 2.")
    tokens_length = inputs_length - 1
    while _lengths_for(tokens_length + 1, noise_density, mean_noise_span_length)[0] <= inputs_length:
        tokens_length += 1
    _, targets_length = _lengths_for(tokens_length, noise_density, mean_noise_span_length)
    if noise_density == 0.5 and targets_length > inputs_length:
        tokens_length -= 1
        targets_length -= 1
    return tokens_length, targets_length


def _random_segmentation(num_items: int, num_segments: int, generator: torch.Generator | None) -> torch.Tensor:
    """Random positive lengths of ``num_segments`` segments summing to ``num_items`` (uniform over compositions)."""
    # Choose num_segments - 1 distinct cut points among the num_items - 1 gaps between items.
    cuts = torch.randperm(num_items - 1, generator=generator)[: num_segments - 1] + 1
    bounds = torch.cat([torch.zeros(1, dtype=torch.long), cuts.sort().values, torch.tensor([num_items])])
    return bounds.diff()


def random_spans_noise_mask(
    length: int,
    noise_density: float = 0.15,
    mean_noise_span_length: float = 3.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """A bool mask of ``length`` with ``round(length * noise_density)`` True tokens in random spans.

    As in T5: at least one noise token and one kept token (``length >= 2``), at least one span,
    kept and noise spans alternate, and the first span is kept, so the last is noise.
    """
    orig_length = length
    length = max(length, 2)
    num_noise = min(max(_round(length * noise_density), 1), length - 1)
    num_spans = max(_round(num_noise / mean_noise_span_length), 1)
    # Each kept gap and each span needs at least one token.
    num_spans = min(num_spans, num_noise, length - num_noise)
    noise_lengths = _random_segmentation(num_noise, num_spans, generator)
    nonnoise_lengths = _random_segmentation(length - num_noise, num_spans, generator)
    interleaved = torch.stack([nonnoise_lengths, noise_lengths], dim=1).reshape(-1)
    is_noise = torch.repeat_interleave(torch.arange(2 * num_spans) % 2 == 1, interleaved)
    return is_noise[:orig_length]


def corrupt_spans(
    tokens: Sequence[int] | torch.Tensor, noise_mask: torch.Tensor, sentinel_ids: Sequence[int], eos_token_id: int
) -> tuple[list[int], list[int]]:
    """(input ids, target ids) for ``tokens`` with the spans of ``noise_mask`` corrupted.

    Span ``k`` becomes ``sentinel_ids[k]`` in the input; the target holds ``sentinel_ids[k]``
    followed by the span's tokens. Both end with ``eos_token_id``.
    """
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    if tokens.shape != noise_mask.shape:
        raise ValueError(f"tokens {tuple(tokens.shape)} and noise_mask {tuple(noise_mask.shape)} differ in shape.")
    mask = noise_mask.tolist()
    inputs: list[int] = []
    targets: list[int] = []
    span = -1
    for i, token in enumerate(tokens.tolist()):
        if mask[i]:
            if i == 0 or not mask[i - 1]:
                span += 1
                if span >= len(sentinel_ids):
                    raise ValueError(
                        f"{span + 1} noise spans but only {len(sentinel_ids)} sentinel tokens; use shorter "
                        "blocks, a lower noise density or a longer mean span."
                    )
                inputs.append(sentinel_ids[span])
                targets.append(sentinel_ids[span])
            targets.append(token)
        else:
            inputs.append(token)
    return inputs + [eos_token_id], targets + [eos_token_id]


def sentinel_token_ids(tokenizer, max_sentinels: int = 100) -> list[int]:
    """Ids of ``<extra_id_0>``, ``<extra_id_1>``, ... in ``tokenizer``, in order, until one is missing."""
    ids = []
    unk = tokenizer.unk_token_id
    for i in range(max_sentinels):
        token_id = tokenizer.convert_tokens_to_ids(f"<extra_id_{i}>")
        if token_id is None or token_id == unk:
            break
        ids.append(token_id)
    if not ids:
        raise ValueError(
            f"Tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no <extra_id_0> sentinel; T5 span "
            "corruption needs the <extra_id_N> tokens (a T5 tokenizer, or the embedded one of run_t5_mlm.py)."
        )
    return ids


@dataclass
class DataCollatorForT5SpanCorruption:
    """Collates blocks of raw token ids into T5 span-corruption ``input_ids``/``labels`` batches.

    Each example is a dict with ``input_ids``: a block of raw tokens (no EOS needed); feed blocks of
    ``compute_input_and_target_lengths(inputs_length, ...)[0]`` tokens and every row comes out with
    exactly ``inputs_length`` inputs and ``targets_length`` labels. Blocks of other lengths work too
    and are padded (``pad_token_id`` in the inputs with ``attention_mask`` 0, ``-100`` in the
    labels). The model builds ``decoder_input_ids`` from ``labels`` itself (shift right).
    """

    sentinel_ids: Sequence[int]
    """Ids of ``<extra_id_0>``, ``<extra_id_1>``, ...; see `sentinel_token_ids`."""
    eos_token_id: int
    pad_token_id: int
    noise_density: float = 0.15
    mean_noise_span_length: float = 3.0
    generator: torch.Generator | None = None
    """Source of randomness; ``None`` draws from torch's global generator."""
    label_pad_token_id: int = -100

    def __post_init__(self):
        if not 0.0 < self.noise_density < 1.0:
            raise ValueError(f"noise_density={self.noise_density} must be in (0, 1), e.g. 0.15.")
        if self.mean_noise_span_length < 1.0:
            raise ValueError(f"mean_noise_span_length={self.mean_noise_span_length} must be >= 1, e.g. 3.0.")
        self.sentinel_ids = list(self.sentinel_ids)

    @classmethod
    def from_tokenizer(cls, tokenizer, **kwargs) -> "DataCollatorForT5SpanCorruption":
        return cls(
            sentinel_ids=sentinel_token_ids(tokenizer),
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **kwargs,
        )

    def corrupt(self, tokens: Sequence[int] | torch.Tensor) -> tuple[list[int], list[int]]:
        """(input ids, target ids) for one block, with a fresh random mask."""
        mask = random_spans_noise_mask(len(tokens), self.noise_density, self.mean_noise_span_length, self.generator)
        return corrupt_spans(tokens, mask, self.sentinel_ids, self.eos_token_id)

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        pairs = [self.corrupt(ex["input_ids"]) for ex in examples]
        max_in = max(len(i) for i, _ in pairs)
        max_out = max(len(t) for _, t in pairs)
        input_ids = torch.full((len(pairs), max_in), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(pairs), max_in), dtype=torch.long)
        labels = torch.full((len(pairs), max_out), self.label_pad_token_id, dtype=torch.long)
        for row, (inp, tgt) in enumerate(pairs):
            input_ids[row, : len(inp)] = torch.tensor(inp)
            attention_mask[row, : len(inp)] = 1
            labels[row, : len(tgt)] = torch.tensor(tgt)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
