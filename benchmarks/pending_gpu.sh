#!/usr/bin/env bash
# What remains to be measured on a GPU (issues 16, 17, 18, 19), as parts of one script so that a
# session with a fresh device budget spends it on measurements, not on planning. Each part writes
# under $OUT; the last step bundles everything into $OUT/pending-<gpu>-<date>.tgz plus a short
# table on stdout (the device tool brings back at most 8 files).
#
#   PARTS="predict sweep" bash benchmarks/pending_gpu.sh        # one device call (< 10 min)
#   PARTS="serve llm" bash benchmarks/pending_gpu.sh            # needs .whl/ carried (see below)
#   PARTS="overhead" bash benchmarks/pending_gpu.sh
#
# Parts and their rough wall time on one H100/H200:
#   predict   issue 17: 5 workloads x 2 batch sizes with a profiler window (~6 min); run once on
#             an H100 and once on an H200, then predict_validation.py on both tarballs
#   sweep     issue 18: a 4-cell sweep through the local executor (~2 min)
#   serve     issue 16: resnet50 + bert-base, highest rate at a 50 ms p99 SLO, batching on/off (~6 min)
#   llm       issue 16: the generative tenant against a plain greedy loop (~3 min)
#   overhead  issue 19: plain loop vs gpulens, resnet18 b1/b8/b64 and resnet50 b256, 5 pairs (~6 min)
#   workers   issue 17: allocate-workers against an even split (~8 min). The bf16 default mix
#             (resnet50, mobilenet_v3_small, resnet18) is loader-bound with near-equal curves
#             (session 14: no gain); a mix whose curves differ, where a split can gain:
#             ALLOC_JOBS=vit_b_16,resnet18,mobilenet_v3_small ALLOC_PRECISION=fp32 (vit_b_16
#             fp32 should saturate at 2-3 JPEG workers, the others not within 12)
#   agreement issue 15: examples/train_tracked.py, tracker API vs injection, 8 interleaved pairs
#             over the script's own 20k files (~6 min)
#   gpm       issue 19: does sampling GPM cost a launch-bound loop? sampler-only blocks with GPM
#             once a second (the default since 838a8f6), at every 10 Hz sample, and without,
#             GPM_BLOCKS (28) pairs each, r18 b1 and b8, SM clock after every block (~8 min; H100 and H200)
#   timer     (superseded by interleaved) issue 19: where the step timer's cost at batch 1 comes from (H200, session 16:
#             0.962 and 0.979 of the plain loop with the timer alone, none at batch 8): blocks
#             with the full timer, the timer without CUDA events, and timer + sampler, 24 pairs
#             each, r18 b1 and b8 (~6 min; H200 first, then H100)
#   interleaved issue 19: each part of gpulens (step timer, timer without events, sampler, both,
#             tracking API, injection into an unmodified script's DataLoader and optimizer) against
#             the plain step, alternating every ~50 ms inside one loop, with a plain/plain
#             control; r18 b1 and b8 (~7 min; H200 and H100). INTERLEAVED_ARMS picks arms (the
#             full_* arms take "full" apart). Session 18, pooled over four H200s with
#             benchmarks/overhead_pooled.py: full 0.992 (b1), 0.993 (b8); per machine b1
#             0.979-0.999. Next: a quiet H100 since 24d8ca2 (this session's two were noisy hosts)
#   pin       issue 19: is the launch-bound noise the host's scheduling? r18 b8 and b1 whole-run
#             pairs, unpinned, then the same pinned to 4 CPUs of distinct physical cores (~4 min)
#
# Issue 17's other scripts (session 19), run on their own: predict_ladder.sh (PARTS=gpus on an
# H100 pair is still to do: every 2-GPU call so far came back as H200s), ddp_overhead.sh (where
# a DDP step's time beyond the all-reduce goes; 2 GPUs) and workers_ladder.sh (predict --workers
# on a job's own runs; longer runs than its 20 s would tell how much of its 11.2% is the runs').
#
# The serve extra (starlette, uvicorn) is not on the GPU image; its wheels travel in .whl/
# (git-ignored): `pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl
# starlette uvicorn httptools` here (httptools: the cp312 manylinux wheel), `carry: [".whl"]` in
# the device call. aiohttp, anyio, h11, click and uvloop are already on the image.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
PARTS=${PARTS:-"predict sweep"}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT/pending"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr ' ' '_')
gpu=${gpu:-cpu}
day=$(date +%F)
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
step() { echo "=== $* ($(date +%T))" >&2; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader || true

if [[ " $PARTS " == *" serve "* || " $PARTS " == *" llm "* ]]; then
  if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
  fi
  python3 -c "import starlette, uvicorn" 2> /dev/null \
    || echo "serve extra missing: carry .whl with starlette and uvicorn wheels" >&2
fi

for part in $PARTS; do
  step "$part"
  t0=$(date +%s)
  case $part in
    predict)
      OUT="$OUT/pending" bash benchmarks/predict_session.sh ;;
    sweep)
      OUT="$OUT/pending/sweep" bash benchmarks/sweep_gpu.sh ;;
    agreement)
      timeout "${AGREEMENT_TIMEOUT_S:-380}" python3 benchmarks/unmodified_check.py agreement \
        --pairs "${AGREEMENT_PAIRS:-8}" --agreement-cases files_gpu --work /tmp/uc \
        --out "$OUT/pending/agreement-files_gpu-$commit-$gpu-$day.json" \
        2> "$OUT/pending/agreement.log" | tail -4 ;;
    gpm)
      timeout 560 python3 benchmarks/launch_overhead.py --cases r18_b1,r18_b8 --no-whole-runs \
        --no-timer-blocks --blocks "${GPM_BLOCKS:-28}" --block-s 0.5 --sampler-blocks gpu,gpu_gpm10hz,gpu_no_gpm \
        --ablations "" --no-tracker --out "$OUT/pending/launch_overhead-gpm-$commit-$gpu-$day.json" \
        | grep -v "^  pair" | tail -8 ;;
    timer)
      timeout 560 python3 benchmarks/launch_overhead.py --cases r18_b1,r18_b8 --no-whole-runs \
        --blocks "${TIMER_BLOCKS:-24}" --block-s 0.5 --host-timer-blocks --ablations "" --no-tracker \
        --out "$OUT/pending/launch_overhead-timer-$commit-$gpu-$day.json" | grep -v "^  " | tail -8 ;;
    interleaved)
      timeout 560 python3 benchmarks/overhead_interleaved.py --cases "${INTERLEAVED_CASES:-r18_b1,r18_b8}" \
        --arms "${INTERLEAVED_ARMS:-aa,timer,host_timer,sampler,full,tracker,inject}" \
        --seconds "${INTERLEAVED_S:-25}" --out "$OUT/pending/overhead_interleaved-$commit-$gpu-$day.json" \
        | tail -20 ;;
    pin)
      lscpu > "$OUT/pending/lscpu.txt" 2>&1
      grep . /sys/devices/system/cpu/cpu*/topology/thread_siblings_list > "$OUT/pending/siblings.txt" 2>&1
      cpus=$(python3 benchmarks/distinct_cores.py 4)
      echo "pinned set: $cpus" | tee -a "$OUT/pending/parts.txt" >&2
      for how in unpinned pinned; do
        wrap=(); [ "$how" = pinned ] && wrap=(taskset -c "$cpus")
        timeout 200 "${wrap[@]}" python3 benchmarks/launch_overhead.py --cases r18_b8,r18_b1 \
          --ablations "" --no-tracker --pairs 8 --trial-s 2 \
          --out "$OUT/pending/launch_overhead-$how-$commit-$gpu-$day.json" | tail -4
      done ;;
    serve)
      timeout "${SERVE_TIMEOUT_S:-480}" python3 benchmarks/serve_gpu.py --out "$OUT/pending/serve_gpu-$commit-$gpu-$day.json" ;;
    llm)
      timeout "${LLM_TIMEOUT_S:-300}" python3 benchmarks/serve_llm_gpu.py --out "$OUT/pending/serve_llm_gpu-$commit-$gpu-$day.json" ;;
    overhead)
      timeout 480 python3 benchmarks/launch_overhead.py --cases r18_b1,r18_b8,r18_b64,r50_b256 \
        --ablations "" --pairs 5 --out "$OUT/pending/launch_overhead-$commit-$gpu-$day.json" ;;
    workers)
      timeout 540 python3 benchmarks/allocate_workers_gpu.py \
        --jobs "${ALLOC_JOBS:-resnet50,mobilenet_v3_small,resnet18}" \
        --cpus 12 --grid 1,2,4,8 --images 10000 --duration 10 --precision "${ALLOC_PRECISION:-bf16}" --pin \
        --out "$OUT/pending/allocate_workers-$commit-$gpu-$day.json" ;;
    *)
      echo "unknown part '$part': use predict, sweep, serve, llm, overhead, workers, agreement, gpm, timer, interleaved or pin" >&2 ;;
  esac
  echo "$part: exit $? after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/pending/parts.txt" >&2
done
tar czf "$OUT/pending-$commit-$gpu-$day.tgz" -C "$OUT" pending && rm -rf "$OUT/pending"
echo "bundle: $OUT/pending-$commit-$gpu-$day.tgz"
