#!/usr/bin/env bash
# Every result file behind the docs, in two parts that each fit a 10-minute device call.
#   bash scripts/reproduce.sh check results    # ref_check grid (all head dims) + GPU tests
#   bash scripts/reproduce.sh perf  results    # CHECK=1 headline runs, the sweep, K4 tuning
#   bash scripts/reproduce.sh headline results # the CHECK=1 headline runs alone (a second GPU, say)
#   bash scripts/reproduce.sh ws results       # K5/K6: ref_check, sanitizers, sweep beside K4, ncu, tuning
#                                               (more than 10 minutes: on the device tool, run its lines in parts)
#   bash scripts/reproduce.sh decode results   # decode: KV-cache grid, contract grid, sanitizers, bench, tuning
#   bash scripts/reproduce.sh fp8check results # K7/K8: ref_check, sanitizers, GPU tests of the FP8 API
#   bash scripts/reproduce.sh fp8 results      # K7/K8: sweep beside cuDNN FP8, time split, tuning, accuracy
#   bash scripts/reproduce.sh final results    # issues 7 and 8 at the final code: sweep, decode grid, ref_check,
#                                               sanitizers, host times, GQA pair, GPU tests (about 45 minutes)
#   bash scripts/reproduce.sh call results     # the public call: host times before/after the fast path, the k6 and
#                                               FP8 sweeps and the k6 headline runs with both timings (~25 minutes)
#   bash scripts/reproduce.sh backward results # K9/K10: ref_check --backward, GPU tests, training, sanitizers, sweep
#   bash scripts/reproduce.sh features results # varlen, window, softcap (docs/varlen.md): the grids, racecheck/synccheck
# Each file records the command that wrote it; then, anywhere: python scripts/make_docs.py --plot
# Without a GPU: the SASS census of the KV-tile loops (results/sass-loops*.json, docs/k6.md), e.g.
#   python scripts/sass_loops.py --headdim 64 128 256 --causal 0 1 --fa4 --out results/sass-loops.json
#   python scripts/sass_loops.py --headdim 64 128 256 --causal 0 1 --out results/sass-loops-bc1bd43.json  # at bc1bd43
set -euo pipefail
part=${1:?check or perf}
dir=${2:-results}
py=$(command -v python3 || command -v python)
if ! $py -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "error: reproduce.sh times and checks on a GPU (an H100/H200), and no CUDA GPU is visible here;" \
       "without one: python bench.py all --compile-only" >&2
  exit 2
