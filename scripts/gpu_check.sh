#!/usr/bin/env bash
# One-shot GPU check for a CUDA machine, written for issue #34 ("Fast on a real GPU") on an H200
# session with a strict budget: it ends within 8 minutes (the device session has 15 in all,
# the machine's start included), and ends with ONE summary in which every piece is a number and
# every target of #34 and #35 ("What fits stays resident") is listed as met or unmet.
#
#   bash scripts/build_gpu_wheels.sh     # here, before: DeepSpeed & co into .whl/ (git-ignored)
#   bash scripts/gpu_check.sh            # there, from anywhere in the repository (device tool: carry .whl)
#   bash scripts/gpu_check.sh --cpu      # dry run on a CPU: the same pieces on tiny shapes, same summary
#
# Setup (~15 s): when .whl/ holds wheels and this is Python 3.12, they go into /tmp/site
# (`pip install --no-index --no-deps --target`; PYTHONPATH after the repository root). With
# DeepSpeed among them, its CPU Adam starts compiling in the background at once (JIT, about a
# minute), so that the peers that need it, several minutes later, load it from the cache.
#
# The pieces, in order of priority, each under `timeout` for min(its budget, what is left of the
# 465 s); a piece is skipped (and says so) when fewer than its minimum seconds are left. A
# benchmark's own --time_budget_s is its timeout minus a margin, so it stops starting rounds and
# still prints its summary line.
#   id               budget/min  what
#   pytest_gpu         80/40     the CUDA tests (tests/test_gpu.py), no -x: parity, delay injection, the
#                                ledger against the allocator (what it held at its peak, by who
#                                allocated it: ledger_vs_allocator.json), deep == shallow peak, ...
#   host               35/20     #41: bench_host, width 32 at 8 and 40 blocks: the engine's host work per
#                                block over plain's (<= 0.30), and whether the GPU waited on the host
#   long               60/30     #42: bench_long --longest, a Llama-3.2-1B shape: one tiled bf16 step at the
#                                longest sequence the estimator says fits this GPU; its peak vs the estimate
#   long_attention     45/25     #42: the same with attention tiling, up to 128k tokens: the query tiles'
#                                count (no mask with flash) against the allocator's peak
#   step_gpt2_fp32     50/35     bench_step, GPT-2-medium shape (354 M), fp32: plain, auto, W=1 (all
#                                streamed); the bound
#   step_gpt2_bf16     55/40     the same in bf16, with DeepSpeed ZeRO-Offload next to it
#   split_step         75/50     #35: bench_step, GPT-2-medium bf16, window auto, at the budgets all, half
#                                and a quarter of plain's 16 B/param, and streamed; each split's bound;
#                                Twin-Flow (DeepSpeed ZeRO-3, offload ratio 0.25/0.5/0.75/1) next to it
#   train              70/50     bench_train (Trainer, GPT-2-small): plain, --stronghold auto and W=1,
#                                ZeRO-Offload (TrainingArguments(deepspeed=...)), FSDP2 CPUOffloadPolicy
#   split_train        50/35     #35: bench_train (GPT-2-small, bf16) at the same four budgets, and plain
#   step_llama_bf16    70/50     bench_step, Llama-3.2-1B shape (1.24 B), bf16, with ZeRO-Offload
#   step_llama_fp32    70/50     the same in fp32, without the peer
#   estimate           50/35     bench_estimate: the estimator against the allocator, Llama-3-8B shapes, 2 blocks
#   memory             55/35     bench_memory: ledger vs allocator at 4/16/64 blocks (first step apart,
#                                autograd's saved tensors counted, allocator history at the peak), sweeps
#   max_model          50/40     optional: bench_max_model --quick under a 32 GB cap
#   nvme               40/30     optional: bench_nvme
#   fetch              30/25     optional: bench_fetch
# A piece that fails or times out is recorded and the script goes on. The exit status is
# non-zero if any piece failed (a failing test included).
#
# Output in ${OUT:-out}/ (the device tool brings back at most 8 files, so there are two):
#   summary.txt      the log, each benchmark's summary line, then the #34 summary (scripts/gpu_summary.py)
#   details.tar.gz   every piece's output (<id>.jsonl, gpu_tests.txt), pieces.tsv, targets.json,
#                    env.txt, stderr.log, the allocator diagnostics (*.json); refreshed after each piece
set -uo pipefail
export PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

MODE=cuda
case "${1:-}" in
    "") ;;
    --cpu) MODE=cpu ;;
    *) echo "usage: bash scripts/gpu_check.sh [--cpu]" >&2; exit 2 ;;
