"""An accelerate training loop that has never heard of stronghold_hf, in the shape of HF's
``run_clm_no_trainer.py``: decay and no-decay AdamW groups, a warmup scheduler built on the
optimizer, ``accelerator.prepare(model, optimizer, dataloader, scheduler)``, gradient
accumulation, ``accelerator.clip_grad_norm_``. ``tests/test_launcher.py`` runs it as is and under
``python -m stronghold_hf``. It writes ``result.pt`` (losses, learning rates, weights) into OUT.

    accelerate_loop_script.py OUT [--optimizer adamw|sgd] [--prepare together|apart]

``--prepare apart``: ``prepare(model)``, then ``prepare(optimizer)``, then the dataloader and the
scheduler, as many scripts do.
"""

import argparse
import os
import sys

import torch
from accelerate import Accelerator
from transformers import get_scheduler

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tiny_models import batch, tiny_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--prepare", default="together", choices=["together", "apart"])
    args = ap.parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    torch.manual_seed(0)
    model = tiny_model("llama")
    no_decay = ["bias", "norm.weight"]
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.1},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = (torch.optim.AdamW(groups, lr=1e-2) if args.optimizer == "adamw" else torch.optim.SGD(groups, lr=1e-2))
    scheduler = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=1, num_training_steps=4)
    data = [{k: v[0] for k, v in batch("llama", seed=i, batch_size=1).items()} for i in range(16)]
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    if args.prepare == "together":
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    else:
        model = accelerator.prepare(model)
        optimizer = accelerator.prepare(optimizer)
        loader, scheduler = accelerator.prepare(loader, scheduler)
    model.train()
    losses, lrs = [], []
    for b in loader:
        with accelerator.accumulate(model):
            loss = model(**b).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        lrs.append(scheduler.get_last_lr()[0])
    unwrapped = accelerator.unwrap_model(model)
    torch.save({"losses": losses, "lrs": lrs, "state": {k: v.clone() for k, v in unwrapped.state_dict().items()},
                "engine": getattr(unwrapped, "_stronghold_engine", None) is not None},
               os.path.join(args.out, "result.pt"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
