#!/usr/bin/env python
"""Causal language-model pretraining with a plain `accelerate` loop; ``--stronghold`` for offloading.

The ``no_trainer`` counterpart of ``run_clm.py``, in the style of HF's
``run_clm_no_trainer.py``: argparse flags, `Accelerator`, ``accelerator.accumulate(model)``,
``accelerator.backward(loss)``. With ``--stronghold`` (or ``STRONGHOLD=1`` in the environment,
which ``accelerate launch`` passes through) the model and optimizer come from
``stronghold_hf.prepare_stronghold`` instead of ``accelerator.prepare``: the blocks stream through
the working window, the offloaded blocks step with CPU Adam, and gradient clipping goes through
``engine.clip_grad_norm_``, the engine's exact global norm over resident and offloaded gradients.
Everything else in the loop is unchanged.

With no data or model argument it runs offline on the embedded default (see
``examples/embedded_default.py``), like ``run_clm.py``::

    python examples/run_clm_no_trainer.py --stronghold
    accelerate launch examples/run_clm_no_trainer.py --stronghold --stronghold_window_size 2 \\
        --model_name_or_path gpt2 --train_file a.txt --validation_file b.txt --output_dir out

Writes ``all_results.json`` (``perplexity``, ``eval_loss``, ``train_loss``) and the model and
tokenizer into ``--output_dir``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, default_data_collator, get_scheduler

import embedded_default
from script_utils import (
    add_perplexity,
    build_model,
    check_model_sources,
    configure_logging,
    env_flag,
    given_flags,
    group_texts,
    load_config,
    load_raw_datasets,
    load_tokenizer,
    log_filled_defaults,
    long_sequences_expected,
    take,
)
from stronghold_hf import StrongholdConfig

try:  # The accelerate integration is optional: without it, only the plain path runs.
    from stronghold_hf import prepare_stronghold
except ImportError:
    prepare_stronghold = None

logger = logging.getLogger(__name__)

#: Short-run values of the embedded default (no data argument): about as long as run_clm.py's.
EMBEDDED_DEFAULTS = {
    "max_train_steps": 200,
    "block_size": 128,
    "per_device_train_batch_size": 8,
    "per_device_eval_batch_size": 16,
    "learning_rate": 2e-3,
    "num_warmup_steps": 30,
    "weight_decay": 0.01,
    "logging_steps": 20,
    "max_eval_samples": 200,
}
DATA_FLAGS = ("dataset_name", "train_file", "validation_file")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # Model.
    p.add_argument("--model_name_or_path", help="Checkpoint to start from (hub id or path).")
    p.add_argument("--model_type", help="Train a new model of this type from scratch, e.g. gpt2.")
    p.add_argument("--config_name", help="Config name or path, if not the model's.")
    p.add_argument("--config_overrides", help="Override config values of a new model, e.g. 'n_layer=2,n_embd=64'.")
    p.add_argument("--tokenizer_name", help="Tokenizer name or path, if not the model's.")
    p.add_argument("--cache_dir", help="Where to cache hub downloads.")
    p.add_argument("--model_revision", default="main", help="Branch, tag or commit of the model.")
    p.add_argument("--token", help="Hub token for private models.")
    # Data.
    p.add_argument("--dataset_name", help="Hub dataset name (needs the network).")
    p.add_argument("--dataset_config_name", help="Hub dataset config name.")
    p.add_argument("--train_file", help="Training data: .txt, .csv or .json(l) with a 'text' column.")
    p.add_argument("--validation_file", help="Validation data, same format.")
    p.add_argument("--validation_split_percentage", type=int, default=5, help="Validation percent of train if no split.")
    p.add_argument("--block_size", type=int, help="Tokens per block (default: model max length, at most 1024).")
    p.add_argument("--max_train_samples", type=int, help="Truncate the training blocks to this many.")
    p.add_argument("--max_eval_samples", type=int, help="Truncate the evaluation blocks to this many.")
    p.add_argument("--preprocessing_num_workers", type=int, help="Processes for tokenization.")
    # Optimisation.
    p.add_argument("--per_device_train_batch_size", type=int, default=8)
    p.add_argument("--per_device_eval_batch_size", type=int, default=8)
    p.add_argument("--learning_rate", type=float, default=5e-5)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--adam_beta1", type=float, default=0.9)
    p.add_argument("--adam_beta2", type=float, default=0.999)
    p.add_argument("--adam_epsilon", type=float, default=1e-8)
    p.add_argument("--max_grad_norm", type=float, default=1.0, help="Global gradient clipping; 0 turns it off.")
    p.add_argument("--num_train_epochs", type=int, default=3)
    p.add_argument("--max_train_steps", type=int, help="Overrides --num_train_epochs when given.")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--lr_scheduler_type", default="linear",
                   choices=["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup"])
    p.add_argument("--num_warmup_steps", type=int, default=0)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--logging_steps", type=int, default=50, help="Log the mean training loss every N optimizer steps.")
    p.add_argument("--output_dir", default="outputs/run_clm_no_trainer", help="Where the model and results go.")
    # STRONGHOLD.
    p.add_argument("--stronghold", action="store_true", default=env_flag("STRONGHOLD"),
                   help="Working-window offloading and CPU Adam via stronghold_hf.prepare_stronghold (env: STRONGHOLD=1).")
    p.add_argument("--stronghold_window_size", default=os.environ.get("STRONGHOLD_WINDOW_SIZE") or None,
                   help="'auto' or an int >= 1: blocks kept on the device (env: STRONGHOLD_WINDOW_SIZE).")
    p.add_argument("--stronghold_config", default=os.environ.get("STRONGHOLD_CONFIG") or None,
                   help="StrongholdConfig as a JSON string or a JSON file path (env: STRONGHOLD_CONFIG).")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    given = given_flags(argv)
    args.embedded_data = not (given & set(DATA_FLAGS))
    args.filled_defaults = {}
    if args.embedded_data:
        for key, value in EMBEDDED_DEFAULTS.items():
            if key not in given and not (key == "max_train_steps" and "num_train_epochs" in given):
                setattr(args, key, value)
                args.filled_defaults[key] = value
    return args


def stronghold_config(args) -> StrongholdConfig | None:
    """The `StrongholdConfig` the flags describe, or ``None`` to let stronghold_hf use its defaults."""
    if args.stronghold_config is None and args.stronghold_window_size is None:
        return None
    config = StrongholdConfig.from_any(args.stronghold_config)
    if args.stronghold_window_size is not None:
        raw = str(args.stronghold_window_size).strip()
        try:
            window = raw if raw == "auto" else int(raw)
        except ValueError:
            raise ValueError(f"--stronghold_window_size={raw!r}; use 'auto' or an int >= 1.") from None
        config = config.replace(window_size=window)
    return config


def decay_param_groups(model, weight_decay: float) -> list[dict]:
    """No weight decay on biases and norm weights, as in HF's scripts."""
    no_decay = ("bias", "layer_norm.weight", "ln_", "norm.weight", "LayerNorm.weight")
    decay, rest = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (rest if any(k in name for k in no_decay) else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def evaluate(model, eval_dataloader, accelerator, batch_size: int) -> float:
    model.eval()
    losses = []
    for batch in eval_dataloader:
        with torch.no_grad():
            loss = model(**batch).loss
        losses.append(accelerator.gather_for_metrics(loss.detach().repeat(batch_size)))
    model.train()
    return torch.cat(losses).float().mean().item()


def main(argv=None):
    args = parse_args(argv)
    if args.stronghold and prepare_stronghold is None:
        raise SystemExit(
            "--stronghold (or STRONGHOLD=1) needs stronghold_hf.prepare_stronghold, which this installation "
            "of stronghold_hf does not provide yet. Update stronghold_hf, or run without --stronghold."
        )
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    configure_logging(logging.INFO if accelerator.is_local_main_process else logging.WARNING)
    log_filled_defaults(args.filled_defaults, args.embedded_data)
    check_model_sources(args)
    set_seed(args.seed)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)

    with accelerator.main_process_first():
        raw = load_raw_datasets(args, args, embedded_files=embedded_default.text_files)
        tokenizer, embedded_tokenizer = load_tokenizer(args, "gpt")
    config, _ = load_config(args, "gpt", tokenizer, embedded_tokenizer=embedded_tokenizer)
    model = build_model(AutoModelForCausalLM, args, config, tokenizer)

    max_length = tokenizer.model_max_length
    for attr in ("n_positions", "max_position_embeddings"):
        if getattr(config, attr, None):
            max_length = min(max_length, getattr(config, attr))
    block_size = min(args.block_size or 1024, max_length)
    columns = raw["train"].column_names
    text_column = "text" if "text" in columns else columns[0]
    with accelerator.main_process_first(), long_sequences_expected():
        tokenized = raw.map(lambda ex: tokenizer(ex[text_column]), batched=True, remove_columns=columns,
                            num_proc=args.preprocessing_num_workers, desc="Tokenizing")
        blocks = tokenized.map(group_texts, batched=True, fn_kwargs={"block_size": block_size},
                               num_proc=args.preprocessing_num_workers, desc=f"Grouping into blocks of {block_size}")
    blocks = blocks.map(lambda ex: {"labels": ex["input_ids"]}, batched=True, desc="Adding labels")
    train_dataset = take(blocks["train"], args.max_train_samples)
    eval_dataset = take(blocks["validation"], args.max_eval_samples)
    if len(train_dataset) == 0 or len(eval_dataset) == 0:
        raise ValueError(f"No block of {block_size} tokens in train or validation; give more text or a smaller --block_size.")
    train_dataloader = DataLoader(train_dataset, shuffle=True, collate_fn=default_data_collator,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_dataset, collate_fn=default_data_collator, batch_size=args.per_device_eval_batch_size)

    if args.stronghold:
        # prepare_stronghold places the model (resident parts on the device, blocks in CPU RAM),
        # builds the optimizer (CPU Adam for offloaded blocks) and passes both through accelerate.
        model, optimizer, engine = prepare_stronghold(
            accelerator, model,
            optimizer_kwargs=dict(lr=args.learning_rate, weight_decay=args.weight_decay,
                                  betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon),
            param_groups=decay_param_groups(model, args.weight_decay),
            config=stronghold_config(args),
        )
    else:
        engine = None
        optimizer = torch.optim.AdamW(decay_param_groups(model, args.weight_decay), lr=args.learning_rate,
                                      betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)

    steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * steps_per_epoch
    num_epochs = math.ceil(args.max_train_steps / steps_per_epoch)
    lr_scheduler = get_scheduler(
        args.lr_scheduler_type, optimizer=optimizer, num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_train_steps * accelerator.num_processes,
    )
    if engine is None:
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
            model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
        )
    else:
        train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(train_dataloader, eval_dataloader, lr_scheduler)

    total_batch = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    logger.info("***** Running training (stronghold=%s) *****", args.stronghold)
    logger.info("  Blocks = %d, epochs = %d, total batch = %d, optimizer steps = %d",
                len(train_dataset), num_epochs, total_batch, args.max_train_steps)
    progress = tqdm(range(args.max_train_steps), disable=not accelerator.is_local_main_process)
    completed, window_loss, window_count, total_loss, total_count = 0, 0.0, 0, 0.0, 0
    start = time.time()
    model.train()
    for epoch in range(num_epochs):
        for batch in train_dataloader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.max_grad_norm > 0:
                    if engine is not None:
                        engine.clip_grad_norm_(args.max_grad_norm)
                    else:
                        accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            value = loss.detach().float().item()
            window_loss, window_count = window_loss + value, window_count + 1
            total_loss, total_count = total_loss + value, total_count + 1
            if accelerator.sync_gradients:
                completed += 1
                progress.update(1)
                if completed == 1 or completed % args.logging_steps == 0:
                    mean = window_loss / window_count
                    progress.set_postfix(loss=f"{mean:.4f}")
                    progress.write(f"step {completed}: loss {mean:.4f}, lr {lr_scheduler.get_last_lr()[0]:.3g}")
                    window_loss, window_count = 0.0, 0
            if completed >= args.max_train_steps:
                break
        if completed >= args.max_train_steps:
            break
    progress.close()
    train_runtime = time.time() - start

    eval_loss = evaluate(model, eval_dataloader, accelerator, args.per_device_eval_batch_size)
    results = add_perplexity({"eval_loss": eval_loss})
    results.update(train_loss=total_loss / max(total_count, 1), train_runtime=train_runtime, epoch=epoch + 1,
                   stronghold=bool(args.stronghold),
                   step=completed, eval_samples=len(eval_dataset), train_samples=len(train_dataset))
    logger.info("eval_loss = %.4f, perplexity = %.2f", results["eval_loss"], results["perplexity"])

    accelerator.wait_for_everyone()
    if engine is not None:
        # The last CPU Adam updates may still be running in the engine's workers (they overlap
        # with the next forward); the weights are final only once they are done.
        engine.synchronize()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process,
                              state_dict=accelerator.get_state_dict(model))
    if accelerator.is_main_process:
        tokenizer.save_pretrained(args.output_dir)
        with open(os.path.join(args.output_dir, "all_results.json"), "w") as fh:
            json.dump(results, fh, indent=4, sort_keys=True)
    accelerator.end_training()
    return results


if __name__ == "__main__":
    main()