esac

cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-out}"
mkdir -p "$OUT_DIR"
DETAILS=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
export STRONGHOLD_DIAG_DIR="$DETAILS"  # where tests/test_gpu.py and bench_memory write their diagnostics
SUMMARY="$OUT_DIR/summary.txt"
ERR="$DETAILS/stderr.log"
PIECES="$DETAILS/pieces.tsv"
: >"$SUMMARY"
: >"$ERR"
: >"$PIECES"
# 480 s in all: 15 s stay for the summary and the tarball. The CPU dry run checks the plumbing,
# not the time: its budgets are 4x and its total 30 min.
TOTAL=${GPU_CHECK_TOTAL_S:-$([ "$MODE" = cuda ] && echo 465 || echo 1800)}
SCALE=$([ "$MODE" = cuda ] && echo 1 || echo 4)  # budgets x4 on a (shared, 2-core) CPU
START=$SECONDS
FAILED=0

log() { echo "[$((SECONDS - START))s] $*" | tee -a "$SUMMARY"; }
left() { echo $((TOTAL - (SECONDS - START))); }
pack() {
    cp "$SUMMARY" "$DETAILS/summary.txt" 2>/dev/null
    tar -czf "$OUT_DIR/details.tar.gz.part" -C "$DETAILS" . 2>/dev/null && mv -f "$OUT_DIR/details.tar.gz.part" "$OUT_DIR/details.tar.gz"
}
trap 'pack; exit 143' TERM INT

record() {  # record ID STATUS SECONDS NOTE: one line of pieces.tsv (read by gpu_summary.py)
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$PIECES"
}

# run_piece ID BUDGET MIN MARGIN CMD...: CMD under `timeout` for min(BUDGET, time left), stdout
# into $DETAILS/ID.jsonl (gpu_tests.txt for the tests), stderr into stderr.log. Skipped when
# under MIN s are left. An argument @SOFT@ becomes the timeout minus MARGIN.
run_piece() {
    local id=$1 budget=$(($2 * SCALE)) min=$3 margin=$4
    shift 4
    local avail t
    avail=$(($(left) - 5))  # timeout's --kill-after
    t=$((budget < avail ? budget : avail))
    if [ "$t" -lt "$min" ]; then
        record "$id" "skipped" 0 "${avail}s of the ${TOTAL}s left, needs ${min}s"
        log "$id: skipped, ${avail}s left, needs ${min}s"
        return 0
    fi
    local args=() a
    for a in "$@"; do
        [ "$a" = "@SOFT@" ] && a=$((t - margin))
        args+=("$a")
    done
    local outfile="$DETAILS/$id.jsonl"
    [ "$id" = pytest_gpu ] && outfile="$DETAILS/gpu_tests.txt"
    echo "===== $id (timeout ${t}s): ${args[*]}" >>"$ERR"
    local t0=$SECONDS rc=0 status
    timeout --kill-after=5 "$t" "${args[@]}" >"$outfile" 2>>"$ERR" || rc=$?
    if [ "$rc" -eq 0 ]; then
        status=ok
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        status="timed out after ${t}s"
        FAILED=1
    else
        status="failed (exit $rc)"
        FAILED=1
    fi
    record "$id" "$status" "$((SECONDS - t0))" ""
    log "$id: $status in $((SECONDS - t0))s"
    if [ "$id" = pytest_gpu ]; then
        tail -n 3 "$outfile" >>"$SUMMARY"
    elif [ -s "$outfile" ]; then
        tail -n 1 "$outfile" >>"$SUMMARY"  # a benchmark's last line is its summary
    fi
    pack
}

skip_piece() {  # skip_piece ID REASON
    record "$1" "skipped" 0 "$2"
    log "$1: skipped, $2"
}

# ---------------------------------------------------------------------------- setup (~15 s)
# The repository root on PYTHONPATH (the machine has torch but not this package, and no index
# for an editable install), then the carried wheels, ahead of the image's site-packages.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
    if python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
        if python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl >>"$ERR" 2>&1; then
            export PYTHONPATH="$PWD:/tmp/site"
            log "wheels: $(ls .whl/*.whl | wc -l) from .whl/ installed into /tmp/site"
        else
            log "wheels: pip install failed (stderr.log); going on with the image's packages"
        fi
    else
        log "wheels: not installed, they are cp312 and this is Python $(python -c 'import sys; print(sys.version.split()[0])')"
    fi
