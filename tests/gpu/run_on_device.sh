#!/usr/bin/env bash
# Every GPU check and GPU benchmark in one call on the device machine (see ../shared/device/README.md):
#   device run, carry [".whl"], command: bash tests/gpu/run_on_device.sh [pytest -k expression]
# .whl holds the wheelhouse (../shared/device/wheelhouse.sh .whl), pytest-jupyter's wheel and this
# project's own wheel (pip wheel --no-deps -w .whl .). Results land in $OUT: the log, the measured
# figures (JSON lines), nvidia-smi's view, JUnit XML and the benchmarks' JSON; tests/gpu/save_results.py
# turns them into a dated file under benchmarks/results/.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH || exit 1
export PYTHONUNBUFFERED=1 GPU_QUOTA_FIGURES="$OUT/figures.jsonl"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia-smi.txt"
python3 -c 'import torch, cupy, jax; print("torch", torch.__version__, "cupy", cupy.__version__, "jax", jax.__version__)' | tee -a "$OUT/nvidia-smi.txt"

status=0
select=()
[ $# -gt 0 ] && select=(-k "$*")
# A device call ends at 600 s: pytest gets GPU_QUOTA_PYTEST_TIMEOUT of it (480 s by default), and says so when that
# limit, not a test, ended it (the test then running neither passed nor failed: run it again in a call of its own).
limit=${GPU_QUOTA_PYTEST_TIMEOUT:-480}  # at most about 560: the install and the GPU's description come first
if ! [[ $limit =~ ^[0-9]+$ ]]; then echo "GPU_QUOTA_PYTEST_TIMEOUT must be whole seconds, not '$limit'" >&2; exit 2; fi
timeout "$limit" python3 -m pytest tests/gpu tests/integration/test_examples.py -m gpu -s -v -p no:cacheprovider -o addopts="" \
  --junitxml="$OUT/junit.xml" "${select[@]}" 2>&1 \
  | grep -v -E '^(DEBUG|INFO) ' | tee "$OUT/gpu-tests.log"
pytest_status=${PIPESTATUS[0]}
if [ "$pytest_status" -eq 124 ]; then
  echo "== pytest STOPPED by the ${limit} s limit: the test running then did not finish" | tee -a "$OUT/gpu-tests.log"
fi
[ "$pytest_status" -eq 0 ] || status=1

if [ -z "${GPU_QUOTA_SKIP_BENCH:-}" ]; then
  timeout 200 python3 benchmarks/kernel_start_bench.py --nvml --rounds 15 --out "$OUT/kernel_start_nvml.json" 2>&1 | tee -a "$OUT/bench.log" || status=1
  timeout 300 python3 benchmarks/mps_bench.py --rounds 8 --save --out "$OUT/mps_bench.json" 2>&1 | tee -a "$OUT/bench.log" || status=1
  timeout 400 python3 benchmarks/park_bench.py --sizes 2,20 --rounds 3 --save --out "$OUT/park_bench.json" 2>&1 | tee -a "$OUT/bench.log" || status=1
  if [ -f benchmarks/monitor_bench.py ]; then
    timeout 120 python3 benchmarks/monitor_bench.py --real --out "$OUT/monitor_real_nvml.json" 2>&1 | tee -a "$OUT/bench.log" || status=1
  fi
fi
echo "== figures"
cat "$OUT/figures.jsonl" 2>/dev/null
grep -E "passed|failed|error" "$OUT/gpu-tests.log" | tail -3
exit $status
