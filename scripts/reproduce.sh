#!/usr/bin/env bash
# Every result file behind the docs, in two parts that each fit a 10-minute device call.
#   bash scripts/reproduce.sh check results    # ref_check grid (all head dims) + GPU tests
#   bash scripts/reproduce.sh perf  results    # CHECK=1 headline runs, the sweep, K4 tuning
#   bash scripts/reproduce.sh headline results # the CHECK=1 headline runs alone (a second GPU, say)
# Each file records the command that wrote it; then, anywhere: python scripts/make_docs.py --plot
set -euo pipefail
part=${1:?check or perf}
dir=${2:-results}
mkdir -p "$dir"
py=$(command -v python3 || command -v python)
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
  *) echo "usage: $0 check|perf|headline [dir]" >&2; exit 2 ;;
esac
