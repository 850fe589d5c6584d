#!/usr/bin/env bash
# One-shot GPU check for a CUDA machine (written for an H200 session with a strict budget:
# this script must finish within 8 minutes; the device session has 15 minutes in all,
# including the machine's start).
#
#   bash scripts/gpu_check.sh            # from the repository root; results in ${OUT:-out}/
#
# What it runs, in order, each under `timeout` with its own budget (seconds):
#   setup                       ~20  import check, nvidia-smi
#   pytest -m gpu               120  the CUDA tests (tests/test_gpu.py): parity, ledger vs allocator,
#                                    deep == shallow peak, a model 3x the capped device trains
#   bench_memory.py             60   the ledger at 4/16/64 blocks next to torch.cuda.max_memory_allocated,
#                                    and the deepest model under a cap of 1/3 of its blocks
#   bench_estimate.py           75   the estimator against torch.cuda.max_memory_allocated on a
#                                    Llama-3-8B-shaped model (2 blocks, 128k vocabulary, 4096 tokens, bf16)
#   bench_step.py (fp32)        80   plain vs offloaded W=1,2,4 (+ speculation off, + DeepSpeed ZeRO-Offload
#                                    when it imports) on a GPT-2-medium-like model: paired ratios,
#                                    first_block_ready_fraction, forward_stall_fraction, miss rate
#   bench_max_model.py --quick  60   largest trainable model under a 32 GB cap
#   bench_train.py --quick      70   HF Trainer: plain vs --stronghold (auto, 1, 2), FSDP2 offload
#   bench_nvme.py               45   only if 45 s are left: the disk, then RAM vs NVMe tier vs masters on NVMe
#   bench_fetch.py              30   only if 30 s are left: fp32->bf16 conversion against the H2D copy it feeds
#   bench_step.py (bf16)        rest only if at least 60 s of the 8 minutes are left
#   total                       <= 485 + the optional runs, capped at 490
# A piece that fails or times out is recorded and the script goes on: one broken piece must
# not cost the others their (expensive) device time. The exit status is non-zero if any
# piece failed.
#
# Output (which the device tool collects from $OUT):
#   env.txt  gpu_tests.txt  bench_memory_cuda.jsonl  bench_estimate_cuda.jsonl  bench_step_cuda.jsonl
#   bench_max_model.jsonl  bench_train_cuda.jsonl  bench_nvme_cuda.jsonl  bench_fetch_cuda.jsonl
#   bench_step_cuda_bf16.jsonl
#   stderr.log  summary.txt
set -euo pipefail
export PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-out}"
mkdir -p "$OUT_DIR"
SUMMARY="$OUT_DIR/summary.txt"
ERR="$OUT_DIR/stderr.log"
: >"$SUMMARY"
: >"$ERR"
START=$SECONDS
FAILED=0

log() { echo "[$((SECONDS - START))s] $*" | tee -a "$SUMMARY"; }

# run_piece NAME BUDGET_S OUTFILE CMD...: stdout to OUTFILE, stderr to stderr.log, never aborts.
run_piece() {
    local name=$1 budget=$2 outfile=$3
    shift 3
    local t0=$SECONDS rc=0
    echo "===== $name ($*)" >>"$ERR"
    timeout --kill-after=10 "$budget" "$@" >"$outfile" 2>>"$ERR" || rc=$?
    if [ "$rc" -eq 0 ]; then
        log "$name: ok in $((SECONDS - t0))s"
    else
        FAILED=1
        if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
            log "$name: TIMED OUT after ${budget}s"
        else
            log "$name: FAILED (exit $rc) after $((SECONDS - t0))s"
        fi
    fi
    # The last line of a benchmark is its JSON summary; copy it into summary.txt.
    if [[ "$outfile" == *.jsonl ]] && [ -s "$outfile" ]; then
        tail -n 1 "$outfile" >>"$SUMMARY"
    fi
}

# ---------------------------------------------------------------------------- setup (~20 s)
# The machine has torch with CUDA but not this package; the repository root on PYTHONPATH is
# enough (an editable pip install would need setuptools from an index the machine cannot reach).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
} >"$OUT_DIR/env.txt" 2>&1
# One interpreter for the whole check: importing transformers takes seconds.
ENV_CHECK='import importlib.util as u, torch, transformers, accelerate, stronghold_hf
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
print("transformers", transformers.__version__, "accelerate", accelerate.__version__,
      "deepspeed", u.find_spec("deepspeed") is not None)'
if ! python -c "$ENV_CHECK" >>"$OUT_DIR/env.txt" 2>>"$ERR"; then
    log "transformers/accelerate missing: trying pip install (needs a reachable index)"
    pip install -q "transformers>=5.0" "accelerate>=1.10" datasets evaluate >>"$ERR" 2>&1 || true
    if ! python -c "$ENV_CHECK" >>"$OUT_DIR/env.txt" 2>>"$ERR"; then
        log "FATAL: cannot import torch/transformers/accelerate/stronghold_hf; see stderr.log"
        exit 2
    fi
fi
log "setup done"

# ---------------------------------------------------------------------------- CUDA tests (120 s)
run_piece "pytest -m gpu" 120 "$OUT_DIR/gpu_tests.txt" python -m pytest -m gpu tests -q -x -p no:cacheprovider
tail -n 3 "$OUT_DIR/gpu_tests.txt" >>"$SUMMARY" || true