fi
mkdir -p "$dir"
gpu=$($py -c "import torch, re; n = torch.cuda.get_device_name(); print((re.search(r'H100|H200', n) or [n.split()[-1]])[0].lower())")
case "$part" in
  check)  # both run even if the first fails; the exit status reports either failure
    rc=0
    $py ref_check.py all --all-head-dims --out "$dir/refcheck-$gpu.json" | tee "$dir/refcheck-$gpu.log" || rc=1
    $py -m pytest -m gpu -q tests/test_gpu.py 2>&1 | tail -5 || rc=1
    exit $rc
    ;;
  perf|headline)
    CHECK=1 SEQLEN=4096 HEADDIM=128 $py bench.py k1 k2 --out "$dir/bench-k2-$gpu.json"
    for causal in 0 1; do
      CHECK=1 SEQLEN=8192 HEADDIM=128 CAUSAL=$causal $py bench.py k4 --out "$dir/bench-k4-c$causal-$gpu.json"
    done
    if [ "$part" = perf ]; then
      $py bench.py all --sweep --out "$dir/sweep-$gpu.json" > "$dir/sweep-$gpu.log"
      $py scripts/k4_tune.py --out "$dir/k4-tune-$gpu.json"
    fi
    ;;
  ws)  # the warp-specialized stages; a hang ends at its timeout with a message, never blocks the rest
    rc=0
    timeout 420 $py ref_check.py k4_seed k5 k6_pp k6_overlap k6 --all-head-dims --out "$dir/refcheck-ws-$gpu.json" \
      > "$dir/refcheck-ws-$gpu.log" || { echo "ref_check failed or timed out (exit $?)"; rc=1; }
    for k in k5 k6; do  # racecheck: hazards on SMEM; synccheck: barrier misuse. Small shapes, our kernels only.
      for args in "--causal 0" "--causal 1" "--headdim 256 --causal 0"; do
        timeout 120 compute-sanitizer --tool racecheck --kernel-name kns=FMHA $py scripts/sanitize_case.py $k $args \
          2>&1 | grep "SUMMARY\|: ok\|FAIL" || { echo "racecheck $k $args: timed out or failed"; rc=1; }
      done
      timeout 120 compute-sanitizer --tool synccheck --kernel-name kns=FMHA $py scripts/sanitize_case.py $k --causal 1 \
        2>&1 | grep "SUMMARY\|: ok\|FAIL" || { echo "synccheck $k: timed out or failed"; rc=1; }
    done | tee "$dir/sanitizer-$gpu.txt"
    timeout 300 $py bench.py k4 k5 k6_pp k6_overlap k6 --sweep --out "$dir/ws-sweep-$gpu.json" > "$dir/ws-sweep-$gpu.log" || rc=1
    timeout 600 $py scripts/ncu_profile.py --out "$dir/ncu-profile-$gpu.json" || rc=1
    timeout 330 $py scripts/tune.py --kernels k6 --seqlen 512 2048 8192 16384 --causal 1 \
      --configs '[{}, {"scheduler": "single"}, {"scheduler": "static"}]' --out "$dir/ws-tune-$gpu-scheduler.json" || rc=1
    timeout 300 $py scripts/tune.py --kernels k6 --headdim 64 128 --seqlen 512 1024 4096 \
      --configs '[{}, {"q_stages": 1}]' --out "$dir/ws-tune-$gpu-qstages.json" || rc=1
    # L2 section size (schedule.SECTION_BYTES) and the short-sequence tiles (k6.SHORT_SEQUENCE_CONFIG)
    timeout 300 $py scripts/tune.py --kernels k6 --headdim 64 128 256 --causal 1 --seqlen 512 1024 2048 8192 \
      --configs '{"k6":[{}, {"section_bytes":26214400}, {"section_bytes":13107200}, {"section_bytes":6553600}, {"section_bytes":3276800}, {}]}' \
      --out "$dir/ws-tune-$gpu-sections.json" || rc=1
    timeout 200 $py scripts/tune.py --kernels k6 --headdim 64 --causal 1 --seqlen 512 1024 2048 \
      --configs '{"k6":[{}, {"num_wg":3}, {}, {"num_wg":3}]}' --out "$dir/ws-tune-$gpu-d64wg.json" || rc=1
    timeout 200 $py scripts/tune.py --kernels k6 --headdim 256 --causal 0 1 --seqlen 512 1024 2048 \
      --configs '{"k6":[{}, {"tile_n":64}, {}, {"tile_n":64}]}' --out "$dir/ws-tune-$gpu-d256n.json" || rc=1
    # d=256: the TMA store at short and long sequences (k6.TMA_STORE_UP_TO_SEQLEN); d=128 non-causal
    # key tiles with the overlap (k6.NON_CAUSAL_TILE_N_WITH_OVERLAP)
    timeout 150 $py scripts/tune.py --kernels k6 --headdim 256 --causal 0 1 --seqlen 512 1024 \
      --configs '{"k6":[{}, {"q_stages":2,"kv_stages":1}, {"tma_store":true}, {"pingpong":true,"overlap":false}, {}]}' \
      --out "$dir/ws-tune-$gpu-d256short.json" || rc=1
    timeout 260 $py scripts/tune.py --kernels k6 --headdim 256 --causal 0 1 --seqlen 2048 4096 8192 16384 \
      --configs '{"k6":[{}, {"tma_store":true}, {}, {"tma_store":true}]}' --out "$dir/ws-tune-$gpu-d256tmastore.json" || rc=1
    timeout 400 $py scripts/tune.py --kernels k6 --headdim 128 --causal 0 --seqlen 4096 8192 16384 \
      --configs '{"k6":[{}, {"tile_n":144}, {"tile_n":160}, {"tile_n":160,"q_stages":1}, {}, {"tile_n":144}, {"tile_n":160}]}' \
      --out "$dir/ws-tune-$gpu-d128n.json" || rc=1
    timeout 300 $py scripts/tune.py --kernels k6 --headdim 64 --causal 0 --seqlen 4096 8192 16384 \
      --configs '{"k6":[{}, {"tile_n":160}, {"tile_n":192}, {}, {"tile_n":160}, {"tile_n":192}]}' \
      --out "$dir/ws-tune-$gpu-d64n.json" || rc=1
    # the overlap at d=64 (128-key tiles: spills 12 bytes non-causal) and 144-key tiles for d=128 causal
    timeout 250 $py scripts/tune.py --kernels k6 --headdim 64 --causal 1 --seqlen 2048 4096 8192 16384 \
      --configs '{"k6":[{}, {"overlap":true,"tile_n":128}, {}, {"overlap":true,"tile_n":128}]}' \
      --out "$dir/ws-tune-$gpu-d64overlap.json" || rc=1
    timeout 200 $py scripts/tune.py --kernels k6 --headdim 64 --causal 0 --seqlen 4096 8192 16384 \
      --configs '{"k6":[{}, {"overlap":true,"tile_n":128}, {}, {"overlap":true,"tile_n":128}]}' \
      --out "$dir/ws-tune-$gpu-d64overlap-nc.json" || rc=1
    timeout 200 $py scripts/tune.py --kernels k6 --headdim 128 --causal 1 --seqlen 4096 8192 16384 \
      --configs '{"k6":[{}, {"tile_n":144}, {}, {"tile_n":144}]}' --out "$dir/ws-tune-$gpu-d128c144.json" || rc=1
    timeout 580 $py bench.py k6 --sweep --rounds 3 --out "$dir/ws-sweep-rounds-$gpu.json" || rc=1
    # three softmax knobs, measured and left off (docs/k6.md): part of 2^x on the FMA pipe, the O
    # rescale skipped when no row max moved, the O rescale under the next QK
    timeout 240 $py scripts/tune.py --kernels k6 --headdim 64 --causal 0 1 --seqlen 2048 8192 16384 \
      --configs '{"k6":[{}, {"emulated_exp2":1}, {"emulated_exp2":2}, {"emulated_exp2":3}, {}, {"emulated_exp2":2}]}' \
      --out "$dir/ws-tune-$gpu-exp2-d64.json" || rc=1
    timeout 150 $py scripts/tune.py --kernels k6 --headdim 128 --causal 0 1 --seqlen 4096 16384 \
      --configs '{"k6":[{}, {"emulated_exp2":1}, {"emulated_exp2":2}, {}]}' --out "$dir/ws-tune-$gpu-exp2-d128.json" || rc=1
    timeout 420 $py scripts/tune.py --kernels k6 --headdim 64 128 256 --causal 0 1 --seqlen 1024 4096 16384 \
      --configs '{"k6":[{}, {"skip_unit_rescale":true}, {}, {"skip_unit_rescale":true}]}' \
      --out "$dir/ws-tune-$gpu-skiprescale.json" || rc=1
    timeout 300 $py scripts/tune.py --kernels k6 --headdim 128 256 --causal 0 1 --seqlen 4096 8192 16384 \
      --configs '{"k6":[{}, {"rescale_o_before_gemm":true}, {"rescale_o_before_gemm":false}, {}, {"rescale_o_before_gemm":true}, {"rescale_o_before_gemm":false}]}' \
      --out "$dir/ws-tune-$gpu-rescale.json" || rc=1
    timeout 580 $py bench.py k6 --sweep --rounds 3 --out "$dir/ws-sweep-rounds2-$gpu.json" || rc=1  # a second run, another day
    # the last percent (docs/k6.md): keep-mask masking and a mainloop per Q stage (rounds3), then
    # causal L2 sections sized to all of L2 from 4k keys (rounds4); each tuning configuration timed 5 times
    timeout 580 $py bench.py k6 --sweep --rounds 3 --out "$dir/ws-sweep-rounds3-$gpu.json" || rc=1
    timeout 150 $py scripts/tune.py --kernels k6 --headdim 64 --causal 0 1 --seqlen 4096 8192 16384 --rounds 5 \
      --configs '[{}, {"overlap":true,"tile_n":128}]' --out "$dir/ws-tune-$gpu-d64overlap-r5.json" || rc=1
    timeout 120 $py scripts/tune.py --kernels k6 --headdim 128 --causal 0 --seqlen 4096 8192 16384 --rounds 5 \
      --configs '[{}, {"tile_n":128}]' --out "$dir/ws-tune-$gpu-d128n-r5.json" || rc=1
    timeout 200 $py scripts/tune.py --kernels k6 --headdim 128 256 --causal 1 --seqlen 2048 4096 8192 --rounds 5 \
      --configs '[{}, {"scheduler":"single"}, {"section_bytes":52428800}]' --out "$dir/ws-tune-$gpu-causal-sched-r5.json" || rc=1
    timeout 560 $py scripts/tune.py --kernels k6 --headdim 64 128 256 --causal 1 --seqlen 1024 2048 4096 16384 --rounds 5 \
      --configs '[{}, {"section_bytes":6553600}, {"section_bytes":52428800}]' --out "$dir/ws-tune-$gpu-sections-r5.json" || rc=1
    timeout 120 $py scripts/tune.py --kernels k6 --headdim 64 --causal 0 1 --seqlen 8192 16384 --rounds 5 \
      --configs '[{}, {"kv_stages":3}, {"kv_stages":4}]' --out "$dir/ws-tune-$gpu-d64stages-r5.json" || rc=1
    timeout 330 $py bench.py k6 --sweep --rounds 3 --out "$dir/ws-sweep-rounds4-$gpu.json" || rc=1
    timeout 330 $py bench.py k6 --sweep --rounds 3 --out "$dir/ws-sweep-rounds5-$gpu.json" || rc=1  # a second run
    timeout 150 $py ref_check.py k6 k7 k8 --quick --out "$dir/refcheck-final-quick-$gpu.json" || rc=1
    timeout 100 $py ref_check.py --decode --quick --out "$dir/refcheck-decode-quick-$gpu.json" || rc=1
    for d in 64 128; do  # k6 beside flash-attn-4 under ncu, 16k keys non-causal
      timeout 250 bash scripts/ncu_compare.sh 16384 $d 0 > "$dir/ncu-compare-d$d-n16k-$gpu.txt" || rc=1
    done
    # Where the warps wait, per SASS instruction (ncu PC sampling); then the PV wait pinned (off),
    # and each warpgroup storing its own O rows (docs/k6.md), 3 rounds each
    timeout 200 $py scripts/ncu_stalls.py --seqlen 16384 --headdim 128 --causal 0 --out "$dir/ncu-stalls-d128-n16k-$gpu.json" || rc=1
    timeout 280 $py scripts/tune.py --kernels k6 --headdim 128 --causal 0 1 --seqlen 4096 8192 16384 --rounds 3 \
      --configs '[{}, {"pin_pv_wait":"after_softmax"}]' --out "$dir/ws-tune-$gpu-pin-d128-r3.json" || rc=1
    timeout 250 $py scripts/tune.py --kernels k6 --headdim 64 256 --causal 0 1 --seqlen 8192 16384 --rounds 3 \
      --configs '[{}, {"pin_pv_wait":"after_softmax"}, {"overlap":true,"tile_n":128,"pin_pv_wait":"after_softmax"}]' \
      --out "$dir/ws-tune-$gpu-pin-d64d256-r3.json" || rc=1
    timeout 300 $py scripts/tune.py --kernels k6 --headdim 128 256 --causal 0 1 --seqlen 4096 16384 --rounds 3 \
      --configs '[{}, {"pin_pv_wait":"before_exp2"}]' --out "$dir/ws-tune-$gpu-pinexp-r3.json" || rc=1
    timeout 200 $py ref_check.py k6 --quick --all-head-dims --config '{"o_store_per_wg":true}' \
      --out "$dir/refcheck-k6-perwg-quick-$gpu.json" || rc=1
    timeout 330 $py scripts/tune.py --kernels k6 --headdim 128 256 --causal 0 1 --seqlen 512 1024 2048 4096 --rounds 3 \
      --configs '[{"o_store_per_wg":false}, {"o_store_per_wg":true}]' --out "$dir/ws-tune-$gpu-perwg-r3.json" || rc=1
    timeout 200 $py scripts/tune.py --kernels k6 --headdim 64 --causal 0 1 --seqlen 512 2048 8192 16384 --rounds 3 \
      --configs '[{"tma_store":false}, {"tma_store":true,"o_store_per_wg":true}]' --out "$dir/ws-tune-$gpu-perwg-d64-r3.json" || rc=1
    timeout 200 $py scripts/tune.py --kernels k6 --headdim 128 --causal 0 1 --seqlen 8192 16384 --rounds 3 \
      --configs '[{"o_store_per_wg":false}, {"o_store_per_wg":true}]' --out "$dir/ws-tune-$gpu-perwg-d128long-r3.json" || rc=1
    timeout 120 $py scripts/tune.py --kernels k6 --headdim 256 --causal 0 1 --seqlen 16384 --rounds 3 \
      --configs '[{}, {"tma_store":true,"o_store_per_wg":true}]' --out "$dir/ws-tune-$gpu-perwg-d256long-r3.json" || rc=1
    timeout 330 $py scripts/tune.py --kernels k6 --headdim 128 --causal 0 --seqlen 8192 16384 --rounds 3 \
      --configs '[{}, {"o_store_per_wg":true}, {"scheduler":"dynamic"}, {"scheduler":"dynamic","o_store_per_wg":true}, {"scheduler":"single","o_store_per_wg":true}]' \
      --out "$dir/ws-tune-$gpu-perwg-sched-r3.json" || rc=1
    timeout 300 $py scripts/tune.py --kernels k6 --headdim 128 --causal 0 --seqlen 8192 16384 --rounds 3 \
      --configs '[{}, {"tile_n":128,"kv_stages":3,"q_stages":1}, {"tile_n":128,"kv_stages":3,"q_stages":1,"tma_store":false}, {"tile_n":112,"kv_stages":3,"q_stages":1}]' \
      --out "$dir/ws-tune-$gpu-d128n-stages3-r3.json" || rc=1
    # The split tail (docs/k6.md "A split tail"): correctness on forced small grids, then timed.
    timeout 300 $py -m pytest -m gpu -q tests/test_gpu.py -k split_tail || rc=1
    timeout 230 $py scripts/tune.py --kernels k6 --headdim 128 --causal 0 --seqlen 4096 8192 16384 --rounds 3 \
      --configs '[{}, {"split_tail": true}]' --out "$dir/ws-tune-$gpu-splittail-d128-r3.json" || rc=1
    timeout 150 $py scripts/tune.py --kernels k6 --headdim 64 256 --causal 0 --seqlen 8192 --rounds 3 \
      --configs '[{}, {"split_tail": true}]' --out "$dir/ws-tune-$gpu-splittail-d64d256-r3.json" || rc=1
    timeout 150 $py scripts/tune.py --kernels k6 --headdim 128 --causal 0 --seqlen 8192 --nheads 33 --rounds 3 \
      --configs '[{}, {"split_tail": true}]' --out "$dir/ws-tune-$gpu-splittail-notail-r3.json" || rc=1
    timeout 200 $py ref_check.py k6 --quick --all-head-dims --out "$dir/refcheck-k6-quick-$gpu.json" || rc=1
    for args in "--causal 0" "--causal 1" "--headdim 256 --causal 0" "--headdim 64 --causal 0" "--headdim 64 --causal 1 --seqlen 200"; do
      timeout 120 compute-sanitizer --tool racecheck --kernel-name kns=FMHA $py scripts/sanitize_case.py k6 $args \
        2>&1 | grep "SUMMARY\|: ok\|FAIL" || { echo "racecheck k6 $args: timed out or failed"; rc=1; }
    done > "$dir/sanitizer-k6-perwg-$gpu.txt"
    for args in "--causal 1" "--headdim 64 --causal 0"; do
      timeout 120 compute-sanitizer --tool synccheck --kernel-name kns=FMHA $py scripts/sanitize_case.py k6 $args \
        2>&1 | grep "SUMMARY\|: ok\|FAIL" || { echo "synccheck k6 $args: timed out or failed"; rc=1; }
    done >> "$dir/sanitizer-k6-perwg-$gpu.txt"
    timeout 400 $py bench.py k6 --sweep --rounds 3 --out "$dir/ws-sweep-rounds6-$gpu.json" || rc=1
    timeout 400 $py bench.py k6 --sweep --rounds 3 --out "$dir/ws-sweep-rounds7-$gpu.json" || rc=1  # a second run
    # The power limit (rows now carry each round's SM clock and power), wider key tiles, the
    # split tail under the sanitizers, the full ws ref_check, then K/V descriptors made once
    # (pin_descriptors) against the old indexing and the sweep of that code.
    timeout 300 $py scripts/tune.py --kernels k6 --headdim 128 --causal 0 --seqlen 8192 16384 --rounds 3 \
      --configs '[{}, {"tile_n": 176, "q_stages": 1}, {"tile_n": 128}, {"tile_n": 160, "q_stages": 1}]' \
      --out "$dir/ws-tune-$gpu-d128n176-r3.json" || rc=1
    timeout 240 $py scripts/tune.py --kernels k6 --headdim 128 --causal 0 --seqlen 8192 16384 --rounds 3 \
      --configs '[{}, {"tile_n": 128}]' --out "$dir/ws-tune-$gpu-clock-d128-r3.json" || rc=1
    timeout 480 $py bench.py k6 --sweep --rounds 3 --out "$dir/ws-sweep-rounds8-$gpu.json" || rc=1
    timeout 420 $py ref_check.py k5 k6_pp k6 --all-head-dims --out "$dir/refcheck-ws-final-$gpu.json" || rc=1
    for tool in racecheck synccheck; do
      for d in 64 128 256; do  # 300 keys on 132 CTAs: fewer tail KV steps than CTAs
        timeout 150 compute-sanitizer --tool $tool --kernel-name kns=FMHA $py scripts/sanitize_case.py k6 --headdim $d \
          --causal 0 --config '{"split_tail": true}' 2>&1 | grep "SUMMARY\|: ok\|FAIL" || { echo "$tool split_tail d=$d: failed"; rc=1; }
      done
    done > "$dir/sanitizer-splittail-$gpu.txt"
    timeout 400 $py ref_check.py k5 k6_pp k6 k7 k8 --quick --all-head-dims --out "$dir/refcheck-pinned-quick-$gpu.json" || rc=1
    timeout 300 $py scripts/tune.py --kernels k6 --headdim 128 256 --causal 0 1 --seqlen 8192 16384 --rounds 3 \
      --configs '[{}, {"pin_descriptors": false}]' --out "$dir/ws-tune-$gpu-pinned-r3.json" || rc=1
    timeout 400 $py bench.py k6 --sweep --rounds 3 --out "$dir/ws-sweep-rounds9-$gpu.json" || rc=1
    # 2-CTA clusters sharing each K/V tile (K5's cluster=2; K6's default at d=128/256 non-causal):
    # correctness and the sanitizers, each length against cluster=1 in one run, then the sweep.
    timeout 280 $py ref_check.py k6 --all-head-dims --out "$dir/refcheck-k6-cluster-$gpu.json" || rc=1
    for tool in racecheck synccheck; do
      for d in 128 256; do
        timeout 150 compute-sanitizer --tool $tool --kernel-name kns=FMHA $py scripts/sanitize_case.py k6 --headdim $d \
          --causal 0 --config '{"cluster": 2}' 2>&1 | grep "SUMMARY\|: ok\|FAIL" || { echo "$tool cluster d=$d: failed"; rc=1; }
      done
    done > "$dir/sanitizer-cluster-$gpu.txt"
    timeout 330 $py scripts/tune.py --kernels k6 --headdim 128 256 --causal 0 --seqlen 4096 8192 16384 --rounds 3 \
      --configs '[{}, {"cluster": 2}]' --out "$dir/ws-tune-$gpu-cluster-r3.json" || rc=1
    timeout 200 $py scripts/tune.py --kernels k6 --headdim 128 256 --causal 0 --seqlen 512 1024 2048 --rounds 3 \
      --configs '[{}, {"cluster": 2}]' --out "$dir/ws-tune-$gpu-cluster-short-r3.json" || rc=1
    # with the clusters on: tile width and epilogue again at the target cell, then 4-CTA clusters
    timeout 250 $py scripts/tune.py --kernels k6 --headdim 128 --causal 0 --seqlen 8192 16384 --rounds 3 \
      --configs '[{}, {"tile_n": 128}, {"tile_n": 160}, {"o_store_per_wg": true}, {"tma_store": false}]' \
      --out "$dir/ws-tune-$gpu-cluster-variants-r3.json" || rc=1
    timeout 330 $py scripts/tune.py --kernels k6 --headdim 128 --causal 0 --seqlen 4096 8192 16384 --rounds 3 \
      --configs '[{}, {"cluster": 4}, {"cluster": 4, "tile_n": 128}, {"cluster": 4, "tile_n": 160}]' \
      --out "$dir/ws-tune-$gpu-cluster4-r3.json" || rc=1
    timeout 200 $py scripts/tune.py --kernels k6 --headdim 256 --causal 0 --seqlen 2048 8192 --rounds 3 \
      --configs '[{}, {"cluster": 4}]' --out "$dir/ws-tune-$gpu-cluster4-d256-r3.json" || rc=1
    # whole waves on 128 SMs (64 two-CTA clusters) instead of 15.5 on 132
    T="$py scripts/tune.py --kernels k6 --causal 0 --rounds 3"
    timeout 200 $T --headdim 128 --seqlen 4096 8192 16384 --configs '[{}, {"cluster": 2, "ctas": 128}]' \
      --out "$dir/ws-tune-$gpu-grid128-d128-r3.json" || rc=1
    timeout 150 $T --headdim 256 --seqlen 2048 8192 16384 --configs '[{}, {"cluster": 2, "ctas": 128}]' \
      --out "$dir/ws-tune-$gpu-grid128-d256-r3.json" || rc=1
    timeout 100 $T --headdim 128 --seqlen 1024 2048 --configs '[{}, {"ctas": 128}]' \
      --out "$dir/ws-tune-$gpu-grid128-d128short-r3.json" || rc=1
    # d=64 non-causal: clusters (no gain), then wider key tiles at long sequences, now the default
    # from 16k keys (k6.LONG_SEQUENCE_TILE_N; its first configuration was the default of 128 keys)
    timeout 330 $T --headdim 64 --seqlen 2048 4096 8192 16384 \
      --configs '[{}, {"cluster": 2}, {"cluster": 2, "tile_n": 160}]' --out "$dir/ws-tune-$gpu-cluster-d64-r3.json" || rc=1
    d64long='[{"tile_n": 128}, {"tile_n": 160}, {"tile_n": 176}, {"cluster": 2, "tile_n": 160}, {"cluster": 2, "tile_n": 176}]'
    timeout 400 $T --headdim 64 --seqlen 8192 16384 32768 --configs "$d64long" --out "$dir/ws-tune-$gpu-d64long-r3.json" || rc=1
    timeout 300 $py scripts/tune.py --kernels k6 --causal 1 --rounds 3 --headdim 64 --seqlen 8192 16384 32768 \
      --configs '[{}, {"tile_n": 160}, {"tile_n": 176}]' --out "$dir/ws-tune-$gpu-d64long-causal-r3.json" || rc=1
    # Q in registers (q_in_regs, left off) and the per-warpgroup O store with the clusters on
    qregs='[{}, {"q_in_regs": true}, {"o_store_per_wg": true}, {"q_in_regs": true, "o_store_per_wg": true}]'
    timeout 200 $T --headdim 128 --seqlen 2048 8192 16384 --configs "$qregs" --out "$dir/ws-tune-$gpu-qregs-d128n-r3.json" || rc=1
    timeout 150 $py scripts/tune.py --kernels k6 --causal 1 --rounds 3 --headdim 128 --seqlen 4096 16384 \
      --configs '[{}, {"q_in_regs": true}]' --out "$dir/ws-tune-$gpu-qregs-d128c-r3.json" || rc=1
    timeout 150 $T --headdim 64 --seqlen 8192 16384 --configs '[{}, {"q_in_regs": true}]' \
      --out "$dir/ws-tune-$gpu-qregs-d64n-r3.json" || rc=1
    # GQA prefill against plain multi-head attention on the same query shapes (docs/k6.md, GQA)
    for g in 1 4; do
      timeout 210 $py scripts/tune.py --kernels k6 --headdim 128 --seqlen 2048 4096 8192 16384 --nheads 32 --kv-group $g \
        --rounds 3 --out "$dir/ws-gqa-g$g-$gpu-r3.json" || rc=1
    done
    timeout 420 $py bench.py k6 --sweep --rounds 3 --out "$dir/ws-sweep-rounds10-$gpu.json" || rc=1
    exit $rc
    ;;
  decode)
    rc=0
    timeout 200 $py ref_check.py --decode --out "$dir/refcheck-decode-$gpu.json" > "$dir/refcheck-decode-$gpu.log" || rc=1
    timeout 150 $py ref_check.py decode_nosplit decode_combine decode --quick \
      --out "$dir/refcheck-decode-contract-$gpu.json" > "$dir/refcheck-decode-contract-$gpu.log" || rc=1
    for k in decode decode_combine; do  # 4 queries x 8 K/V heads x 3000 keys: 16 splits, the merge runs
      for tool in racecheck synccheck; do
        timeout 120 compute-sanitizer --tool $tool --kernel-name kns=FMHA $py scripts/sanitize_case.py $k \
          --seqlen 4 --seqlen-k 3000 --batch-heads 32 --nheads-kv 8 --causal 1 2>&1 | grep "SUMMARY\|: ok\|FAIL" \
          || { echo "$tool $k: timed out or failed"; rc=1; }
      done
    done | tee "$dir/sanitizer-decode-$gpu.txt"
    for page in 64 16; do  # a paged cache of 64-key pages (two boxes per 128-key tile) and 16-key pages (eight)
      for tool in racecheck synccheck; do
        timeout 120 compute-sanitizer --tool $tool --kernel-name kns=FMHA $py scripts/sanitize_case.py decode \
          --seqlen 4 --seqlen-k 3000 --batch-heads 32 --nheads-kv 8 --causal 1 --page-size $page 2>&1 \
          | grep "SUMMARY\|: ok\|FAIL" || { echo "$tool pages $page: timed out or failed"; rc=1; }
      done
    done | tee "$dir/sanitizer-decode-paged-$gpu.txt"
    for page in 16 0; do  # memcheck: 16-key pages whose last sequence fills its table row, and no pages
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool memcheck --report-api-errors no \
        --kernel-name kns=FMHA $py scripts/sanitize_case.py decode --seqlen 4 --seqlen-k 3000 --batch-heads 32 \
        --nheads-kv 8 --causal 1 --page-size $page 2>&1 | grep "SUMMARY\|: ok\|FAIL\|Invalid" \
        || { echo "memcheck pages $page: timed out or failed"; rc=1; }
    done | tee "$dir/memcheck-decode-paged-$gpu.txt"
    timeout 200 $py bench.py --decode --out "$dir/decode-$gpu.json" > "$dir/decode-$gpu.log" || rc=1
    timeout 200 $py bench.py --decode --pages-curve --out "$dir/decode-$gpu-pages.json" > "$dir/decode-$gpu-pages.log" || rc=1
    for d in 64 256; do
      timeout 150 $py bench.py --decode --pages-curve --batch 8 --headdim $d --out "$dir/decode-pages-d$d-$gpu.json" \
        > /dev/null || rc=1
    done
    timeout 200 $py scripts/tune_decode.py --out "$dir/decode-tune-$gpu.json" > "$dir/decode-tune-$gpu.log" || rc=1
    # The tuning before claiming (--fixed-shares: each split walks its fixed share of the tiles):
    # l2_prefetch (tiles pulled into L2 before the PDL wait; the repeated 0 times the baseline twice),
    # the Combine launch with it, and refilling a stage as soon as it is released
    timeout 150 $py scripts/tune_decode.py --fixed-shares --headdim 128 --configs 128:2:0,128:2:2,128:2:4,128:2:8,128:2:0 \
      --out "$dir/decode-tune-prefetch-$gpu-d128.json" > /dev/null || rc=1
    timeout 100 $py scripts/tune_decode.py --fixed-shares --headdim 64 --configs 256:2:0,256:2:2,256:2:4 \
      --out "$dir/decode-tune-prefetch-$gpu-d64.json" > /dev/null || rc=1
    timeout 100 $py scripts/tune_decode.py --fixed-shares --headdim 256 --configs 64:2:0,64:2:2,64:2:4,64:2:8 \
      --out "$dir/decode-tune-prefetch-$gpu-d256.json" > /dev/null || rc=1
    timeout 100 $py scripts/tune_decode.py --fixed-shares --headdim 128 --merge combine --shapes 1:8:32768,1:8:4096 \
      --configs 128:2:0,128:2:4 --out "$dir/decode-tune-prefetch-$gpu-combine.json" > /dev/null || rc=1
    timeout 200 $py scripts/tune_decode.py --fixed-shares --headdim 128 --shapes 1:8:32768,1:8:131072,1:32:32768,8:8:32768,1:8:4096 \
      --configs 128:2:4:0,128:2:4:1,128:2:3:1,128:3:4:1,64:4:4:1,64:4:8:1,128:2:0:1 \
      --out "$dir/decode-tune-refill-$gpu-d128.json" > /dev/null || rc=1
    timeout 150 $py scripts/tune_decode.py --fixed-shares --headdim 128 --shapes 1:8:32768,1:8:131072,1:32:32768 \
      --configs 128:2:4,64:2:4,64:2:8 --splits 16,24,32 --out "$dir/decode-tune-twoctas-$gpu-d128.json" > /dev/null || rc=1
    # the seam at batch 1, 8 K/V heads: who merges (last CTA to count, decode's, vs the group's last
    # split), the merge's loads in one round trip (merge_prefetch), L2 hints further ahead in the
    # loop (prefetch_ahead); each configuration timed twice
    timeout 150 $py scripts/tune_decode.py --fixed-shares --headdim 128 --shapes 1:8:32768,1:8:4096,1:32:32768,8:8:32768 \
      --configs 128:2:4,128:2:4 --merge last_cta,last_split --out "$dir/decode-tune-merge-$gpu-d128.json" > /dev/null || rc=1
    timeout 90 $py scripts/tune_decode.py --fixed-shares --headdim 128 --shapes 1:8:32768,1:8:131072 --merge last_split \
      --configs 128:2:4:0:0:0,128:2:4:0:0:2,128:2:4:0:0:4,128:2:4:0:0:0 --out "$dir/decode-tune-ahead-$gpu-d128.json" > /dev/null || rc=1
    timeout 90 $py scripts/tune_decode.py --fixed-shares --headdim 128 --shapes 1:8:32768,1:8:4096 --merge last_cta \
      --configs 128:2:4:0:0,128:2:4:0:16,128:2:4:0:0,128:2:4:0:16 --out "$dir/decode-tune-mergeprefetch-$gpu-d128.json" > /dev/null || rc=1
    timeout 130 $py scripts/tune_decode.py --fixed-shares --headdim 128 --shapes 1:8:32768,1:8:131072,1:32:32768,8:8:32768 \
      --configs 128:2:4:0:0:0:0,128:2:4:0:0:0:2,128:2:4:0:0:0:4,128:2:4:0:0:0:0,128:2:4:0:0:0:4 \
      --out "$dir/decode-tune-afterwait-$gpu-d128.json" > /dev/null || rc=1
    # claiming (claim_after: the splits claim all but their first tiles from a per-head counter)
    # against the fixed shares, with 2-4 tiles hinted into L2, both in-kernel merges
    for d in 128 64 256; do
      case $d in 128) t=128:2; l=4; s=1:8:32768,1:8:4096,1:8:131072,1:32:32768,8:8:32768;;
                 64) t=256:2; l=4; s=1:8:32768,1:8:4096,8:8:32768;; 256) t=64:2; l=2; s=1:8:32768,1:8:4096,8:8:32768;; esac
      timeout 180 $py scripts/tune_decode.py --headdim $d --shapes $s --merge last_cta,last_split \
        --configs $t:$l:0:0:0:0:0,$t:2:0:0:0:0:4,$t:3:0:0:0:0:4,$t:4:0:0:0:0:4 \
        --out "$dir/decode-tune-claim5-$gpu-d$d.json" > /dev/null || rc=1
    done
    # claiming with 64-key tiles (two CTAs per SM), and the final code against fixed shares; the
    # first claiming run (decode-tune-claim-*) predates the even-share cap of the own tiles
    c=64:2:4:0:0:0:0:4,64:2:8:0:0:0:0:8,64:3:8:0:0:0:0:8
    timeout 240 $py scripts/tune_decode.py --headdim 128 --shapes 1:8:32768,1:8:4096,1:8:131072,8:8:32768 \
      --configs 128:2:4:0:0:0:0:0,128:2:4:0:0:0:0:4,$c,128:2:4:0:0:0:0:0,128:2:4:0:0:0:0:4 \
      --out "$dir/decode-tune-claim2-$gpu-d128.json" > /dev/null || rc=1
    timeout 150 $py scripts/tune_decode.py --headdim 128 --shapes 1:8:32768,1:8:131072 --splits 32 --configs $c,$c \
      --out "$dir/decode-tune-claim2-$gpu-d128-s32.json" > /dev/null || rc=1
    c=128:2:3:0:0:0:0:0,128:2:3:0:0:0:0:4
    timeout 100 $py scripts/tune_decode.py --headdim 128 --shapes 1:8:32768,1:8:131072 --configs $c,$c \
      --out "$dir/decode-tune-claim6-$gpu-d128.json" > /dev/null || rc=1
    # Two CTAs per SM on an unsplit grid wider than the GPU (decode.SHARED_SM_TILE_N): half-width
    # tiles against the default ones, each twice, at d = 128, 64, 256; then the sanitizers on them
    # (140 K/V heads, no split).
    timeout 120 $py scripts/tune_decode.py --fixed-shares --headdim 128 --shapes 64:32:4096,8:32:131072,64:8:4096,1:8:32768 \
      --configs 128:2:3,64:2:3,128:3:3,64:4:3,128:2:3 --out "$dir/decode-tune-stages-$gpu-d128.json" > /dev/null || rc=1
    timeout 100 $py scripts/tune_decode.py --fixed-shares --headdim 128 --shapes 8:32:4096,8:32:32768,64:8:4096 \
      --configs 128:2:3,64:2:3,128:2:3,64:2:3 --out "$dir/decode-tune-sharedsm-$gpu-d128.json" > /dev/null || rc=1
    timeout 100 $py scripts/tune_decode.py --fixed-shares --headdim 64 --shapes 64:32:4096,8:32:32768 \
      --configs 256:2:3,128:2:3,256:2:3,128:2:3 --out "$dir/decode-tune-sharedsm-$gpu-d64.json" > /dev/null || rc=1
    timeout 100 $py scripts/tune_decode.py --fixed-shares --headdim 256 --shapes 64:32:4096,8:32:32768 \
      --configs 64:2:2,32:2:2,64:2:2,32:2:2 --out "$dir/decode-tune-sharedsm-$gpu-d256.json" > /dev/null || rc=1
    for tool in racecheck synccheck; do
      for dt in 128:64 256:32; do
        timeout 100 compute-sanitizer --tool $tool --kernel-name kns=FMHA $py scripts/sanitize_case.py decode \
          --headdim ${dt%:*} --seqlen 1 --seqlen-k 1000 --batch-heads 140 --nheads-kv 140 --config "{\"tile_n\": ${dt#*:}}" \
          2>&1 | grep "SUMMARY\|: ok\|FAIL" | sed "s/^/$tool d=${dt%:*} /" || { echo "$tool shared-SM d=${dt%:*}: failed"; rc=1; }
      done
    done | tee "$dir/sanitizer-decode-sharedsm-$gpu.txt"
    # (the loop runs in a subshell: judge it by what it wrote)
    ! grep -q "failed\|FAIL\|[1-9][0-9]* hazards\|[1-9][0-9]* errors" "$dir/sanitizer-decode-sharedsm-$gpu.txt" || rc=1
    for tool in racecheck synccheck; do  # claiming on (the default), 3000 keys: one own tile, then claims
      timeout 100 compute-sanitizer --tool $tool --kernel-name kns=FMHA $py scripts/sanitize_case.py decode \
        --seqlen 4 --seqlen-k 3000 --batch-heads 32 --nheads-kv 8 --causal 1 2>&1 | grep "SUMMARY\|: ok\|FAIL" \
        | sed "s/^/$tool /" || { echo "$tool decode: timed out or failed"; rc=1; }
    done | tee "$dir/sanitizer-decode-claim-$gpu.txt"
    timeout 150 $py -m pytest -m gpu -q tests/test_decode.py 2>&1 | tail -3 || rc=1
    # Half-width tiles on a split grid, twice the splits (docs/decode.md, "On an H200"), then the
    # one call's host time with its _PreparedCall, three runs (host speed differs between machines)
    timeout 150 $py scripts/tune_decode.py --fixed-shares --headdim 128 --shapes 1:8:32768,1:8:131072,1:8:4096 \
      --configs 128:2,64:2,64:4 --splits 16,32 --out "$dir/decode-tune-splitsm-$gpu-d128.json" > /dev/null || rc=1
    timeout 150 $py scripts/tune_decode.py --fixed-shares --headdim 128 \
      --shapes 1:8:32768,1:8:4096,1:32:32768,8:8:131072,1:8:131072 --configs 128:2:3,128:3:3,128:3:4,128:3:5,128:2:4,128:2:3 \
      --out "$dir/decode-tune-ring-$gpu-d128.json" > /dev/null || rc=1
    for run in host host2 host3; do
      timeout 150 $py bench.py --decode --host-times --out "$dir/decode-$gpu-$run.json" > /dev/null || rc=1
    done
    exit $rc
    ;;
  fp8check)
    rc=0
    timeout 420 $py ref_check.py k7_k4 k7 k8 --all-head-dims --out "$dir/refcheck-fp8-$gpu.json" \
      > "$dir/refcheck-fp8-$gpu.log" || { echo "ref_check failed or timed out (exit $?)"; rc=1; }
    tail -3 "$dir/refcheck-fp8-$gpu.log"
    # K8 alone again (the run above has it too): since it takes GQA and keys outnumbering queries,
    # the last 42 cases of its grid are those; this file is K8's own record of them
    timeout 300 $py ref_check.py k8 --all-head-dims --out "$dir/refcheck-k8-gqa-$gpu.json" \
      > "$dir/refcheck-k8-gqa-$gpu.log" || { echo "ref_check k8 failed or timed out (exit $?)"; rc=1; }
    for k in k7 k8; do
      for tool in racecheck synccheck; do
        timeout 120 compute-sanitizer --tool $tool --kernel-name kns=FMHA $py scripts/sanitize_case.py $k --causal 1 \
          2>&1 | grep "SUMMARY\|: ok\|FAIL" || { echo "$tool $k: timed out or failed"; rc=1; }
      done
    done | tee "$dir/sanitizer-fp8-$gpu.txt"
    for tool in racecheck synccheck; do  # K8 with GQA (4 query heads per K/V head) and more keys than queries
      timeout 150 compute-sanitizer --tool $tool --kernel-name kns=FMHA $py scripts/sanitize_case.py k8 --causal 1 \
        --seqlen 300 --seqlen-k 700 --batch-heads 140 --nheads-kv 35 2>&1 | grep "SUMMARY\|: ok\|FAIL" \
        || { echo "$tool k8 GQA: timed out or failed"; rc=1; }
    done | tee "$dir/sanitizer-k8-gqa-$gpu.txt"
    timeout 300 $py -m pytest -m gpu -q tests/test_fp8_api.py tests/test_k7.py tests/test_k8.py tests/test_fp8_quant.py \
      2>&1 | tail -5 || rc=1
    exit $rc
    ;;
  fp8)
    rc=0
    timeout 300 $py bench.py k7_k4 k7 k8 --dtype fp8 --sweep --out "$dir/fp8-sweep-$gpu.json" \
      > "$dir/fp8-sweep-$gpu.log" || rc=1
    timeout 240 $py scripts/time_k7.py --out "$dir/k7-time-$gpu.json" > "$dir/k7-time-$gpu.log" || rc=1
    timeout 240 $py scripts/fp8_accuracy.py --out "$dir/fp8-accuracy-$gpu.json" > "$dir/fp8-accuracy-$gpu.log" || rc=1
    timeout 330 $py scripts/tune_fp8.py --kernels k7 --headdim 128 --seqlen 2048 8192 \
      --configs '[{}, {"tile_n": 160}, {"tile_n": 192}, {"tile_n": 224}, {"kv_stages": 3}, {"overlap": false}]' \
      --out "$dir/fp8-tune-$gpu-d128.json" > "$dir/fp8-tune-$gpu-d128.log" || rc=1
    timeout 60 $py scripts/tune_fp8.py --kernels k7 --headdim 256 --causal 1 --seqlen 2048 4096 \
      --configs '[{}, {"tile_n": 64}]' --out "$dir/fp8-tune-$gpu-d256.json" > "$dir/fp8-tune-$gpu-d256.log" || rc=1
    # K6's L2 sections for long causal sequences (the default) against the eighth K7 had before
    timeout 280 $py scripts/tune_fp8.py --kernels k7 --headdim 128 256 --causal 1 --seqlen 4096 8192 16384 \
      --configs '{"k7": [{}, {"section_bytes": 6553600}]}' --out "$dir/fp8-tune-$gpu-sections.json" > /dev/null || rc=1
    exit $rc
    ;;
  final)  # the acceptance runs of the K5/K6 and decode issues, all at one commit (H100: a5c9ed4)
    rc=0
    timeout 420 $py bench.py k6 --sweep --rounds 3 --out "$dir/ws-sweep-rounds11-$gpu.json" > /dev/null || rc=1
    timeout 170 $py bench.py --decode --grid-only --out "$dir/decode-$gpu-grid.json" > /dev/null || rc=1
    timeout 570 $py ref_check.py all --out "$dir/refcheck-all-$gpu.json" > "$dir/refcheck-all-$gpu.log" || rc=1
    for k in k5 k6; do  # k6's default at d=128 non-causal is the 2-CTA cluster
      for args in "--causal 0" "--causal 1" "--headdim 256 --causal 0"; do
        timeout 90 compute-sanitizer --tool racecheck --kernel-name kns=FMHA $py scripts/sanitize_case.py $k $args \
          2>&1 | grep "SUMMARY\|: ok\|FAIL" || echo "racecheck $k $args: timed out or failed"
      done
      for args in "--causal 0" "--causal 1"; do
        timeout 90 compute-sanitizer --tool synccheck --kernel-name kns=FMHA $py scripts/sanitize_case.py $k $args \
          2>&1 | grep "SUMMARY\|: ok\|FAIL" || echo "synccheck $k $args: timed out or failed"
      done
    done > "$dir/sanitizer-ws-final-$gpu.txt"
    ! grep -q "failed\|FAIL\|[1-9][0-9]* hazards\|[1-9][0-9]* errors" "$dir/sanitizer-ws-final-$gpu.txt" || rc=1
    timeout 330 $py ref_check.py --decode --out "$dir/refcheck-decode-$gpu.json" > "$dir/refcheck-decode-$gpu.log" || rc=1
    for g in 4 1; do
      timeout 330 $py scripts/tune.py --kernels k6 --headdim 128 --seqlen 2048 4096 8192 16384 --nheads 32 --kv-group $g \
        --rounds 3 --out "$dir/ws-gqa-g$g-$gpu-r3.json" > /dev/null || rc=1
    done
    for causal in 0 1; do
      CHECK=1 SEQLEN=8192 HEADDIM=128 CAUSAL=$causal timeout 100 $py bench.py k6 --out "$dir/bench-k6-c$causal-$gpu.json" || rc=1
    done
    for run in host5 host6 host7; do  # three runs: this host's timing drifts from run to run
      timeout 190 $py bench.py --decode --host-times --out "$dir/decode-$gpu-$run.json" > /dev/null || rc=1
    done
    # the two H200-only decode defaults, asked again on this GPU: half-width tiles on a wide unsplit
    # grid (decode.SHARED_SM_GPUS), fixed shares against claiming (decode.NO_CLAIM_GPUS)
    timeout 150 $py scripts/tune_decode.py --fixed-shares --headdim 128 --shapes 8:32:4096,8:32:32768,64:8:4096 \
      --configs 128:2:3,64:2:3,128:2:3,64:2:3 --out "$dir/decode-tune-sharedsm-$gpu-d128.json" > /dev/null || rc=1
    c=128:2:3:0:0:0:0:0,128:2:3:0:0:0:0:4
    timeout 150 $py scripts/tune_decode.py --headdim 128 --shapes 1:8:32768,1:8:131072 --configs $c,$c \
      --out "$dir/decode-tune-claim7-$gpu-d128.json" > /dev/null || rc=1
    timeout 570 $py -m pytest -m gpu -q tests/test_gpu.py 2>&1 | tail -3 || rc=1
    timeout 560 $py -m pytest -m gpu -q tests/ --ignore=tests/test_gpu.py 2>&1 | tail -3 || rc=1
    exit $rc
    ;;
  call)  # the public call as fast as its kernels (docs/k6.md, "Host time"): host time per call before the
    # eager fast path (e27c37a, with today's host_times.py and timing.py) and now, on one machine; then every
    # speed table with the public call beside the kernel alone
    rc=0
    before=$(mktemp -d)/fa3-before
    git worktree add -f --detach "$before" e27c37a > /dev/null
    cp harness/host_times.py harness/timing.py "$before/harness/"
    (cd "$before" && PYTHONPATH="$before:${PYTHONPATH:-}" timeout 200 $py -c "from harness import host_times, results
out = results.open_result_file('$PWD/$dir/host-times-before-$gpu.json', 'bash scripts/reproduce.sh call (at e27c37a)')
host_times.run(out.append)
out.close()") || rc=1
    git worktree remove --force "$before"
    # the worktree's harness writes an older result layout: rewrite it in today's (same rows)
    $py -c "from harness import results; p = '$dir/host-times-before-$gpu.json'; d = results.load(p)
open(p, 'w').write(results.columnar_text(d['meta'], d['rows']))" || rc=1
    timeout 150 $py bench.py --host-times --out "$dir/host-times-$gpu.json" || rc=1
    timeout 540 $py bench.py k6 --sweep --out "$dir/ws-sweep-call-$gpu.json" > /dev/null || rc=1
    timeout 360 $py bench.py k7_k4 k7 k8 --dtype fp8 --sweep --out "$dir/fp8-sweep-call-$gpu.json" > /dev/null || rc=1
    for n in 16384 8192; do  # the cells a power-capped run moves most, in rounds
      timeout 280 $py bench.py k7 --dtype fp8 --sweep --seqlen $n --rounds 3 --out "$dir/fp8-rounds-call-n$n-$gpu.json" \
        > /dev/null || rc=1
    done
    for causal in 0 1; do
      CHECK=1 SEQLEN=8192 HEADDIM=128 CAUSAL=$causal timeout 100 $py bench.py k6 --out "$dir/bench-k6-c$causal-$gpu.json" || rc=1
    done
    exit $rc
    ;;
  features)  # packed sequences, sliding window and softcap, forward, backward and decode: their grids, then
    # racecheck/synccheck on small launches of each path (scripts/sanitize_case.py checks what it launched)
    rc=0
    timeout 300 $py ref_check.py --varlen --out "$dir/refcheck-varlen-$gpu.json" > /dev/null || rc=1
    timeout 300 $py ref_check.py k6 --features --out "$dir/refcheck-k6-features-$gpu.json" > /dev/null || rc=1
    # the backward's softcap and window cases are in `backward`'s per-head-dim grids of k10_fa3
    timeout 400 $py ref_check.py --varlen --backward --out "$dir/refcheck-varlen-backward-$gpu.json" > /dev/null || rc=1
    timeout 300 $py ref_check.py --decode --features --out "$dir/refcheck-decode-window-$gpu.json" > /dev/null || rc=1
    for case in "FMHA k6 --varlen --causal 1 --batch-heads 4" "FMHA k6 --causal 1 --window 100,0 --softcap 5" \
                "K10Backward k6 --backward k10_fa3 --causal 1 --window 100,0 --softcap 5 --batch-heads 4" \
                "K10Backward k6 --varlen --backward k10_fa3 --causal 1 --batch-heads 4 --nheads-kv 2" \
                "K10Backward k6 --varlen --backward k10_fa3 --causal 1 --batch-heads 4 --nheads-kv 2 --deterministic" \
                "K10Backward k6 --varlen --backward k10_fa3 --causal 1 --batch-heads 4 --nheads-kv 2 --headdim 256" \
                "K10Backward k6 --varlen --backward k10_fa3 --causal 1 --batch-heads 4 --nheads-kv 2 --softcap 5" \
                "FMHA decode --seqlen 4 --seqlen-k 3000 --batch-heads 32 --nheads-kv 8 --causal 1 --window 700,0"; do
      read -r kernel args <<< "$case"
      for tool in racecheck synccheck; do
        # shellcheck disable=SC2086
        timeout 200 compute-sanitizer --tool $tool --kernel-name kns=$kernel $py scripts/sanitize_case.py $args 2>&1 \
          | grep "SUMMARY\|: ok\|FAIL" | sed "s/^/$tool: /" || { echo "$tool $args: timed out or failed"; rc=1; }
      done
    done | tee "$dir/sanitizer-features-$gpu.txt"
    exit $rc
    ;;
  backward)  # K9 and K10 (docs/k9.md, docs/k10.md): the backward's grid, its GPU tests, the training
    # check, racecheck/synccheck, the sweep beside cuDNN and flash-attn-4 (about 20 minutes: on the
    # device tool, run its lines in parts)
    rc=0
    # the default backward one head dim a file (57-58 cases, 3.5-4.5 minutes each on an H100), then K9 and K10
    for d in 64 128 256; do
      timeout 600 $py ref_check.py --backward k10_fa3 --headdim $d --out "$dir/refcheck-backward-d$d-$gpu.json" \
        > "$dir/refcheck-backward-d$d-$gpu.log" || { echo "ref_check --backward k10_fa3 --headdim $d failed"; rc=1; }
    done
    timeout 1800 $py ref_check.py --backward k9 k10 --out "$dir/refcheck-backward-$gpu.json" \
      > "$dir/refcheck-backward-$gpu.log" || { echo "ref_check --backward k9 k10 failed or timed out (exit $?)"; rc=1; }
    timeout 400 $py -m pytest -m gpu -q tests/test_k9.py tests/test_k10.py tests/test_backward.py tests/test_training.py \
      2>&1 | tail -3 || rc=1
    timeout 200 $py -m harness.training --out "$dir/training-$gpu.json" || rc=1
    for case in "k9 K9 False 128 300 True" "k10 K10 False 128 300 True" "k10_fa3 K10 False 256 300 True" \
                "k10_fa3 K10 False 64 300 True" "k10_fa3 K10 True 64 300 True" "k10_fa3 K10 False 64 300 False" \
                "k10_fa3 K10 False 128 300 True" \
                "k10_fa3 K10 True 128 300 True" "k10_fa3 K10 False 128 300 True softcap=5.0" \
                "k10_fa3 K10 False 64 700 False window_size=(150,90)" \
                "k10_fa3 K10 False 128 700 False window_size=(150,90),softcap=5.0"; do
      # det: under torch.use_deterministic_algorithms; the rest: head dim, length, causal, a feature
      read -r stage kernel det d n causal extra <<< "$case"
      for tool in racecheck synccheck; do  # small shapes, the main kernel only
        timeout 200 compute-sanitizer --tool $tool --kernel-name kns=${kernel}Backward $py -c "import torch
