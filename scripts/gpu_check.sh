#!/usr/bin/env bash
# make gpu-check: on a GPU box without network, install the offline bundle (make gpu-bundle) over the system's torch,
# train 3 steps of every feature combination (scripts/gpu_smoke.py), run the GPU tests (pytest -m gpu) and the GPU
# benchmark (benchmarks/gpu.py), and write their results to OUT: gpu_check.md and gpu_check.json (the tables),
# gpu_smoke.{md,json}, gpu_tests.xml (junit), gpu_benchmark.{md,json}, calibrated.yaml
# (python -m project.cli.calibrate), gpu_predictions.{md,json} (the predictions against the benchmark), gpu_check.log.
#   bash scripts/gpu_check.sh <bundle dir> <out dir>
# GPU_PYTHON: the box's interpreter, the one with torch (default python3). GPU_VENV: the venv made over it
# (default .gpu-venv). GPU_CHECK_PARTS: some of "smoke tests benchmark" (all three, the default), for a box whose
# sessions are short, or "collect" (make gpu-collect: scripts/gpu_collect.py, into OUT/collect);
# GPU_TESTS_K: a pytest -k expression, e.g. memory_plan or "not memory_plan", to split the tests too;
# GPU_BENCHMARK_CASES: the benchmark's cases to run (benchmarks/gpu.py --cases), to split the benchmark.
# A failed test or benchmark still leaves every table; the exit code is then 1.
set -uo pipefail
bundle=$1
out=$2
python=${GPU_PYTHON:-python3}
venv=${GPU_VENV:-.gpu-venv}
cd "$(dirname "$0")/.."
if [ ! -d "$bundle" ]; then
    echo "No bundle at $bundle: run make gpu-bundle where pip reaches the registries, and bring that dir along."
    exit 2
fi
mkdir -p "$out"
log="$out/gpu_check.log"
# The venv sees the system's packages, torch among them. pip takes from the bundle only what is missing there, and
# with --no-index it can fetch nothing else, so the system's torch stays as it is. The project is this checkout,
# editable (the bundle's own wheel could be older than the checkout).
bash scripts/venv.sh "$python" "$venv" --system-site-packages || exit 2  # sees a venv interpreter's torch too
"$venv/bin/python" -m pip install -q --no-index --find-links "$bundle" -e ".[qlora]" pytest 2>&1 | tee "$log"
[ "${PIPESTATUS[0]}" = 0 ] || exit 2
py=$venv/bin/python
parts=${GPU_CHECK_PARTS:-smoke tests benchmark}
has_cuda() { "$py" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; }
smoke=not-run
if [[ " $parts " == *" smoke "* ]] && has_cuda; then
    # First: every feature combination a user can ask for, 3 steps each, passed or its first error line
    "$py" scripts/gpu_smoke.py --out "$out" 2>&1 | tee -a "$log"
    smoke=${PIPESTATUS[0]}
elif [[ " $parts " == *" smoke "* ]]; then
    echo "No CUDA device: scripts/gpu_smoke.py not run (--cpu runs it here)." | tee -a "$log"
fi
tests=not-run
if [[ " $parts " == *" tests "* ]]; then
    # junit_family xunit1: the one whose reports hold record_property's figures without a warning
    "$py" -m pytest -m gpu -p no:cacheprovider -q -rA -o junit_family=xunit1 --junitxml="$out/gpu_tests.xml" \
        ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} 2>&1 | tee -a "$log"
    tests=${PIPESTATUS[0]}
fi
if [[ " $parts " != *" benchmark "* ]]; then
    benchmark=not-run
elif has_cuda; then
    # This box's GPUs measured for the step-time model (under 2 minutes), as cluster file calibrated.yaml
    "$py" -m project.cli.calibrate --name calibrated --out "$out/calibrated.yaml" 2>&1 | tee -a "$log"
    # GPU_BENCHMARK_CASES: some of the benchmark's cases (benchmarks/gpu.py --cases), for a part of its own
    "$py" benchmarks/gpu.py --out "$out" --profile ${GPU_BENCHMARK_CASES:+--cases $GPU_BENCHMARK_CASES} 2>&1 \
        | tee -a "$log"  # profiles the cases that miss a target
    benchmark=${PIPESTATUS[0]}
    # Each case's throughput and peak beside plan=true's on the datasheet cluster and on calibrated.yaml
    "$py" scripts/gpu_predictions.py "$out" 2>&1 | tee -a "$log"
else
    echo "No CUDA device: benchmarks/gpu.py not run." | tee -a "$log"
    benchmark=not-run
fi
if [[ " $parts " == *" collect "* ]]; then
    # One call's worth of what benchmarks/step_time.py --refit reads (without CUDA: each part skipped, named)
    "$py" scripts/gpu_collect.py --out "$out/collect" 2>&1 | tee -a "$log"
    [ "${PIPESTATUS[0]}" = 0 ] || echo "scripts/gpu_collect.py: a part failed (see $out/collect)" | tee -a "$log"
fi
"$py" scripts/gpu_report.py "$out" --smoke-exit "$smoke" --tests-exit "$tests" --benchmark-exit "$benchmark"
