"""Long inputs through the HF path (#42, item 4): the Trainer with the flag at long lengths.

A user trains long documents with the flags they know: ``--stronghold``, a long sequence, and
``--stronghold_config '{"sequence_tiling": true}'``. These tests go through
``HfArgumentParser`` and the Trainer against the plain Trainer on the same data: the losses
and weights must match at thousands of tokens per sequence (the chunked loss shifts the labels
over many chunks there, and every MLP runs in tiles), and padding-free packing
(``DataCollatorWithFlattening``: one row of concatenated examples, ``position_ids`` restarting
at each) must keep working, tiled or not.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import DataCollatorWithFlattening, HfArgumentParser, Trainer, TrainingArguments

from stronghold_hf import StrongholdTrainer, StrongholdTrainingArguments
from tiny_models import VOCAB, tiny_model

SEQ = 3000  # many chunks of the loss, several tiles of the MLP
ADAM_SLACK = 0.02 * 1e-2 * 4  # see test_step.py: Adam amplifies rounding noise of ~0 gradients
COMMON = ["--per_device_train_batch_size", "1", "--max_steps", "2", "--learning_rate", "1e-2",
          "--max_grad_norm", "1.0", "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no",
          "--use_cpu", "--seed", "0", "--dataloader_num_workers", "0"]


class Documents(torch.utils.data.Dataset):
    """Long documents of random tokens, labels = inputs (the model shifts them)."""

    def __init__(self, seq: int, n: int = 2, lengths: list[int] | None = None) -> None:
        g = torch.Generator().manual_seed(0)
        self.items = []
        for i in range(n):
            length = lengths[i] if lengths else seq
            ids = torch.randint(3, VOCAB, (length,), generator=g)
            self.items.append({"input_ids": ids.tolist(), "labels": ids.tolist()})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def _collate_whole(features: list[dict]) -> dict:
    return {k: torch.tensor([f[k] for f in features]) for k in features[0]}


def _parse(argv: list[str], cls):
    (args,) = HfArgumentParser(cls).parse_args_into_dataclasses(args=argv)
    return args


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _compare(family: str, tmp_path, stronghold_argv: list[str], dataset, collator,
             both: tuple[str, ...] = ()) -> StrongholdTrainer:
    ref = tiny_model(family, max_position_embeddings=4 * SEQ)
    model = copy.deepcopy(ref)
    plain = Trainer(model=ref, args=_parse(["--output_dir", str(tmp_path / "plain"), *COMMON, *both],
                                           TrainingArguments), train_dataset=dataset, data_collator=collator)
    plain.train()
    args = _parse(["--output_dir", str(tmp_path / "sh"), *COMMON, *both, "--stronghold", *stronghold_argv],
                  StrongholdTrainingArguments)
    ours = StrongholdTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    ours.train()
    assert _losses(ours) == pytest.approx(_losses(plain), rel=1e-4)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-4, atol=ADAM_SLACK, msg=lambda m: f"{k}: {m}")
    return ours


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("attention", [False, True], ids=["mlp-tiles", "query-tiles"])
def test_long_sequences_through_the_trainer_match_plain_with_tiling(family, attention, tmp_path):
    config = json.dumps({"sequence_tiling": True, "tile_tokens": 512, "attention_tiling": attention})
    ours = _compare(family, tmp_path, ["--stronghold_config", config], Documents(SEQ), _collate_whole)
    from stronghold_hf.query_tiling import installed
    from stronghold_hf.tiling import tiled_modules

    if attention:  # every block ran whole in query tiles, each step (its MLP inside a tile)
        assert installed(ours.model).calls == 2 * len(list(ours.stronghold_engine.blocks))
    else:
        tiled = tiled_modules(ours.model)
        assert tiled and sum(site.calls for site in tiled.values()) > 0  # the MLPs did run in tiles


@pytest.mark.parametrize("attention", [False, True], ids=["mlp-tiles", "query-tiles"])
def test_packed_documents_keep_their_positions_tiled_or_not(attention, tmp_path):
    """DataCollatorWithFlattening packs a batch into one row and restarts ``position_ids`` at each
    document; the engine (and tiling, whose tiles cut across documents) must not change what
    the model computes from them."""
    docs = Documents(SEQ, n=4, lengths=[1200, 700, 1600, 500])
    collator = DataCollatorWithFlattening()
    argv = ["--stronghold_config", json.dumps({"sequence_tiling": True, "tile_tokens": 300,
                                               "attention_tiling": attention})]
    ours = _compare("llama", tmp_path, argv, docs, collator, both=("--per_device_train_batch_size", "2"))
    if attention:  # the packed sequence's mask (a document may not see the one before) cut into tiles
        from stronghold_hf.query_tiling import installed

        tiling = installed(ours.model)
        assert set(tiling.verdicts.values()) == {None} and tiling.calls > 0, tiling.verdicts
    batch = collator([docs[0], docs[1]])
    assert batch["input_ids"].shape[0] == 1 and int(batch["position_ids"][0, 1200]) == 0  # packed, restarted
    assert _losses(ours)
