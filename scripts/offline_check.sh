#!/usr/bin/env bash
# make offline-check: make gpu-check on a simulated GPU box, here, without a GPU (what CI runs).
# The box is this machine's python3 with a CPU torch and what GPU images ship beside it, installed into a user site
# of its own (PYTHONUSERBASE), which a venv made with --system-site-packages sees as system packages. make gpu-check
# then installs the bundle (made for this python) with --no-index. Checked: the box's torch is kept, every GPU test
# is collected and skipped, python train.py trains with the default config (W&B offline) from that venv; and make
# install with VENV_FLAGS=--system-site-packages over the same box (from the registries) keeps that torch too.
#   bash scripts/offline_check.sh <bundle dir>
# BOX_TORCH: the torch on the box (default torch==2.13.0+cpu; torch==2.11.0 is the GPU box's, with its CUDA wheels).
# PIP_TORCH_ARGS: pip arguments to find it (the Makefile passes TORCH_INDEX_URL's).
set -euo pipefail
bundle=$(realpath "$1")
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
box=$(mktemp -d)
trap 'rm -rf "$box"' EXIT
export PYTHONUSERBASE=$box/system PIP_ROOT_USER_ACTION=ignore
# shellcheck disable=SC2086  # PIP_TORCH_ARGS is a list of arguments
"$python" -m pip install -q --user --no-warn-script-location ${PIP_TORCH_ARGS:-} "${BOX_TORCH:-torch==2.13.0+cpu}"
torch=$("$python" -c "import torch; print(torch.__version__)")
"$python" -m pip install -q --user --no-warn-script-location -c constraints.txt "torch==$torch" \
    lightning torchmetrics transformers safetensors tokenizers rich
echo "Simulated GPU box: $("$python" --version), torch $torch in $PYTHONUSERBASE; installing $bundle offline"

kept() {  # the interpreter $1 imports the box's torch
    local seen
    seen=$("$1" -c "import torch; print(torch.__version__, torch.__file__)")
    case "$seen" in
        "$torch $PYTHONUSERBASE/"*) echo "The box's torch was kept: $seen" ;;
        *) echo "FAILED: $1 imports torch $seen, not the box's $torch"; exit 1 ;;
    esac
}

make gpu-check BUNDLE="$bundle" OUT="$box/out" GPU_PYTHON="$python" GPU_VENV="$box/venv"
kept "$box/venv/bin/python"
"$box/venv/bin/python" - "$box/out/gpu_check.json" <<'PY'
import json, sys
tests = json.load(open(sys.argv[1]))["tests"]
outcomes = {test["outcome"] for test in tests}
assert tests and outcomes == {"skipped"}, f"pytest -m gpu without a GPU: expected every test skipped, got {outcomes}"
print(f"pytest -m gpu: {len(tests)} GPU tests collected, every one skipped")
PY
HOME=$box/home "$box/venv/bin/python" train.py trainer.max_epochs=1 print_config=false hydra.run.dir="$box/run"
grep -q '"status": "completed"' "$box/run/result.json"
ls "$box"/run/wandb/offline-run-*/*.wandb >/dev/null
echo "python train.py trained from the offline install (W&B offline run written)"

make install VENV="$box/dev-venv" VENV_FLAGS=--system-site-packages PYTHON="$python"
kept "$box/dev-venv/bin/python"
