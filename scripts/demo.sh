#!/usr/bin/env bash
# make demo: the framework at work on a CPU in a few minutes (2 cores: docs/testing.md has the time it took), in
# three commands a user would type: a memory plan before launch, a sweep of two 2-process jobs (DDP and FSDP) that
# train to the same numbers, and the sweep's HTML report. Everything lands in logs/demo/<date_time>/.
#   bash scripts/demo.sh <python>
set -euo pipefail
python=$1
out=logs/demo/$(date +%Y-%m-%d_%H-%M-%S)
started=$(date +%s)
step() { printf '\n== %s\n$ %s\n' "$1" "${*:2}"; "${@:2}"; }

step "1/3 Will it fit? The memory plan of a 2-process FSDP job, before anything starts" \
    "$python" train.py plan=true strategy=fsdp trainer.devices=2 print_config=false hydra.run.dir="$out/plan"
step "2/3 A sweep of two 2-process jobs on this CPU (gloo): DDP, then FSDP; the same numbers, epoch by epoch" \
    "$python" train.py -m strategy=ddp,fsdp trainer.devices=2 trainer.max_epochs=2 logger=csv \
    hydra.sweep.dir="$out/sweep"
step "3/3 One HTML report of the sweep, readable offline" \
    "$python" -m project.cli.report "$out/sweep" --by strategy -o "$out/report.html"
printf '\nmake demo: done in %d s; open %s. Next: README.md, Usage.\n' "$(($(date +%s) - started))" "$out/report.html"