else
    log "wheels: no .whl/ (scripts/build_gpu_wheels.sh makes it): no DeepSpeed, the image's transformers"
fi
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
    nproc
} >"$DETAILS/env.txt" 2>&1
ENV_CHECK='import importlib.util as u, torch, transformers, accelerate, stronghold_hf
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
print("transformers", transformers.__version__, "accelerate", accelerate.__version__,
      "deepspeed", u.find_spec("deepspeed") is not None)'
if ! python -c "$ENV_CHECK" >>"$DETAILS/env.txt" 2>>"$ERR"; then
    log "FATAL: cannot import torch/transformers/accelerate/stronghold_hf; see stderr.log"
    record setup "failed" "$((SECONDS - START))" "imports"
    python scripts/gpu_summary.py "$DETAILS" | tee -a "$SUMMARY"
    pack
    exit 2
fi
log "$(tail -n 2 "$DETAILS/env.txt" | tr '\n' ' ')"
if [ "$MODE" = cuda ] && ! python -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
    log "FATAL: no CUDA device (use --cpu for a dry run)"
    exit 2
fi
# DeepSpeed's CPU Adam is a JIT extension (ninja, g++): built once in the background into
# TORCH_EXTENSIONS_DIR; a peer that starts before it is done waits on the build's lock file.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}"
if [ "$MODE" = cuda ] && python -c 'import importlib.util as u, sys; sys.exit(u.find_spec("deepspeed") is None)'; then
    (timeout 300 python -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()' \
        >"$DETAILS/deepspeed_cpu_adam_build.log" 2>&1; echo "exit $?" >>"$DETAILS/deepspeed_cpu_adam_build.log") &
    log "deepspeed: its CPU Adam compiles in the background (into $TORCH_EXTENSIONS_DIR)"
fi
record setup ok "$((SECONDS - START))" ""
log "setup done"
pack

# ---------------------------------------------------------------------------- the pieces
if [ "$MODE" = cuda ]; then
    DEV=(--device cuda)
    GPT2=(--model gpt2-medium-like --warmup 2 --rounds 3 --block_steps 3)
    LLAMA=(--model llama-3.2-1b-like --warmup 2 --rounds 2 --block_steps 3)
    TRAIN=(--quick --model_size gpt2-small-like --worker_timeout 45)
    # Plain, three split variants, the streamed one and four Twin-Flow engines: two rounds of 3.
    SPLIT=(--model gpt2-medium-like --warmup 1 --rounds 2 --block_steps 3 --precision bf16 --peers twinflow)
    SPLIT_TRAIN=(--model_size gpt2-small-like --precision bf16 --steps 6 --skip 2 --rounds 1 --worker_timeout 45)
    MEMORY=(--width 512 --depths 4,16,64 --seq 32 --batch 1 --cap_third --vocab_sweep 4096,131072
            --seq_sweep 512,8192 --depth_sweep 2,32)
    ESTIMATE=(--layers 2 --seq 4096)
    HOST=(--rounds 4 --steps 4 --variants gpu_config,gpu_default)  # on CUDA the defaults are gpu_default
    LONG=(--hidden 2048 --ffn 8192 --layers 16 --heads 32 --vocab 128256 --tile_tokens auto)  # Llama-3.2-1B
    LONG_ATTENTION_MAX=131072
else
    DEV=(--device cpu)
    GPT2=(--model smoke --warmup 1 --rounds 2 --block_steps 3 --threads 1)
    LLAMA=(--model llama-smoke --warmup 1 --rounds 2 --block_steps 3 --threads 1)
    TRAIN=(--model_size smoke --steps 4 --skip 1 --rounds 1 --memory none --threads 1 --worker_timeout 120)
    # 12 tiny blocks, so that half and a quarter keep some of them next to the window.
    SPLIT=(--model smoke --n_layer 12 --warmup 1 --rounds 2 --block_steps 3 --threads 1 --peers twinflow)
    SPLIT_TRAIN=(--model_size smoke --n_layer 12 --steps 4 --skip 1 --rounds 1 --memory none --threads 1)
    MEMORY=(--width 32 --depths 4,8 --steps 2 --seq 8 --sweep_hidden 64 --sweep_seq 64 --sweep_vocab 1024
            --vocab_sweep 512,4096 --seq_sweep 64,256 --depth_sweep 2,8)
    ESTIMATE=(--hidden 256 --ffn 512 --heads 4 --kv_heads 2 --vocab 8192 --seq 256)
    HOST=(--smoke)
    LONG=(--hidden 64 --ffn 224 --layers 2 --heads 2 --vocab 512)
    LONG_ATTENTION_MAX=8192
fi
STEP=(python benchmarks/bench_step.py "${DEV[@]}" --windows auto,1 --time_budget_s @SOFT@)

BUDGETS=(--budgets all,half,quarter,streamed)

# The budgets through step_llama_bf16 sum to 465 s with the setup's 15: the Llama fp32 run and the
# optional pieces get what the pieces before them leave unused (pytest_gpu took 48 s of its 80 on
# the H200). #35's pieces come after #34's GPT-2 runs and before its Llama ones.
run_piece pytest_gpu 80 40 0 python -m pytest -m gpu tests -q -p no:cacheprovider
run_piece host 35 20 0 python benchmarks/bench_host.py "${DEV[@]}" "${HOST[@]}"
run_piece long 60 30 0 python benchmarks/bench_long.py "${DEV[@]}" --longest "${LONG[@]}"
run_piece long_attention 45 25 0 python benchmarks/bench_long.py "${DEV[@]}" --longest --longest_variant attention \
    --max_tokens "$LONG_ATTENTION_MAX" "${LONG[@]}"
run_piece step_gpt2_fp32 50 35 18 "${STEP[@]}" "${GPT2[@]}" --peers none
if [ "$MODE" = cuda ]; then
    run_piece step_gpt2_bf16 55 40 20 "${STEP[@]}" "${GPT2[@]}" --precision bf16 --peers zero_offload
else
    skip_piece step_gpt2_bf16 "bf16 needs CUDA (CPU autocast refuses GPT-2's bf16 LayerNorm)"
fi
run_piece split_step 75 50 28 python benchmarks/bench_step.py "${DEV[@]}" --windows auto "${BUDGETS[@]}" \
    "${SPLIT[@]}" --time_budget_s @SOFT@
run_piece train 70 50 22 python benchmarks/bench_train.py "${DEV[@]}" "${TRAIN[@]}" \
    --variants plain,stronghold_auto,stronghold_w1 --peers zero2,fsdp2 --time_budget_s @SOFT@
run_piece split_train 50 35 15 python benchmarks/bench_train.py "${DEV[@]}" "${SPLIT_TRAIN[@]}" "${BUDGETS[@]}" \
    --variants plain --peers none --time_budget_s @SOFT@
if [ "$MODE" = cuda ]; then
    run_piece step_llama_bf16 70 50 28 "${STEP[@]}" "${LLAMA[@]}" --precision bf16 --peers zero_offload
else
    skip_piece step_llama_bf16 "bf16 needs CUDA in bench_step"
fi
run_piece step_llama_fp32 70 50 28 "${STEP[@]}" "${LLAMA[@]}" --peers none
run_piece estimate 50 35 0 python benchmarks/bench_estimate.py "${DEV[@]}" "${ESTIMATE[@]}"
run_piece memory 55 35 0 python benchmarks/bench_memory.py "${DEV[@]}" "${MEMORY[@]}"
if [ "$MODE" = cuda ]; then
    run_piece max_model 50 40 0 python benchmarks/bench_max_model.py --quick --gpu_memory 32GB --time_budget_s 30
    NVME_DIR=$(mktemp -d "${TMPDIR:-/tmp}/stronghold-nvme-XXXX")
    # A 32,000-row untied vocabulary, larger than a block: the ring is sized by a block (segments).
    run_piece nvme 40 30 0 python benchmarks/bench_nvme.py --nvme_path "$NVME_DIR" --disk_mb 512 --layers 8 --steps 3 \
        --vocab 32000
    rm -rf "$NVME_DIR"
    run_piece fetch 30 25 0 python benchmarks/bench_fetch.py --numel 218e6 --repeats 3 --steps 4
else
    skip_piece max_model "needs CUDA"
    NVME_DIR=$(mktemp -d "${TMPDIR:-/tmp}/stronghold-nvme-XXXX")
    run_piece nvme 120 30 0 python benchmarks/bench_nvme.py --nvme_path "$NVME_DIR" --disk_mb 16 --layers 2 \
        --hidden 64 --seq 16 --steps 2 --vocab 32000
    rm -rf "$NVME_DIR"
    skip_piece fetch "its conversion-vs-copy part needs CUDA"
fi

# ---------------------------------------------------------------------------- the summary
log "done in $((SECONDS - START))s, failed=$FAILED"
python scripts/gpu_summary.py "$DETAILS" | tee -a "$SUMMARY"
pack
exit "$FAILED"
