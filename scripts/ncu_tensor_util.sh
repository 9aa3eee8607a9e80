#!/usr/bin/env bash
# Tensor-core utilization of the WGMMA stages, one profiled launch each (GPU machine, ncu on PATH):
#   bash scripts/ncu_tensor_util.sh [seqlen] [head_dim] [causal] > results/ncu-tensor-util.txt
# Metric: sm__pipe_tensor_op_hmma_cycles_active (% of peak, averaged over SMs) of the first launch
# of each kernel at batch 16384/N, heads 2048/d, bf16. --clock-control none: the card runs at its
# own clocks, as in the timed runs, so durations are indicative and the percentage is what to read.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-8192}; D=${2:-128}; C=${3:-0}
METRICS=sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum
echo "ncu: N=$N d=$D causal=$C; $(python -c 'import torch; print(torch.cuda.get_device_name())')"
for k in k4 k5 k6_pp k6; do
  ncu --clock-control none --metrics "$METRICS" --kernel-name regex:FMHA --launch-count 1 --csv \
      python bench.py "$k" --seqlen "$N" --headdim "$D" --causal "$C" --no-peers 2>/dev/null \
    | awk -F'","' -v k="$k" '/hmma_cycles_active|gpu__time_duration/ {gsub(/"/, "", $NF); print k, $(NF-2), $NF}'
done
