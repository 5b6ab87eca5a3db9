#!/usr/bin/env bash
# Every GPU table BENCHMARKS.md waits for (issues 12 and 16), on one lent GPU.
#
#   bash benchmarks/gpu_all.sh            # every part, in order (about 28 minutes on an H100)
#   bash benchmarks/gpu_all.sh fp8 llama  # some parts: each stays under 10 minutes, so a
#                                         # device call per part fits the tool's limit
#
# Parts (each writes JSON under benchmarks/results/ and prints its table):
#   throughput  405M GPT, bf16, hand-written loop vs meshfit, eager and compiled, MFU
#               (batch 16, then 32 compiled)                           ~5 min
#   llama       a 1.24B transformers Llama through mf.fit unchanged, eager and
#               compiled: tokens/s, MFU (issue 16 item 1)              ~4 min
#   fp8         bf16 vs precision="fp8" on that Llama, 300 steps each, compiled:
#               speed-up and loss curves (issue 16 item 2)             ~5 min
#   planner     the planner's step time and peak memory against measured, GPT
#               125M / 405M / 1.3B, recomputation, eager / compiled (issue 12)  ~5 min
#   overhead    the small demo GPT: hand-written vs engine vs fit     ~3 min
#   meta        a 1.24B Llama built on the CPU / on meta / on meta + weights=: GPU peaks
#               at build, over two steps and at save, values checked (issue 30)  ~3 min
#   issue50     what is left of issue 50, in its order (estimates, not yet run):
#               1. what is alive at the compiled chunked step's memory peak, beside the
#                  whole one's (gpu_llama.py --memory)                    ~2 min
#               2. MFU levers: cuDNN's attention kernel, batch 8           ~3 min
#               3. the fp8 levers at batch 8: tensorwise, rowwise, the head in
#                  float8, against bf16 (80 steps: a screen; the winner then
#                  gets the 300-step run issue 50 asks)                    ~5 min
#               each under its own --deadline-s; run as two device calls:
#               `gpu_all.sh issue50-memory` then `gpu_all.sh issue50-fp8`
#
# The machine needs meshfit's source (this checkout) and, for fp8, torchao: the lent GPUs
# cannot download, so carry the wheel (pip download torchao==0.18.0 --no-deps -d wheels/)
# and this script installs it from wheels/ when it is there.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}

if compgen -G "wheels/torchao-*.whl" > /dev/null && ! "$PY" -c "import torchao" 2> /dev/null; then
    "$PY" -m pip install --quiet --no-deps wheels/torchao-*.whl
fi

part() {
    echo "=== $1 ($(date -u +%H:%M:%S))"
    case "$1" in
        throughput)
            "$PY" benchmarks/gpu_throughput.py
            "$PY" benchmarks/gpu_throughput.py --modes compile --batch-size 32 \
                --out benchmarks/results/gpu-throughput-batch32.json ;;
        llama) "$PY" benchmarks/gpu_llama.py ;;
        fp8) "$PY" benchmarks/gpu_fp8.py ;;
        planner) "$PY" benchmarks/planner_gpu.py ;;
        overhead) "$PY" benchmarks/overhead.py --rounds 7 --steps 200 ;;
        meta) "$PY" benchmarks/gpu_meta_memory.py ;;
        issue50) part issue50-memory; part issue50-fp8 ;;
        issue50-memory)
            "$PY" benchmarks/gpu_llama.py --modes compile --rows whole:4,chunked:4 \
                --steps 4 --warmup 4 --log-every 2 --memory --deadline-s 150 \
                --out benchmarks/results/gpu-llama-memory.json
            "$PY" benchmarks/gpu_llama.py --modes compile --rows whole:4:cudnn,whole:8 \
                --steps 15 --warmup 5 --log-every 5 --profile --deadline-s 200 \
                --out benchmarks/results/gpu-llama-attention.json ;;
        issue50-fp8)
            "$PY" benchmarks/gpu_fp8.py --precisions bf16,fp8,fp8:rowwise,fp8+head \
                --batch-size 8 --steps 80 --warmup 20 \
                --out benchmarks/results/gpu-fp8-levers.json ;;
        *) echo "unknown part '$1': throughput, llama, fp8, planner, overhead, meta, issue50, issue50-memory, issue50-fp8" >&2; exit 2 ;;
    esac
}

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(throughput llama fp8 planner overhead meta)
for p in "${parts[@]}"; do part "$p"; done