from harness import attention
torch.use_deterministic_algorithms($det)
q, k, v = (torch.randn(1, 2, $n, $d, device='cuda', dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
attention('k6', q, k, v, causal=$causal, backward='$stage', ${extra:-softcap=None}).sum().backward()
torch.cuda.synchronize(); print('$stage d=$d n=$n causal=$causal deterministic=$det $extra $tool: ok')" 2>&1 \
          | grep "SUMMARY\|: ok\|rror" || rc=1
      done
    done | tee "$dir/sanitizer-backward-$gpu.txt"
    timeout 540 $py bench.py --backward k9 k10 --sweep --out "$dir/backward-sweep-$gpu.json" || rc=1
    timeout 300 $py bench.py --backward k10_fa3 --sweep --out "$dir/backward-default-sweep-$gpu.json" || rc=1
    for d in 64 128; do for c in 0 1; do  # the variants (docs/k10.md's table joins the four files' rows)
      timeout 120 $py bench.py --backward k10 k10_overlap k10_flat k10_stmatrix k10_fa3 --seqlen 4096 --headdim $d \
        --causal $c --out "$dir/backward-variants-d$d-c$c-$gpu.json" || rc=1
    done; done
    # docs/k10.md's Profiling: the main kernels' counters, then where their warps wait
    timeout 240 $py scripts/ncu_profile.py --jobs bwd-k10_fa3 bwd-fa4 bwd-sdpa-cudnn bwd-k10 bwd-k9 \
      --out "$dir/ncu-profile-backward-$gpu.json" || rc=1
    timeout 220 $py scripts/ncu_stalls.py --backward --seqlen 16384 --headdim 128 --causal 0 \
      --out "$dir/ncu-stalls-backward-d128-n16k-$gpu.json" || rc=1
    timeout 220 $py scripts/ncu_stalls.py --backward --seqlen 16384 --headdim 128 --causal 1 \
      --out "$dir/ncu-stalls-backward-d128-n16k-causal-$gpu.json" || rc=1
    exit $rc
    ;;
  *) echo "usage: $0 check|perf|headline|ws|decode|fp8check|fp8|final|call|backward [dir]" >&2; exit 2 ;;
esac
