#!/usr/bin/env bash
# A venv made by an interpreter, with venv's own flags:
#   bash scripts/venv.sh <python> <venv dir> [--system-site-packages ...]
# With --system-site-packages, the venv also sees the interpreter's own site dirs. venv alone gives it the base
# interpreter's, so over an interpreter that is itself a venv (a GPU image's /opt/torch/.venv, where its torch is)
# the new venv would not see that torch. A .pth naming those dirs adds them; site skips a dir already on the path,
# so over a plain system python it changes nothing.
set -euo pipefail
python=$1
venv=$2
shift 2
"$python" -m venv "$@" "$venv"
if [[ " $* " == *" --system-site-packages "* ]]; then
    site_packages=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
    "$python" -c "import site; print('\n'.join(site.getsitepackages()))" > "$site_packages/_interpreter_site.pth"
fi
