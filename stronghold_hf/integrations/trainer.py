"""`StrongholdTrainer` and `StrongholdSeq2SeqTrainer` (work in progress: flag-off path only)."""

from __future__ import annotations

from transformers import Seq2SeqTrainer, Trainer


class StrongholdTrainer(Trainer):
    pass


class StrongholdSeq2SeqTrainer(Seq2SeqTrainer):
    pass
