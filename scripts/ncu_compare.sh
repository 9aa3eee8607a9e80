#!/usr/bin/env bash
# k6 beside flash-attn-4 under Nsight Compute, one profiled launch of each (GPU machine, ncu on PATH):
#   bash scripts/ncu_compare.sh [seqlen] [head_dim] [causal] > results/ncu-compare-<...>.txt
# Same workload as bench.py (batch 16384/N, heads 2048/d, bf16). Metrics: duration, tensor-pipe and
# issue-slot activity, instructions executed, and the warp-stall breakdown (cycles per issued
# instruction by reason, summed over all warps: producer, consumers, both kernels' idle warps).
# --clock-control none: the card runs at its own clocks, so read ratios, not absolute times.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-16384}; D=${2:-128}; C=${3:-0}
STALLS=barrier,branch_resolving,dispatch_stall,drain,imc_miss,lg_throttle,long_scoreboard,math_pipe_throttle
STALLS=$STALLS,membar,mio_throttle,misc,no_instruction,not_selected,selected,short_scoreboard,sleeping,tex_throttle,wait
METRICS=gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
METRICS=$METRICS,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum
METRICS=$METRICS,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active
for s in ${STALLS//,/ }; do METRICS=$METRICS,smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio; done
echo "ncu: N=$N d=$D causal=$C; $(python -c 'import torch; print(torch.cuda.get_device_name())')"
for pair in "k6:FMHA" "fa4:FlashAttentionForwardSm90"; do
  name=${pair%%:*}; regex=${pair#*:}
  ncu --clock-control none --metrics "$METRICS" --kernel-name "regex:$regex" --launch-count 1 --csv \
      python bench.py k6 --seqlen "$N" --headdim "$D" --causal "$C" 2>/dev/null \
    | awk -F'","' -v k="$name" '/"[0-9]+","/ && ($(NF-2) ~ /__/) {gsub(/"/, "", $NF); print k, $(NF-2), $NF}'
done