# ---------------------------------------------------------------------------- bench_memory (60 s)
# Width 512 (~3.2 M parameters, 12.6 MB per block): device peak, host B/param and fetches per step
# at 4, 16 and 64 blocks, the ledger against the CUDA allocator, and 64 blocks under a cap of 1/3.
run_piece "bench_memory cuda" 60 "$OUT_DIR/bench_memory_cuda.jsonl" \
    python benchmarks/bench_memory.py --device cuda --width 512 --depths 4,16,64 --seq 32 --batch 1 --cap_third

# ---------------------------------------------------------------------------- bench_estimate (75 s)
# Llama-3-8B's shapes with 2 blocks (1.5 B parameters, ~27 GB of host RAM): one training step; the
# estimator's device total against the allocator's peak, the ledger against gpu_engine_bytes.
run_piece "bench_estimate cuda" 75 "$OUT_DIR/bench_estimate_cuda.jsonl" \
    python benchmarks/bench_estimate.py --device cuda --layers 2 --seq 4096

# ---------------------------------------------------------------------------- bench_step fp32 (90 s)
# GPT-2-medium-like: n_embd 1024, 24 layers, 16 heads, seq 512, batch 8. Each variant: 2 warm-up
# steps, then 3 rounds x 3 steps (2 counted per round): 6 counted steps, 4 variants; no new round
# after 70 s.
run_piece "bench_step cuda fp32" 80 "$OUT_DIR/bench_step_cuda.jsonl" \
    python benchmarks/bench_step.py --device cuda --model gpt2-medium-like --n_embd 1024 --n_layer 24 \
    --seq 512 --batch 8 --windows 1,2,4 --speculative auto,off --non_block on,off --warmup 2 --rounds 3 --block_steps 3 \
    --time_budget_s 60

# ---------------------------------------------------------------------------- bench_max_model (60 s)
# hidden 2048, 16 heads; --quick: seq 512, batch 2, host RAM capped at 48 GiB; search budget 40 s
# (after ~15 s of imports and estimator bounds), probes bounded by what is left.
run_piece "bench_max_model quick 32GB" 60 "$OUT_DIR/bench_max_model.jsonl" \
    python benchmarks/bench_max_model.py --quick --gpu_memory 32GB --time_budget_s 40

# ---------------------------------------------------------------------------- bench_train (90 s)
# GPT-2-small-like (n_embd 768, 12 layers, seq 512, batch 8): 2 rounds x 8 steps per variant; no new
# run after 65 s (round 0 of plain and stronghold always runs), so the summary line always comes.
run_piece "bench_train cuda quick" 70 "$OUT_DIR/bench_train_cuda.jsonl" \
    python benchmarks/bench_train.py --device cuda --quick --model_size gpt2-small-like --worker_timeout 40 \
    --time_budget_s 50

# ---------------------------------------------------------------------------- optional bench_nvme (45 s)
# The NVMe tier on this machine's disk: its read/write GB/s, then an 8-block Llama's step with the
# state in RAM, the moments on disk, and masters and moments on disk (ratio_of_disk_bound: the
# update phase against the disk's bound). Only when 45 s of the 490 are left.
if [ $((490 - (SECONDS - START))) -ge 45 ]; then
    NVME_DIR=$(mktemp -d "${TMPDIR:-/tmp}/stronghold-nvme-XXXX")
    run_piece "bench_nvme cuda" 45 "$OUT_DIR/bench_nvme_cuda.jsonl" \
        python benchmarks/bench_nvme.py --nvme_path "$NVME_DIR" --disk_mb 512 --layers 8 --steps 3
    rm -rf "$NVME_DIR"
else
    log "bench_nvme cuda: skipped, under 45 s left"
fi

# ---------------------------------------------------------------------------- optional bench_fetch (30 s)
# host_image=False: fp32 -> bf16 conversion of a Llama-3-8B block (218 M elements) against the pinned
# copy it feeds, and a bf16 Llama's step with the image kept and dropped (bench_fetch.py).
# Only when 30 s of the 490 are left, so the worst case stays as it was.
if [ $((490 - (SECONDS - START))) -ge 30 ]; then
    run_piece "bench_fetch cuda" 30 "$OUT_DIR/bench_fetch_cuda.jsonl" \
        python benchmarks/bench_fetch.py --numel 218e6 --repeats 3 --steps 4
else
    log "bench_fetch cuda: skipped, under 30 s left"
fi

# ---------------------------------------------------------------------------- optional bf16 step
LEFT=$((490 - (SECONDS - START)))
if [ "$LEFT" -ge 60 ]; then
    run_piece "bench_step cuda bf16" "$LEFT" "$OUT_DIR/bench_step_cuda_bf16.jsonl" \
        python benchmarks/bench_step.py --device cuda --model gpt2-medium-like --seq 512 --batch 8 \
        --windows 1,2,4 --precision bf16 --warmup 2 --rounds 3 --block_steps 3 --time_budget_s $((LEFT - 20))
else
    log "bench_step cuda bf16: skipped, only ${LEFT}s left"
fi

log "done in $((SECONDS - START))s, failed=$FAILED"
exit "$FAILED"
