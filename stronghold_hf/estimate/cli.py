"""``python -m stronghold_hf.estimate``: the estimator's command line.

Parses the arguments (memory sizes and window sizes with config.py's parsers), builds the
config (meta.py), runs `estimate` (api.py) and prints the table and, as the last line, the
estimate as one JSON object. ``--check`` exits with status 3 when STRONGHOLD does not fit.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Sequence

from ..config import parse_memory, parse_window_size
from .api import estimate
from ..tiling import AUTO_MIN_SEQUENCE, AUTO_TILE_BYTES
from .counts import ATTENTION_KINDS
from .meta import _AUTO_CLASSES, load_config


def _parse_bool(text: str) -> bool:
    value = str(text).strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not true or false")


def _parse_auto_bool(text: str) -> bool | str:
    return "auto" if str(text).strip().lower() == "auto" else _parse_bool(text)


def _parse_resident(text: str) -> int | bool | str:
    value = text.strip().lower()
    if value in ("auto", "false"):
        return "auto" if value == "auto" else False
    if value.isdigit():
        return int(value)
    raise ValueError(text)


def _parse_tile(text: str) -> int | str:
    if text == "auto":
        return text
    value = int(text)
    if value < 1:
        raise ValueError(f"{value} tokens per tile; use auto or an int >= 1")
    return value


def _nonneg(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def _arg_type(parse: Any, name: str) -> Any:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except (TypeError, ValueError) as err:  # argparse prints these as "argument --x: ..."
            raise argparse.ArgumentTypeError(str(err)) from None

    convert.__name__ = name
    return convert


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m stronghold_hf.estimate",
        description="Estimate CPU RAM and GPU memory for STRONGHOLD training (and plain training) of a HF model "
        "config. Memory sizes are binary: GB = GiB = 2**30. The last output line is one JSON object.",
    )
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--model_type", help="a transformers model type, e.g. gpt2, llama, t5")
    src.add_argument("--config_name", help="a local config dir or config.json")
    parser.add_argument("--config_overrides", help='run_clm-style "k=v,k=v", e.g. "n_embd=2048,n_layer=100"')
    parser.add_argument("--seq_len", type=int, required=True)
    parser.add_argument("--decoder_seq_len", type=int, help="target length for encoder-decoder models (default seq_len)")
    parser.add_argument("--batch_size", type=int, required=True, help="per-device batch size")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    memory = _arg_type(parse_memory, "memory size")
    parser.add_argument("--gpu_memory", type=memory, required=True, help="GPU memory, e.g. 32GB")
    parser.add_argument("--cpu_memory", type=memory, required=True, help="host RAM, e.g. 90GB")
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--window_size", type=_arg_type(parse_window_size, "window size"), default="auto", help="auto (default) or an int >= 1")
    parser.add_argument("--auto_class", choices=sorted(_AUTO_CLASSES), help="which Auto class builds the model")
    flag = _arg_type(_parse_bool, "true or false")
    auto_flag = _arg_type(_parse_auto_bool, "auto, true or false")
    parser.add_argument("--offload_non_block", type=flag, default=True,
                        help="true (default): embeddings, norms and heads are offloaded like blocks; false: they stay "
                        "on the GPU with a device AdamW")
    parser.add_argument("--chunked_loss", type=auto_flag, default="auto",
                        help="auto (default: unless the split keeps the whole model on the GPU) or true: causal LMs "
                        "compute the head and loss in chunks; false: whole logits")
    parser.add_argument("--offload_activations", type=auto_flag, default="auto",
                        help="auto (default: when the GPU would not fit otherwise), true or false")
    parser.add_argument("--grad_buffers", type=int, default=2, help="K, gradient buffers in flight (default 2)")
    parser.add_argument("--host_memory", default="exact", choices=["exact", "lean"],
                        help="exact: fp32 Adam moments (default); lean: 8-bit moments (--optim adamw_8bit)")
    parser.add_argument("--host_grads", default="auto", choices=["auto", "fp32", "compute"],
                        help="host gradients of bf16 units: auto (default: bf16 when --gradient_accumulation_steps "
                        "is 1), fp32, or compute (bf16)")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1,
                        help="backward passes per step (default 1); above 1 host gradients are fp32")
    parser.add_argument("--host_image", type=auto_flag, default="auto",
                        help="keep the pinned bf16/fp16 image on the host (2 B/param): auto (default: unless the RAM "
                        "would not hold it), true or false")
    parser.add_argument("--nvme_memory", type=memory, default=None,
                        help="disk space for the NVMe tier (nvme_path), e.g. 2TB: the Adam moments go there when the "
                        "RAM would not hold them, then the fp32 masters")
    parser.add_argument("--nvme_masters", type=auto_flag, default="auto",
                        help="the fp32 masters on disk too (nvme_masters): auto (default: when the RAM would not hold "
                        "them with the moments on disk), true or false")
    parser.add_argument("--nvme_activations", type=auto_flag, default="auto",
                        help="the offloaded checkpointed activations on disk too (nvme_activations): auto (default: "
                        "when the RAM would not hold them with the moments on disk), true or false")
    parser.add_argument("--resident", type=_arg_type(_parse_resident, "auto, an int >= 0 or false"), default="auto",
                        help="the device/host split (StrongholdConfig.resident): auto (default: what fits in the GPU "
                        "less the engine's reserve stays there), N blocks, or false (everything streams)")
    parser.add_argument("--resident_budget", type=memory, default=None,
                        help="StrongholdConfig.gpu_memory: the GPU bytes the split may fill (default: the GPU less "
                        "the reserve)")
    parser.add_argument("--attn_implementation", choices=list(ATTENTION_KINDS), default=None,
                        help="the attention that runs (default: what transformers picks for the model class, SDPA "
                        "where supported): eager stores the heads x s x s scores, sdpa and flash_attention_2 do not")
    parser.add_argument("--sequence_tiling", type=auto_flag, default="auto",
                        help="the MLP in tiles of --tile_tokens tokens (StrongholdConfig.sequence_tiling): auto "
                        f"(default: above {AUTO_MIN_SEQUENCE} tokens), true or false")
    parser.add_argument("--tile_tokens", type=_arg_type(_parse_tile, "auto or an int >= 1"), default="auto",
                        help=f"tokens per tile (default auto: tiles that save about {AUTO_TILE_BYTES >> 20} MiB)")
    parser.add_argument("--attention_tiling", type=_arg_type(_parse_bool, "true or false"), default=False,
                        help="each causal block in query tiles of --tile_tokens against the keys and values before "
                        "them (StrongholdConfig.attention_tiling; default false)")
    parser.add_argument("--vocab_pieces", type=_arg_type(_parse_bool, "true or false"), default=True,
                        help="a vocabulary-sized embedding or head crosses in row pieces of at most a block "
                        "(StrongholdConfig.vocab_pieces; default true)")
    parser.add_argument("--head_lent_whole", action="store_true",
                        help="the training forward reads the LM head's weight itself (TRL's trainers' fused LM head, "
                        "Liger's fused linear cross-entropy): count the head whole on the device, with its gradient, "
                        "through each backward (the Trainer's fit check sees it on its own)")
    parser.add_argument("--device_checkpoints", type=_arg_type(lambda v: v if v == "auto" else _nonneg(v),
                                                                 "auto or an int >= 0"), default="auto",
                        help="offloaded checkpointed inputs kept on the device at the turn (StrongholdConfig."
                        "device_checkpoints; default auto: the window size)")
    reserve = _arg_type(lambda v: v if v == "auto" else parse_memory(v), "auto or a memory size")
    parser.add_argument("--cpu_reserve", type=reserve, default="auto",
                        help="host RAM left free for the rest of the machine (default auto: the larger of 4 GiB and "
                        "a tenth of --cpu_memory, at most 32 GiB)")
    parser.add_argument("--gpu_reserve", type=reserve, default="auto",
                        help="GPU memory left free for the CUDA context, library workspaces and fragmentation "
                        "(default auto: the larger of 2 GiB and 5%% of --gpu_memory)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="the type of device the engine computes on (default cuda): which attention kernels "
                        "run there (a query tile's causal mask is materialized on the CPU)")
    parser.add_argument("--check", action="store_true", help="exit with status 3 when STRONGHOLD does not fit")
    args = parser.parse_args(argv)

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the CLI's output is the table, not build-time warnings
    try:
        config = load_config(args.model_type, args.config_name, args.config_overrides)
        result = estimate(
            config, seq_len=args.seq_len, batch_size=args.batch_size, dtype=args.dtype,
            gpu_memory_bytes=args.gpu_memory, cpu_memory_bytes=args.cpu_memory,
            gradient_checkpointing=args.gradient_checkpointing, window_size=args.window_size,
            auto_class=args.auto_class, decoder_seq_len=args.decoder_seq_len, grad_buffers=args.grad_buffers,
            offload_non_block=args.offload_non_block, chunked_loss=args.chunked_loss,
            offload_activations=args.offload_activations, host_memory=args.host_memory,
            host_image=args.host_image, host_grads=args.host_grads,
            gradient_accumulation_steps=args.gradient_accumulation_steps, nvme_memory_bytes=args.nvme_memory,
            nvme_masters=args.nvme_masters, nvme_activations=args.nvme_activations, resident=args.resident, resident_budget_bytes=args.resident_budget,
            attn_implementation=args.attn_implementation, sequence_tiling=args.sequence_tiling,
            tile_tokens=args.tile_tokens, attention_tiling=args.attention_tiling,
            device_checkpoints=args.device_checkpoints, cpu_reserve=args.cpu_reserve,
            gpu_reserve=args.gpu_reserve, device=args.device, vocab_pieces=args.vocab_pieces,
            head_lent_whole=args.head_lent_whole,
        )
    except (ValueError, OSError, KeyError) as err:
        parser.error(str(err))
    print(result.table())
    print(json.dumps(result.to_dict(), sort_keys=True))
    return 3 if args.check and not result.fits else 0
