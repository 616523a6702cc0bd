#!/usr/bin/env bash
# Re-makes the Optuna dashboard figure of README.md and docs/sweeps.md (docs/optuna-dashboard.png) from a real search:
# 10 trials of ddp x 2 over a learning rate range whose top diverges (kept finite by clipping), pruned by the median
# pruner after 3 complete trials. Needs Debian's chromium.
set -euo pipefail
cd "$(dirname "$0")/.."
sweep=logs/docs/optuna-search
rm -rf "$sweep"
.venv/bin/python train.py hparams_search=optuna 'model.optimizer.lr=tag(log, interval(0.01, 100))' \
    strategy=ddp trainer.devices=2 data.num_features=32 data.num_train=4096 'model.net.hidden_dims=[64,32]' \
    trainer.max_epochs=5 trainer.gradient_clip_val=1.0 optimized_metric.name=val/loss optimized_metric.mode=min \
    hydra.sweeper.n_trials=10 hydra.sweeper.pruner.n_startup_trials=3 logger=csv print_config=false \
    "hydra.sweep.dir=$sweep"
port=8093
.venv/bin/optuna-dashboard "$sweep/optuna.journal" --host 127.0.0.1 --port $port --quiet &
server=$!
trap 'kill $server' EXIT
sleep 5
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
    --disable-component-update --disable-sync --hide-scrollbars --virtual-time-budget=20000 \
    --user-data-dir="$(mktemp -d)" --window-size=1400,1000 --screenshot=docs/optuna-dashboard.png \
    "http://127.0.0.1:$port/dashboard/studies/0"
