#!/usr/bin/env bash
# Re-makes the Dashboards figures of docs/metrics.md from a real sweep: the report's screenshot (docs/report.png) and what
# `wandb leet` shows for one of its jobs (docs/leet.txt). Needs Debian's chromium and tmux.
set -euo pipefail
cd "$(dirname "$0")/.."
sweep=logs/docs/strategy-sweep
rm -rf "$sweep"
.venv/bin/python train.py -m strategy=ddp,fsdp,pipeline trainer.devices=2 data.num_features=32 data.num_train=2048 \
    'model.net.hidden_dims=[64,32]' model.optimizer.lr=0.05 data.batch_size=32 trainer.max_epochs=6 \
    print_config=false "hydra.sweep.dir=$sweep"
.venv/bin/python -m project.cli.report "$sweep" --by strategy
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
    --disable-component-update --disable-sync --hide-scrollbars --virtual-time-budget=10000 \
    --user-data-dir="$(mktemp -d)" --window-size=1400,1900 --screenshot=docs/report.png "file://$PWD/$sweep/report.html"
rm -f "$sweep/1/wandb/.wandb-leet.json"  # leet keeps its filter there
tmux new-session -d -s leet -x 140 -y 36 ".venv/bin/wandb leet $sweep/1/wandb"
sleep 5
tmux send-keys -t leet /  # filter the charts (a regex): losses and accuracies
sleep 1
tmux send-keys -t leet -l 'loss|acc'
sleep 1
tmux send-keys -t leet Enter
sleep 2
tmux capture-pane -t leet -p | sed 's/[[:space:]]*$//' > docs/leet.txt
tmux kill-session -t leet
