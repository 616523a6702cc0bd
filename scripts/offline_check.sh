#!/usr/bin/env bash
# make offline-check: make gpu-check on a simulated GPU box, here, without a GPU (what CI runs).
# The box is as the GPU boxes' images are: its python3 is a venv (theirs: /opt/torch/.venv) holding a CPU torch and
# what GPU images ship beside it. make gpu-check then installs the bundle (made for this python) with --no-index
# into a venv made from that interpreter with --system-site-packages (scripts/venv.sh). Checked: the box's torch is
# kept, every GPU test is collected and skipped, python train.py trains with the default config (W&B offline) from
# that venv, make gpu-collect writes its JSON (every part skipped); and make install with
# VENV_FLAGS=--system-site-packages over the same box (from the registries) keeps that torch too.
# This machine's python3 has packages of its own, which the venv sees too; so a wheel the bundle should hold but
# lacks could go unnoticed here. Checked against that: every distribution the project needs at run time is in the
# venv, in the box's own venv, or in the bundle, and the bundle the box gets (cp312) holds the same distributions.
#   bash scripts/offline_check.sh <bundle dir, for this python> <the box's bundle dir>
# BOX_TORCH: the torch on the box (default torch==2.13.0+cpu; torch==2.11.0 is the GPU box's, with its CUDA wheels).
# PIP_TORCH_ARGS: pip arguments to find it (the Makefile passes TORCH_INDEX_URL's).
set -euo pipefail
bundle=$(realpath "$1")
box_bundle=$(realpath "$2")
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
box=$(mktemp -d)
trap 'rm -rf "$box"' EXIT
system=$box/system
"$python" -m venv "$system"
python=$system/bin/python  # the box's python3
# shellcheck disable=SC2086  # PIP_TORCH_ARGS is a list of arguments
"$python" -m pip install -q ${PIP_TORCH_ARGS:-} "${BOX_TORCH:-torch==2.13.0+cpu}"
installed=$("$python" -c "from importlib.metadata import version; print(version('torch'))")  # pip's version
torch=$("$python" -c "import torch; print(torch.__version__)")  # what it says at run time (2.11.0+cu130)
"$python" -m pip install -q -c constraints.txt "torch==$installed" \
    lightning torchmetrics transformers safetensors tokenizers rich
echo "Simulated GPU box: $("$python" --version), torch $torch in the venv $system; installing $bundle offline"

kept() {  # the interpreter $1 imports the box's torch
    local seen
    seen=$("$1" -c "import torch; print(torch.__version__, torch.__file__)")
    case "$seen" in
        "$torch $system/"*) echo "The box's torch was kept: $seen" ;;
        *) echo "FAILED: $1 imports torch $seen, not the box's $torch"; exit 1 ;;
    esac
}

make gpu-check BUNDLE="$bundle" OUT="$box/out" GPU_PYTHON="$python" GPU_VENV="$box/venv"
kept "$box/venv/bin/python"
"$box/venv/bin/python" - "$box/out/gpu_check.json" "$bundle" "$box_bundle" "$box/venv" "$system" <<'PY'
import json, sys, sysconfig
from importlib.metadata import distribution, requires
from pathlib import Path
from packaging.requirements import Requirement
sys.path.insert(0, "scripts")
from gpu_bundle import BOX_HAS, canonical, closure, target_markers
report, bundle, box_bundle, venv, system = sys.argv[1:]
tests = json.load(open(report))["tests"]
outcomes = {test["outcome"] for test in tests}
assert tests and outcomes == {"skipped"}, f"pytest -m gpu without a GPU: expected every test skipped, got {outcomes}"
print(f"pytest -m gpu: {len(tests)} GPU tests collected, every one skipped")
names = {folder: {canonical(wheel.name.split("-")[0]) for wheel in Path(folder).glob("*.whl")}
         for folder in (bundle, box_bundle)}
assert names[bundle] == names[box_bundle], names[bundle] ^ names[box_bundle]
runtime = [Requirement(line) for line in requires("project") if "extra ==" not in line] + [Requirement("pytest")]
needed = closure(runtime, target_markers(sysconfig.get_python_version()), stop={canonical(n) for n in BOX_HAS})
ours = (venv, system)
host = {name for name in needed if not str(distribution(name).locate_file("")).startswith(ours)}
missing = sorted(host - names[bundle])
assert not missing, f"the box would lack {missing}: this machine's python3 has them, the bundle does not"
print(f"Every distribution the project needs is in the venv, the box's site or the bundle ({len(needed)})")
PY
HOME=$box/home "$box/venv/bin/python" train.py trainer.max_epochs=1 print_config=false hydra.run.dir="$box/run"
grep -q '"status": "completed"' "$box/run/result.json"
ls "$box"/run/wandb/offline-run-*/*.wandb >/dev/null
echo "python train.py trained from the offline install (W&B offline run written)"
# make gpu-collect without a GPU: every part skipped and named, the JSON as benchmarks/step_time.py --refit reads it
make gpu-collect BUNDLE="$bundle" OUT="$box/collect" GPU_PYTHON="$python" GPU_VENV="$box/venv"
"$box/venv/bin/python" scripts/gpu_collect.py --check "$box/collect/collect/gpu_collect.json"

make install VENV="$box/dev-venv" VENV_FLAGS=--system-site-packages PYTHON="$python"
kept "$box/dev-venv/bin/python"
