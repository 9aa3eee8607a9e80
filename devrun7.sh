set -u
mkdir -p $OUT/results
py=python3
timeout 330 $py bench.py k6 --sweep --rounds 3 --out $OUT/results/ws-sweep-rounds5-h100.json > $OUT/sweep.log 2>&1; echo "sweep rc=$?"
timeout 150 $py ref_check.py k6 k7 k8 --quick --out $OUT/results/refcheck-final-quick-h100.json > $OUT/refcheck.log 2>&1; echo "refcheck rc=$?"; tail -2 $OUT/refcheck.log
timeout 100 $py ref_check.py --decode --quick --out $OUT/results/refcheck-decode-quick-h100.json > $OUT/refcheck-decode.log 2>&1; echo "decode refcheck rc=$?"; tail -2 $OUT/refcheck-decode.log
tail -10 $OUT/sweep.log
