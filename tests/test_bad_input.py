"""Bad input: a one-paragraph error naming the key and the fix, exit code 1, before any worker or W&B run.

Every case is a real ``python train.py <args>`` process (forked from ``tests/helpers/preloaded.py``, which has
imported torch
and Lightning once; as many at once as there are cores, so that the whole table costs about a minute).
"""

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import QLORA, REPO, TINY, TINY_GPT, TINY_LLAMA_NF4, only_run, train, train_server
from helpers.preloaded import TRAIN
from helpers.probes import freeze, thaw

from project.cli.chat_example import write_example
from project.cli.prepare import prepare

# (overrides, what the message must say). The overrides come after TINY (the MLP) unless they name a language model
# (LM_MARKS: after TINY_GPT's data); {files}, {mlp_ckpt} and {fsdp_ckpt} are filled in by the fixture, and " ... "
# stands for any text.
# Our own errors read "Config error: <key>: <problem> Fix: <fix>"; Hydra's own (an unknown option or key) name the
# key their way.
NF4_SHAPE = [arg for arg in TINY_LLAMA_NF4 if arg.startswith("model")]  # a Llama whose weights NF4 can store
DPO = ["experiment=dpo", "data=preference", "model=qwen3", "data.tokenizer={files}/chat/model"]  # seeded weights
GRPO = ["experiment=grpo", "data=prompts", "model=qwen3", "data.tokenizer={files}/chat/model"]
GRPO_HELLO = [
    *GRPO,
    "data.path={files}/chat/prompts.jsonl",
    "model.grpo.reward_functions=[{files}/chat/rewards.py:hello]",
]

CASES = [
    # Numbers and their ranges
    (["trainer.devices=0"], "trainer.devices: must be a positive integer, got 0"),
    (["trainer.devices=two"], "trainer.devices: must be a positive integer, got 'two'"),
    (["strategy=ddp", "trainer.devices=-2"], "trainer.devices: must be a positive integer, got -2"),
    (["data.batch_size=0"], "data.batch_size: must be a positive integer, got 0"),
    (["data.batch_size=abc"], "data.batch_size: must be a positive integer, got 'abc'"),
    (["strategy=ddp", "trainer.devices=2", "data.batch_size=-1"], "data.batch_size: must be a positive integer"),
    (["trainer.max_epochs=two"], "trainer.max_epochs: must be a positive integer, got 'two'"),
    (["trainer.max_epochs=0"], "trainer.max_epochs: must be a positive integer, got 0"),
    (["trainer.max_epochs=-2"], "trainer.max_epochs: must be a positive integer, got -2"),
    (["trainer.max_steps=0"], "trainer.max_steps: must be a positive integer, got 0"),
    (["trainer.max_epochs=-1"], "trainer.max_epochs: is -1 (no epoch limit) and trainer.max_steps is -1 too"),
    (["seed=abc"], "seed: must be an integer from 0 to 2**32 - 1, got 'abc'"),
    # An Optuna search's settings, refused by the sweeper before its first trial
    (
        ["hparams_search=optuna", "hydra.sweeper.direction=[minimize,maximize]", "hydra.sweep.dir={files}/directions"],
        "hydra.sweeper.direction: lists 2 direction(s), but each job returns 1 value(s)",
    ),
    (
        [
            "hparams_search=optuna",
            "hydra.sweeper.direction=[minimize,maximize]",
            "optimized_metric.also=[val/loss]",
            "hydra.sweep.dir={files}/multi-objective",
        ],
        "hydra.sweeper.pruner: is set, but Optuna prunes single-objective studies only",
    ),
    (
        ["hparams_search=optuna", "hydra.sweeper.direction=[maximise]", "hydra.sweep.dir={files}/typo"],
        "hydra.sweeper.direction: has 'maximise', which is neither minimize nor maximize",
    ),
    (
        ["hparams_search=optuna", "optimized_metric.mode=maxx", "hydra.sweep.dir={files}/mode"],
        "optimized_metric.mode: is 'maxx'. Fix: use max (higher is better) or min.",
    ),
    (
        ["hparams_search=optuna", "model.optimizer.lr=tag(log,interval(0.3,0.001))", "hydra.sweep.dir={files}/ends"],
        "model.optimizer.lr: searches interval(0.3, 0.001), whose low end is above its high end. Fix: give the low end "
        "first: interval(0.001, 0.3).",
    ),
    (
        ["hparams_search=optuna", "model.optimizer.lr=tag(log,interval(0.0,0.3))", "hydra.sweep.dir={files}/log0"],
        "model.optimizer.lr: searches interval(0.0, 0.3) on a log scale, which needs ends above 0.",
    ),
    (
        ["hparams_search=optuna", "hydra.sweeper.n_trials=0", "hydra.sweep.dir={files}/none"],
        "hydra.sweeper.n_trials: must be a positive integer, got 0",
    ),
    (
        ["hparams_search=optuna", "hydra.sweeper.max_failure_rate=2", "hydra.sweep.dir={files}/rate"],
        "hydra.sweeper.max_failure_rate: is 2.0, but it is a share of a batch's trials: from 0 to 1",
    ),
    (
        ["hparams_search=optuna", "hydra.sweeper.storage=nosuchdb://x/y", "hydra.sweep.dir={files}/url"],
        "hydra.sweeper.storage: nosuchdb://x/y cannot be opened: Can't load plugin",
    ),
    (
        ["hparams_search=optuna", "hydra.sweeper.storage={files}/frozen/o.journal", "hydra.sweep.dir={files}/journal"],
        "hydra.sweeper.storage: {files}/frozen is not writable by this process",
    ),
    (["optimized_metric.also=val/loss"], "optimized_metric.also: must be a list of metric names, got 'val/loss'"),
    # Launchers this machine cannot honour (no SLURM here)
    (["launcher=slurm", "hydra.sweep.dir={files}/slurm"], "launcher: is slurm, but this machine has no SLURM"),
    (
        ["hydra.mode=MULTIRUN", "launcher=joblib", "hydra.launcher.n_jobs=0", "hydra.sweep.dir={files}/joblib"],
        "hydra.launcher.n_jobs: is 0: joblib runs N jobs at once for N > 0",
    ),
    (
        ["hydra.mode=MULTIRUN", "launcher=joblib", "hydra.launcher.backend=bogus", "hydra.sweep.dir={files}/backend"],
        "hydra.launcher.backend: is 'bogus', which joblib does not know. Fix: use one of loky, multiprocessing",
    ),
    # Overrides Hydra cannot parse (project/config/overrides.py)
    (["trainer.devices: 2"], "override 'trainer.devices: 2': has no '=' ... Fix: write trainer.devices=2."),
    (["model.net.hidden_dims=[32"], "override 'model.net.hidden_dims=[32': opens [ and never closes it."),
    (["trainer.devices=2=3"], "override 'trainer.devices=2=3': is not an override Hydra can read: mismatched input"),
    # Keys the config does not have: the nearest it has, not Hydra's advice to add them with + (a sweep's swept keys
    # before the sweep dir is made: relative, it would land in the launch dir)
    (["trainer.max_epoch=3"], "trainer.max_epoch: is not a key of trainer: did you mean trainer.max_epochs?"),
    (["traner.max_epochs=3"], "traner.max_epochs: is not a key of the config: did you mean trainer.max_epochs?"),
    (["trainer.max_epochs.x=3"], "trainer.max_epochs.x: goes below trainer.max_epochs, which is a value"),
    (["model.optimizer={lrr:0.1}"], "model.optimizer.lrr: is not a key of model.optimizer: did you mean"),
    (
        ["hydra.mode=MULTIRUN", "trainer.max_epoch=3,4", "hydra.sweep.dir=sweep"],
        "trainer.max_epoch: is not a key of trainer ... Fix: write trainer.max_epochs=3,4",
    ),
    (
        ["hparams_search=optuna", "model.optimizer.lrr=interval(0.01,0.1)", "hydra.sweep.dir=search"],
        "model.optimizer.lrr: is not a key of model.optimizer: did you mean model.optimizer.lr?",
    ),
    # Every other option against its constructor's type hints (project/config/schema.py); no number non-finite
    (["model.compile=no"], "model.compile: must be true or false, got 'no'"),
    # A misspelt key added with + (as Hydra's own message advises): refused before Lightning sees it
    (
        ["+trainer.max_epoch=3"],
        "trainer.max_epoch: is not an option of lightning.pytorch.Trainer. Fix: did you mean trainer.max_epochs?",
    ),
    (["+data.batchsize=8"], "data.batchsize: is not an option of project.data.synthetic.SyntheticDataModule"),
    (["data.shuffle=off"], "data.shuffle: must be true or false, got 'off'"),
    (["trainer.deterministic=yes"], "trainer.deterministic: must be true or false or 'warn', got 'yes'"),
    (["model=gpt", "model.net.num_heads=2.5"], "model.net.num_heads: must be a positive integer, got 2.5"),
    (["model=gpt", "model.net.dropout=1.0"], "model.net.dropout: must be a number from 0 to 1 (1 excluded), got 1.0"),
    (["model=qwen3", "model.net.head_dim=15"], "model.net.head_dim: gives heads of 15 dimensions"),
    (["model=qwen2", "model.net.num_heads=3"], "model.net.num_heads: is 3, which does not divide"),
    (["model=qwen3", "model.net.qkv_bias=true"], "model.net.qkv_bias: is true with model.net.qk_norm=true"),
    (["data.num_train=null"], "data.num_train: must be a positive integer, got None"),
    (["model=gpt", "model.net.gelu_approximate=fast"], "model.net.gelu_approximate: must be one of 'none', 'tanh'"),
    (
        ["model.activation_checkpointing=partial"],
        "model.activation_checkpointing: must be true or false or 'selective', got 'partial'",
    ),
    # Sizes the model must cover: every token id of the data (32 here), every position of a sequence (16)
    (["model=gpt", "model.net.vocab_size=16"], "model.net.vocab_size: is 16, fewer than the 32 tokens of the data's"),
    (["model=gpt", "model.net.max_length=8"], "data.seq_length: is 16, longer than the model's 8 learned positions"),
    (
        ["model=gpt", "model.scheduler.warmup_fraction=1.5"],
        "model.scheduler.warmup_fraction: must be a number from 0 to 1, got 1.5",
    ),
    (["callbacks.memory.tracked_steps=-1"], "callbacks.memory.tracked_steps: must be an integer of at least 0"),
    (["logger.wandb.mode=offlne"], "logger.wandb.mode: must be one of 'online', 'offline', 'disabled', got 'offlne'"),
    (["model.optimizer.lr=nan"], "model.optimizer.lr: is nan, not a finite number"),
    (["model.optimizer.lr=-inf"], "model.optimizer.lr: is -inf, not a finite number"),
    (["seed=-1"], "seed: must be an integer from 0 to 2**32 - 1, got -1"),
    (["trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches: must be a positive integer, got 0"),
    (["trainer.check_val_every_n_epoch=0"], "trainer.check_val_every_n_epoch: must be a positive integer, got 0"),
    (["trainer.val_check_interval=1000"], "trainer.val_check_interval: is 1000 batches, but an epoch has"),
    (["trainer.check_val_every_n_epoch=null"], "trainer.val_check_interval: is None, but with trainer.check_val_every"),
    (
        ["+trainer.limit_train_batches=0.25", "trainer.val_check_interval=8"],  # TINY: 16 batches an epoch
        "trainer.val_check_interval: is 8 batches, but an epoch has 4",
    ),
    (
        ["trainer.accumulate_grad_batches=3", "trainer.val_check_interval=0.5"],
        "trainer.val_check_interval: validates every 8 training batches, inside an optimizer step",
    ),
    (
        ["trainer.accumulate_grad_batches=3", "trainer.check_val_every_n_epoch=null", "trainer.val_check_interval=6"],
        "trainer.val_check_interval: counts batches across epochs, but an epoch's 16 batches are no multiple",
    ),
    (["trainer.log_every_n_steps=-1"], "trainer.log_every_n_steps: must be an integer of at least 0, got -1"),
    (["trainer.num_sanity_val_steps=-5"], "trainer.num_sanity_val_steps: must be an integer of at least -1"),
    (["trainer.gradient_clip_val=-1"], "trainer.gradient_clip_val: must be a positive number or null, got -1"),
    (["data.num_train=0"], "data.num_train: must be a positive integer, got 0"),
    (["data.num_features=0"], "data.num_features: must be a positive integer, got 0"),
    (["strategy=ddp", "trainer.devices=4", "data.num_val=3"], "data.num_val: gives 3 validation samples"),
    (["strategy=ddp", "trainer.devices=2", "data.batch_size=600"], "data.batch_size: gives a global batch of 600 x 2"),
    (
        ["strategy=ddp", "trainer.devices=2", "data.num_train=1"],
        "trainer.devices: x trainer.num_nodes gives 2 data-parallel replicas, more than the 1 training samples",
    ),
    (["plan=no"], "plan: must be true or false or 'search', got 'no'"),
    (["plan=search"], "cluster: is not set: plan=search predicts step times on a cluster's GPUs and network"),
    (
        ["plan=search", "cluster=h100_sxm_8x", "plan_search.strategies=[fsdp,tensor_parallel]"],
        "plan_search.strategies: names tensor_parallel, which plan=search cannot lay out",
    ),
    (
        ["plan=search", "cluster=h100_sxm_8x", "strategy=ddp", "trainer.devices=16"],
        "trainer.devices: is 16, more than the 8 GPUs of one h100_sxm_8x node",
    ),
    (["plan=true", "cluster=h100_sxm_8x", "trainer.devices=9"], "trainer.devices: is 9, more than the 8 GPUs"),
    (["plan=search", "cluster=h100_sxm_8x", "cluster.peak_tflops=0"], "cluster.peak_tflops: must be a positive number"),
    (["plan=true", "cluster=a100_80g_8x", "cluster.memory_gb=lots"], "cluster.memory_gb: must be a positive number"),
    (
        ["plan=search", "cluster=h100_sxm_8x", "cluster.devices_per_node=0"],
        "cluster.devices_per_node: must be a positive integer, got 0",
    ),
    (["plan=search", "cluster=h200_8x", "cluster.matmul_efficiency=1.5"], "cluster.matmul_efficiency: must be"),
    (
        ["plan=true", "cluster=h200_8x", "~cluster.host_costs.dtensor"],
        "cluster.host_costs: is {'compiled_kernels': 0.18, 'compiled_calls': 69.0, 'fsdp_modules': 59.0, "
        "'framework_step': 80.0}, but it gives each of compiled_kernels, compiled_calls, dtensor, fsdp_modules, "
        "framework_step",
    ),
    (["plan=true", "cluster=h200_8x", "cluster.host_costs.dtensor=0"], "cluster.host_costs: is {"),
    (
        ["plan=search", "cluster=h100_sxm_8x", "plan_search.max_pipeline_ranks=0"],
        "plan_search.max_pipeline_ranks: must be a positive integer, got 0",
    ),
    (["plan=search", "cluster=h100_sxm_8x", "plan_search.strategies=fsdp"], "plan_search.strategies: must be a list"),
    (
        ["plan=search", "cluster=h100_sxm_8x", "plan_search.strategies=[]"],
        "plan_search.strategies: is [], which lays out no layout of the job's 1 device(s)",
    ),
    (
        ["model=gpt", "model.net.tie_weights=true", "trainer.devices=2", "plan=search", "cluster=h100_sxm_8x"]
        + ["plan_search.strategies=[pipeline]"],
        "plan_search.strategies: is ['pipeline'], which lays out no layout of the job's 2 device(s) ... "
        "strategy=pipeline: model.net.tie_weights ties the first stage's token embedding ... for strategy=pipeline: "
        "set model.net.tie_weights=false",
    ),
    (
        ["plan=search", "cluster=h100_sxm_8x", "paths.cache_dir=/proc/plan"],  # /proc takes no new dirs, even root's
        "paths.cache_dir: /proc/plan/plan_cache cannot be created",
    ),
    (["tags=5"], "tags: must be a list, got 5"),
    # Devices, nodes, precision, process groups
    (
        ["trainer.accelerator=gpu", "trainer.devices=2"],
        "trainer.accelerator: is 'gpu' but this machine has no CUDA GPU",
    ),
    (["trainer.accelerator=tpu"], "trainer.accelerator: is 'tpu', which this machine does not have"),
    (["trainer.accelerator=abacus"], "trainer.accelerator: is 'abacus', which Lightning does not know"),
    (["strategy=ddp", "trainer.devices=2", "trainer.num_nodes=2"], "trainer.num_nodes: is more than 1"),
    (["trainer.precision=16-mixed"], "trainer.precision: is '16-mixed', but float16 training needs a CUDA GPU"),
    (["trainer.precision=17"], "trainer.precision: Precision 17 is invalid"),
    (["trainer.precision=null"], "trainer.precision: is null. Fix: set it: 32-true (Lightning's default)"),
    (
        ["strategy=fsdp", "trainer.devices=2", "trainer.precision=64"],
        "trainer.precision: is '64-true', which Lightning's",
    ),
    (
        ["strategy=ddp", "trainer.devices=2", "strategy.process_group_backend=nccl"],
        "strategy.process_group_backend: is 'nccl', which needs CUDA GPUs, but this run is on the CPU",
    ),
    (
        ["strategy=ddp", "trainer.devices=2", "strategy.process_group_backend=pigeon"],
        "strategy.process_group_backend: is 'pigeon', not a torch.distributed backend",
    ),
    (["strategy=ddp", "trainer.devices=2", "strategy.timeout.minutes=0"], "strategy.timeout: is 0:00:00, under 10 s"),
    (
        ["strategy=fsdp", "trainer.devices=2", "strategy.timeout.minutes=0.0005"],
        "strategy.timeout: is 0:00:00.030000, under 10 s: the ranks' first collectives",
    ),
    (
        ["strategy=ddp", "trainer.devices=2", "strategy.heartbeat_timeout=0.5"],
        "strategy.heartbeat_timeout: must be a number of seconds from 10 (ten of a worker's heartbeats",
    ),
    (
        ["strategy=ddp", "trainer.devices=2", "strategy.heartbeat_timeout=0"],
        "strategy.heartbeat_timeout: must be a number of seconds from 10",
    ),
    (
        ["strategy=fsdp", "trainer.devices=2", "strategy.heartbeat_timeout=inf"],
        "strategy.heartbeat_timeout: must be a number of seconds from 10 ... or null, got inf",
    ),
    # Strategies' own rules and options
    (
        ["strategy=fsdp", "trainer.devices=2", "strategy.cpu_offload=true"],
        "strategy.cpu_offload: moves parameter shards from GPU to CPU memory, but this run has no GPU",
    ),
    (
        ["strategy=fsdp", "trainer.devices=2", "strategy.reduce_dtype=float99"],
        "strategy.reduce_dtype: must be one of 'float32', 'bfloat16', 'float16', got 'float99'",
    ),
    (
        ["strategy=ddp", "trainer.devices=2", "strategy.processes=3"],
        "strategy.processes: is 3, but strategy=ddp runs one process per device: it needs 2 with trainer.devices=2",
    ),
    (
        ["strategy=model_parallel", "trainer.devices=2", "strategy.processes=2"],
        "strategy.processes: is 2, but strategy=model_parallel drives every device from one process: it needs 1",
    ),
    (
        ["strategy=pipeline", "trainer.devices=2", "strategy.microbatches=0"],
        "strategy.microbatches: must be a positive integer, got 0",
    ),
    (["strategy=model_parallel", "trainer.devices=4"], "strategy.num_stages: cannot split the model: 4 stages"),
    (
        ["strategy=model_parallel", "trainer.devices=2", "strategy.blocks_per_stage=[]"],
        "strategy.blocks_per_stage: cannot split the model",
    ),
    (
        ["+strategy._target_=lightning.pytorch.strategies.SingleDeviceStrategy"],
        "strategy._target_: is SingleDeviceStrategy, which this project cannot lay out",
    ),
    (
        ["strategy=pipeline", "trainer.devices=2", "strategy.blocks_per_stage=[1,1]"],
        "strategy.blocks_per_stage: cannot split",
    ),
    (
        ["strategy=pipeline", "trainer.devices=2", "data.batch_size=30", "strategy.microbatches=4"],
        "strategy.microbatches: is 4, which does not divide data.batch_size=30",
    ),
    (
        ["strategy=pipeline", "trainer.devices=2", "strategy.microbatches=1"],
        "strategy.microbatches: is 1, fewer than the 2",
    ),
    (
        ["strategy=pipeline", "trainer.devices=3", "strategy.num_stages=2"],
        "trainer.devices: gives 3 processes, not a multiple",
    ),
    (
        ["strategy=pipeline", "trainer.devices=2", "strategy.schedule=zigzag"],
        "strategy.schedule: must be one of 'gpipe', '1f1b', 'interleaved_1f1b', got 'zigzag'",
    ),
    (
        [
            "strategy=pipeline",
            "strategy.num_stages=2",
            "strategy.stages_per_rank=2",
            "strategy.schedule=interleaved_1f1b",
            "trainer.devices=1",
        ],
        "strategy.stages_per_rank: is 2 of 2 stages: one pipeline rank, which interleaved_1f1b cannot run",
    ),
    # Tensor parallelism: the sizes each plan splits, and the mesh (tiny GPT: 2 heads of 16; tiny Llama: 1 kv head)
    (
        ["model=gpt", "strategy=tensor_parallel", "trainer.devices=4"],
        "model.net.num_heads: gives the model's attention heads (2), which 4 tensor-parallel ranks",
    ),
    (
        ["model=llama", "model.net.num_kv_heads=1", "strategy=tensor_parallel", "trainer.devices=2"],
        "model.net.num_kv_heads: gives the model's key/value heads (1), which 2 tensor-parallel ranks",
    ),
    (
        [
            "model=llama",
            "model.net.num_kv_heads=2",
            "model.net.hidden_dim=63",
            "strategy=fsdp",
            "trainer.devices=2",
            "strategy.tensor_parallel_size=2",
        ],
        "model.net.hidden_dim: gives the model's SwiGLU hidden units (63), which 2",
    ),
    (
        ["model.net.hidden_dims=[63,32]", "strategy=tensor_parallel", "trainer.devices=2"],
        "model.net.hidden_dims: gives the model's units of hidden layer 0 (63), which 2 tensor-parallel ranks",
    ),
    (
        ["model=gpt", "data.seq_length=15", "strategy=tensor_parallel", "trainer.devices=2"],
        "data.seq_length: is 15, which 2 tensor-parallel ranks cannot share evenly under sequence parallelism",
    ),
    (
        ["strategy=fsdp", "trainer.devices=3", "strategy.tensor_parallel_size=2"],
        "trainer.devices: gives 3 processes, not a multiple of strategy.tensor_parallel_size=2",
    ),
    (
        ["strategy=tensor_parallel", "trainer.devices=4", "strategy.tensor_parallel_size=2"],
        "strategy.tensor_parallel_size: is 2 of the job's 4 processes; strategy=tensor_parallel runs one replica",
    ),
    # A tensor-parallel group is one data-parallel replica (TINY: 1024 training samples).
    (
        ["strategy=tensor_parallel", "trainer.devices=2", "data.batch_size=1025"],
        "data.batch_size: gives a global batch of 1025 x 1 data-parallel replicas = 1025 samples",
    ),
    (
        ["strategy=fsdp", "trainer.devices=4", "strategy.tensor_parallel_size=2", "data.batch_size=600"],
        "data.batch_size: gives a global batch of 600 x 2 data-parallel replicas = 1200 samples",
    ),
    (
        ["strategy=fsdp", "trainer.devices=2", "strategy.tensor_parallel_size=0"],
        "strategy.tensor_parallel_size: must be a positive integer, got 0",
    ),
    (
        [
            "model=gpt",
            "strategy=pipeline",
            "trainer.devices=6",
            "strategy.num_stages=2",
            "strategy.tensor_parallel_size=2",
        ],
        "trainer.devices: gives 6 processes, not a multiple of the 4 ranks one pipeline needs (2 stages / 1 per rank "
        "x 2",
    ),
    # The model, its optimizer and schedule
    (["model.net.hidden_dims=abc"], "model.net.hidden_dims: must be a list, got 'abc'"),
    (
        ["model.net.hidden_dims=[64,0]"],
        "model.net.hidden_dims: must be a list, each item a positive integer, got [64, 0]",
    ),
    (["model.net._target_=no.such.Model"], "model.net: cannot be built: ImportError: Error loading 'no.such.Model'"),
    (["model.no_weight_decay=[bias,layernorm]"], "model.no_weight_decay: names ['layernorm'], which are not parameter"),
    (["model.optimizer.lr=-1"], "model.optimizer.lr: is refused by the optimizer: Invalid learning rate: -1"),
    (["model.optimizer.lr=abc"], "model.optimizer.lr: must be a number, got 'abc'"),
    (
        ["model.optimizer.momentum=-0.5"],
        "model.optimizer.momentum: is refused by the optimizer: Invalid momentum value",
    ),
    (
        ["model=gpt", "model.optimizer.betas=[0.9,1.5]"],
        "model.optimizer.betas: is refused by the optimizer: Invalid beta",
    ),
    (["model=gpt", "model.optimizer.weight_decay=-0.1"], "model.optimizer.weight_decay: is refused by the optimizer"),
    (["model=gpt", "model.net.num_heads=3"], "model.net.num_heads: is 3, which does not divide model.net.dim=32"),
    (["model=gpt", "data.seq_length=0"], "data.seq_length: must be a positive integer, got 0"),
    (
        ["model.scheduler={_target_:torch.optim.lr_scheduler.StepLR,_partial_:true,step_size:10}"],
        "model.scheduler: cannot be built as factory(optimizer, run_steps=...)",
    ),
    (
        ["model=gpt", "model.scheduler.warmup_steps=10"],
        "model.scheduler.warmup_fraction: is 0.08 while model.scheduler.warmup_steps",
    ),
    # Checkpoints
    (["ckpt_path=/nonexistent/model.ckpt"], "ckpt_path: /nonexistent/model.ckpt does not exist"),
    (
        ["ckpt_path=last"],
        "ckpt_path: ... does not exist. Fix: ckpt_path=last resumes the run dir given by hydra.run.dir",
    ),
    (["ckpt_path={files}/a_dir"], "ckpt_path: {files}/a_dir is a directory, not a sharded checkpoint"),
    (["ckpt_path={files}/random.ckpt"], "ckpt_path: {files}/random.ckpt is not a checkpoint file"),
    (["ckpt_path={mlp_ckpt}", "model.net.hidden_dims=[128]"], "ckpt_path: {mlp_ckpt} is a checkpoint of another model"),
    (["model=gpt", "ckpt_path={mlp_ckpt}"], "ckpt_path: {mlp_ckpt} is a checkpoint of another model"),
    (
        ["ckpt_path={fsdp_ckpt}", "model.net.hidden_dims=[64,16]"],
        "ckpt_path: {fsdp_ckpt} is a checkpoint of another model: net.blocks.1.0.weight is [32, 64] there, "
        "[16, 64] here",
    ),
    # Data files
    (
        ["model=gpt", "data=text", "data.path=corpus.txt"],
        "data.path: must be an existing file, got 'corpus.txt'",
    ),  # docs/models.md's example
    (["model=gpt", "data=text", "data.path={files}/a_dir"], "data.path: must be an existing file, got '{files}/a_dir'"),
    (["model=gpt", "data=text", "data.path={files}/empty.txt"], "data.path: {files}/empty.txt has 0 bytes, too few"),
    (["model=gpt", "data=text", "data.path={files}/tiny.txt"], "data.path: {files}/tiny.txt has 11 bytes, too few"),
    (
        ["model=gpt", "data=text", "data.path={files}/corpus.txt", "data.val_fraction=0"],
        "data.val_fraction: must be a number from 0 to 1 (0 and 1 excluded), got 0",
    ),
    (
        ["model=gpt", "data=text", "data.path={files}/corpus.txt", "data.val_fraction=0.0001"],
        "data.val_fraction: is 0.0001: the last 1 bytes of {files}/corpus.txt hold no validation sequence",
    ),
    (["model=gpt", "data=shards"], "data.path: is required and has no value"),
    (
        ["model=gpt", "data=shards", "data.path={files}/a_dir"],
        "data.path: {files}/a_dir has no meta.json: it is not a prepared corpus",
    ),
    (
        ["model=gpt", "data=shards", "data.path={files}/shards", "data.num_workers=-1"],
        "data.num_workers: must be an integer of at least 0, got -1",
    ),
    (
        ["model=gpt", "data=shards", "data.path={files}/shards-missing"],
        "data.path: {files}/shards-missing/train_000001.bin is missing, a shard of the train split its meta.json lists",
    ),
    (
        ["model=gpt", "data=shards", "data.path={files}/shards-cut"],
        "data.path: {files}/shards-cut/train_000000.bin has 2024 bytes; its header promises ... a shard of the train",
    ),
    (
        [
            "model=gpt",
            "data=shards",
            "data.path={files}/shards-bad-tokenizer",
            "data.seq_length=16",
            "callbacks.text_sample.prompt=hi",
        ],
        "data.path: {files}/shards-bad-tokenizer/tokenizer.json is not a tokenizer file Hugging Face tokenizers can",
    ),
    # Where the job writes
    (["hydra.run.dir="], "hydra.run.dir: is empty, so the job would write into the dir it was launched from"),
    (["hydra.run.dir={files}/a_file/job"], "hydra.run.dir: {files}/a_file/job cannot be created: Not a directory"),
    (["hydra.run.dir={files}/frozen"], "hydra.run.dir: {files}/frozen is not writable by this process."),
    (
        ["callbacks.model_checkpoint.dirpath={files}/frozen/checkpoints"],
        "callbacks.model_checkpoint.dirpath: {files}/frozen/checkpoints is not writable by this process",
    ),
    # Hydra's own: an option that does not exist (it lists those there are)
    (["model=nosuch"], "Could not find 'model/nosuch'"),
    (["nosuchkey=1"], "nosuchkey: is not a key of the config (python train.py --cfg job lists them)."),
    (
        [
            "model=gpt",
            "data=text",
            "data.path={files}/corpus.txt",
            "callbacks.text_sample.prompt=hi",
            "callbacks.text_sample.top_k=0",
        ],
        "callbacks.text_sample.top_k: must be a positive integer, got 0",
    ),
    (
        ["model=gpt", "callbacks.text_sample.prompt=hi"],
        "callbacks.text_sample.prompt: is set, but MarkovTokenDataModule has no text to write a prompt in",
    ),
    (
        [
            "model=gpt",
            "data=text",
            "data.path={files}/corpus.txt",
            "strategy=pipeline",
            "trainer.devices=2",
            "callbacks.text_sample.prompt=hi",
        ],
        "callbacks.text_sample.prompt: is set, but under strategy=pipeline as configured no rank",
    ),
    (
        [
            "model=gpt",
            "data=text",
            "data.path={files}/corpus.txt",
            "strategy=tensor_parallel",
            "trainer.devices=2",
            "callbacks.text_sample.prompt=hi",
        ],
        "callbacks.text_sample.prompt: is set, but under strategy=tensor_parallel",
    ),
    # The memory plan: a run predicted not to fit is refused before launch, naming the change that fits
    (
        ["model=gpt", "strategy=ddp", "trainer.devices=2", "memory_plan.device_memory_gb=0.002"],
        "memory_plan: predicts a peak of ... on rank 0, more than the 2.0 MiB of a device ... Fix: change "
        "model.activation_checkpointing=true, or set memory_plan.if_over=warn",
    ),
    (["memory_plan.device_memory_gb=0"], "memory_plan.device_memory_gb: must be a positive number or null, got 0"),
    (["memory_plan.if_over=maybe"], "memory_plan.if_over: is 'maybe'"),
    (["mode=fit"], "mode: is 'fit'"),
    (["mode=eval"], "mode: is eval, but there are no weights to evaluate"),
    (["mode=eval", "ckpt_path=last"], "ckpt_path: is 'last', this job dir's own checkpoint"),
    (["model=llama", "model.net.num_kv_heads=3"], "model.net.num_kv_heads: is 3, which does not divide"),
    (  # degenerate: its interpolation divides by high - low, and the run's loss is NaN from the first step
        ["model=llama", "model.net.rope_scaling={factor:8,low_freq_factor:4,high_freq_factor:4,original_max_length:8}"],
        "model.net.rope_scaling: has high_freq_factor 4, not above low_freq_factor 4",
    ),
    (["model=llama", "model.lora.rank=-1"], "model.lora.rank: must be an integer of at least 0, got -1"),
    (["model=llama", "model.lora={rank:4,alpha:8,dropout:0.0,targets:[qq]}"], "model.lora.targets: names ['qq']"),
    (["model=llama", "model.lora.quantize_base=true"], "model.lora.quantize_base: is true, but model.lora.rank is 0"),
    (["model=llama", "+model.compil=true"], "model.compil: is neither an option of LanguageModelModule nor a model"),
    (
        ["model=llama", "+model.lorra.rank=8"],
        "model.lorra: is neither an option of LanguageModelModule nor a model ... Fix: did you mean model.lora?",
    ),
    # QLoRA: a base NF4 cannot store, or one the run would dequantize or split by columns
    (["model=llama", QLORA], "model.lora.quantize_base: stores blocks.0.attention.q.weight ((32, 32)) in NF4"),
    (["model=llama", QLORA.replace("true}", "yes}")], "model.lora.quantize_base: must be true or false, got 'yes'"),
    ([*NF4_SHAPE, QLORA, "trainer.precision=bf16-true"], "trainer.precision: is bf16-true, which converts"),
    (
        [*NF4_SHAPE, QLORA, "strategy=tensor_parallel", "trainer.devices=2"],
        "model.lora.quantize_base: stores the base in NF4, which 2 tensor-parallel ranks",
    ),
    (  # FSDP wraps the model over one rank only to offload it to the CPU
        [*NF4_SHAPE, QLORA, "strategy=fsdp", "strategy.cpu_offload=true"],
        "model.lora.quantize_base: stores the base in NF4, which strategy=fsdp cannot shard over one data-parallel",
    ),
    # A mixture of experts: its routing, and layouts it has no plan for
    (
        ["model=moe", QLORA.replace("[q,v,up]", "[q,v]")],
        "model.lora.quantize_base: stores the blocks' Linear weights in NF4, but most of MoE's",
    ),
    (["model=moe", "model.net.experts_per_token=5"], "model.net.experts_per_token: is 5, more than the 4 experts"),
    (["model=moe", "model.net.router_scores=relu"], "model.net.router_scores: is 'relu'. Fix: choose one of"),
    (["model=moe", "model.net.first_dense_layers=3"], "model.net.first_dense_layers: is 3, outside 0 to the 2"),
    (
        ["model=moe", "strategy=tensor_parallel", "trainer.devices=2"],
        "strategy.tensor_parallel_size: is 2, but MoE has no tensor-parallel plan",
    ),
    (
        ["model=moe", "strategy=fsdp", "trainer.devices=3", "strategy.expert_parallel_size=3"],
        "strategy.expert_parallel_size: is 3, which does not divide the 4 experts (model.net.num_experts). Fix: use a",
    ),
    (
        ["model=moe", "strategy=fsdp", "trainer.devices=2", "strategy.expert_parallel_size=4"],
        "strategy.expert_parallel_size: is 4, but the 2 data-parallel ranks do not divide into groups of 4",
    ),
    (
        ["model=gpt", "strategy=fsdp", "trainer.devices=2", "strategy.expert_parallel_size=2"],
        "strategy.expert_parallel_size: is 2, but GPT has no mixture of experts to split.",
    ),
    (
        ["model=moe", "strategy=fsdp", "trainer.devices=2", "strategy.expert_parallel_size=2"]
        + ["model.activation_checkpointing=selective"],
        "model.activation_checkpointing: is selective, which experts split over ranks",
    ),
    (
        ["model=moe", "strategy=pipeline", "trainer.devices=4", "strategy.num_stages=2"]
        + ["strategy.expert_parallel_size=4"],
        "strategy.expert_parallel_size: is 4, but the 2 data-parallel ranks do not divide into groups of 4",
    ),
    (
        ["model=moe", "strategy=pipeline", "trainer.devices=2", "model.net.load_balancing_weight=0.01"],
        "model.net.load_balancing_weight: is not 0, but a pipeline's stages cannot add",
    ),
    (
        ["model=moe", "data=tokens", "model.net.load_balancing_weight=-1"],
        "model.net.load_balancing_weight: must be a number of at least 0, got -1",
    ),
    (  # expert parallelism is fsdp's
        ["model=moe", "strategy=ddp", "trainer.devices=2", "strategy.expert_parallel_size=2"],
        "strategy.expert_parallel_size: is not a key of strategy (its keys are",
    ),
    # Float8: not with LoRA, or GPUs (planned for) without float8 tensor cores
    (
        ["model=llama", "model.float8.enabled=true", "model.lora.rank=4", "model.lora.targets=[q]"],
        "model.float8.enabled: is true with LoRA adapters (model.lora)",
    ),
    (
        ["model=llama", "model.float8.enabled=true", "plan=true", "cluster=a100_80g_8x"],
        "model.float8.enabled: is true, but cluster=a100_80g_8x's GPUs have no float8 tensor cores",
    ),
    (["model=llama", "model.float8.recipe=blockwise"], "model.float8.recipe: must be one of 'tensorwise', 'rowwise'"),
    # The fused loss needs the output layer whole in the rank's own model: not a pipeline's, nor a vocabulary split
    (
        ["model=gpt", "data=tokens", "strategy=pipeline", "trainer.devices=2", "model.fused_loss=true"],
        "model.fused_loss: is true under strategy=pipeline, whose ranks do not each run the whole model",
    ),
    (
        ["model=gpt", "data=tokens", "strategy=tensor_parallel", "trainer.devices=2", "model.fused_loss=true"],
        "model.fused_loss: is true under strategy=tensor_parallel, whose ranks do not each run the whole model",
    ),
    (["step_checks=sometimes"], "step_checks: must be one of 'auto', 'each_step', 'a_step_late', got 'sometimes'"),
    (
        ["model=qwen3", "data=chat", "model.init_from={files}/adapter", "data.path={files}/chat/hello.jsonl"],
        "model.init_from: {files}/adapter is a peft adapter dir (adapter_config.json): it holds LoRA adapters, not a "
        "model's weights. Fix: give the model dir the adapters were trained on as model.init_from (its "
        "adapter_config.json names /models/base)",
    ),
    (
        ["model=gpt", "model.float8=true"],
        "model.float8: is true, where the node of the model option Float8Training goes. Fix: set its keys instead: "
        "model.float8.<key>=..., with <key> one of enabled, recipe, small_layers.",
    ),
    (["step_checks=null"], "step_checks: is null. Fix: set it to one of auto | each_step | a_step_late."),
    (["ckpt_path="], "ckpt_path: is empty. Fix: give ckpt_path=null to start from scratch, auto or last to resume"),
    (["model=llama", "model.init_from={files}/nothing"], "model.init_from: {files}/nothing is not a directory"),
    (["model=llama", "model.init_from={files}/a_dir"], "model.init_from: {files}/a_dir holds no config.json"),
    (  # a Qwen 3 dir under model=qwen2: the same net class, another family (its norms, not Qwen 2's biases)
        ["model=qwen2", "model.init_from={files}/chat/model"],
        "model.init_from: is a qwen3 model (qkv_bias false), but model.net computes another family's (qkv_bias true)",
    ),
    # Conversations: a bad record is named by its file and line, before any worker starts
    (
        ["model=qwen3", "data=chat", "model.init_from={files}/chat/model", "data.path={files}/bad_chat.jsonl"],
        "data.path: {files}/bad_chat.jsonl:2: message 0 has no role",
    ),
    (
        ["model=qwen3", "data=chat", "model.init_from={files}/chat/model", "data.path={files}/latin1_chat.jsonl"],
        "data.path: {files}/latin1_chat.jsonl:2: byte 47 of the line is not UTF-8",
    ),
    (
        ["model=qwen3", "data=chat", "model.init_from={files}/chat-bad-template", "data.path={files}/chat/hello.jsonl"],
        "data.tokenizer: {files}/chat-bad-template/chat_template.jinja, line 2: the chat template does not parse",
    ),
    (
        ["model=qwen3", "data=chat", "data.path={files}/bad_chat.jsonl"],
        "data.tokenizer: is null: with no model.init_from",
    ),
    # Preference pairs and DPO: a bad pair named by its file and line, a job that cannot train pairs refused
    (
        [*DPO, "data.path={files}/pair_without_chosen.jsonl"],
        "data.path: {files}/pair_without_chosen.jsonl:2: has no chosen (its keys: ['prompt', 'rejected'])",
    ),
    (
        [*DPO, "data.path={files}/pair_with_empty_response.jsonl"],
        "data.path: {files}/pair_with_empty_response.jsonl:2: has an empty rejected response",
    ),
    (
        [*DPO, "data.path={files}/pair_with_blank_response.jsonl"],
        "data.path: {files}/pair_with_blank_response.jsonl:2: has a blank (whitespace only) chosen response",
    ),
    (
        [*DPO, "data.path={files}/chat/preference.jsonl", "model.dpo=null"],
        "model.dpo: is null, which project.tasks.dpo.DPOModule does not take. Fix: give model.dpo a value",
    ),
    (
        [*DPO, "data.path={files}/chat/preference.jsonl", "data.seq_length=4"],
        "data.path: {files}/chat/preference.jsonl:1: the prompt leaves no token of the chosen response within "
        "data.seq_length + 1 = 5 tokens",
    ),
    (
        [*DPO, "data=chat", "data.path={files}/chat/hello.jsonl"],
        "data: is ChatDataModule, but experiment=dpo trains on preference pairs",
    ),
    (
        [*DPO[1:], "data.path={files}/chat/preference.jsonl"],
        "data: is preference pairs, which LanguageModelModule cannot train on: they are for DPO",
    ),
    (
        [*DPO, "data.path={files}/chat/preference.jsonl", "model.lora.rank=4", "model.lora.dropout=0.1"],
        "model.lora.dropout: is 0.1, but DPO's reference is the model before its first step, computed without dropout",
    ),
    (
        [*DPO[:2], "model=moe", *DPO[3:], "data.path={files}/chat/preference.jsonl", "model.net.capacity_factor=1.25"],
        "model.net.capacity_factor: is 1.25: in training an expert drops the assignments past its capacity",
    ),
    (
        [
            *DPO,
            "data.path={files}/chat/preference.jsonl",
            "mode=eval",
            "model.init_from={files}/chat/model",
            "model.net.dim=128",
        ],
        "ckpt_path: is null, but mode=eval of DPO compares the model with its reference",
    ),
    (
        [*DPO, "data.path={files}/chat/preference.jsonl", "model.fused_loss=true"],
        "model.fused_loss: is true, but DPO needs each sequence's log-probability",
    ),
    (
        [*DPO, "data.path={files}/chat/preference.jsonl", "model.dpo.loss_type=hinge"],
        "model.dpo.loss_type: must be one of 'sigmoid', 'ipo', got 'hinge'",
    ),
    (
        [*DPO, "data.path={files}/chat/preference.jsonl", "model.dpo.beta=0"],
        "model.dpo.beta: must be a positive number, got 0",
    ),
    # GRPO: its prompts, its reward functions (each called once before launch), its keys
    (
        [*GRPO_HELLO[:-2], "data.path={files}/prompts_not_json.jsonl", GRPO_HELLO[-1]],
        "data.path: {files}/prompts_not_json.jsonl:2: is not JSON",
    ),
    (
        [*GRPO_HELLO[:-2], "data.path={files}/prompt_missing.jsonl", GRPO_HELLO[-1]],
        "data.path: {files}/prompt_missing.jsonl:2: has no prompt (its keys: ['question'])",
    ),
    (
        [*GRPO_HELLO[:-2], "data.path={files}/prompt_empty.jsonl", GRPO_HELLO[-1]],
        "data.path: {files}/prompt_empty.jsonl:2: has an empty prompt",
    ),
    (
        [*GRPO_HELLO, "data.seq_length=8"],
        "data.path: {files}/chat/prompts.jsonl:1: the prompt is ... tokens, which leaves no completion token within "
        "data.seq_length = 8",
    ),
    (
        [*GRPO_HELLO, "data.seq_length=24"],
        "model.grpo.max_completion_length: is 256, but {files}/chat/prompts.jsonl:",
    ),
    (
        [*GRPO_HELLO[:-1], "model.grpo.reward_functions=[{files}/nowhere.py:ahoy]"],
        "model.grpo.reward_functions: lists {files}/nowhere.py:ahoy, but {files}/nowhere.py is not a file",
    ),
    (
        [*GRPO_HELLO[:-1], "model.grpo.reward_functions=[{files}/chat/rewards.py:helo]"],
        "model.grpo.reward_functions: lists {files}/chat/rewards.py:helo, but {files}/chat/rewards.py has no helo. "
        "Fix: did you mean {files}/chat/rewards.py:hello?",
    ),
    (
        [*GRPO_HELLO[:-1], "model.grpo.reward_functions=[nowhere_module.ahoy]"],
        "model.grpo.reward_functions: lists nowhere_module.ahoy, but module nowhere_module does not import",
    ),
    (
        [*GRPO_HELLO[:-1], "model.grpo.reward_functions=[{files}/bad_rewards.py:threshold]"],
        "model.grpo.reward_functions: lists {files}/bad_rewards.py:threshold, which is a float, not a function",
    ),
    (
        [*GRPO_HELLO[:-1], "model.grpo.reward_functions=[{files}/bad_rewards.py:raises]"],
        "model.grpo.reward_functions: {files}/bad_rewards.py:raises raised ValueError: no reward today, when called "
        "before launch on {files}/chat/prompts.jsonl:1's prompt and an empty completion",
    ),
    (
        [*GRPO_HELLO[:-1], "model.grpo.reward_functions=[{files}/bad_rewards.py:too_few]"],
        "model.grpo.reward_functions: {files}/bad_rewards.py:too_few returned 0 scores for 1 completions",
    ),
    (
        [*GRPO_HELLO[:-1], "model.grpo.reward_functions=[{files}/bad_rewards.py:words]"],
        "model.grpo.reward_functions: {files}/bad_rewards.py:words returned 'good' for completion 0: a number or "
        "None is due",
    ),
    (
        [*GRPO_HELLO, "model.grpo.reward_weights=[1.0,2.0]"],
        "model.grpo.reward_weights: has 2 weights for 1 reward functions",
    ),
    (
        [*GRPO_HELLO, "strategy=tensor_parallel", "trainer.devices=2"],
        "strategy.sequence_parallel: is true, but GRPO's one-token passes cannot split their sequence",
    ),
    (
        [*GRPO_HELLO, "strategy=tensor_parallel", "trainer.devices=2", "strategy.sequence_parallel=false"],
        "strategy.loss_parallel: is true, but GRPO's one-token passes",
    ),
    (
        [*GRPO_HELLO, "strategy=pipeline", "trainer.devices=2", "model.net.tie_weights=false", "data.batch_size=4"],
        "strategy: is pipeline, whose ranks or devices hold stages of the model; GRPO draws completions",
    ),
    (
        [*GRPO_HELLO, "strategy=model_parallel", "trainer.devices=2", "model.net.tie_weights=false"],
        "strategy: is model_parallel, whose ranks or devices hold stages of the model; GRPO draws",
    ),
    (
        [*GRPO_HELLO, "model.grpo.loss_type=ppo"],
        "model.grpo.loss_type: must be one of 'grpo', 'dr_grpo', 'dapo', got 'ppo'",
    ),
    (
        [*GRPO_HELLO, "model.grpo.top_p=1.5"],
        "model.grpo.top_p: is 1.5, above 1",
    ),
    (
        [*GRPO_HELLO[:-2], "data=chat", "data.path={files}/chat/hello.jsonl", GRPO_HELLO[-1]],
        "data: is ChatDataModule, but experiment=grpo trains on prompts",
    ),
    (
        [*GRPO_HELLO[1:-1]],
        "data: is prompts alone, which LanguageModelModule cannot train on: they are for GRPO",
    ),
]
# Cases on TINY_GPT's language data, with their own model.
LM_MARKS = ("model=gpt", "model=llama", "model=qwen2", "model=qwen3", "model=moe")
IDS = [" ".join(overrides) for overrides, _ in CASES]

# The command-line tools: (tool, arguments, what the message must say). {out} is a path of the case's own, which
# must not exist afterwards; the other names are the train.py cases'.
CLI_CASES = [
    ("prepare", ["{files}/empty.txt", "--out", "{out}"], "inputs: hold no text."),
    ("prepare", ["/nonexistent", "--out", "{out}"], "inputs: /nonexistent does not exist."),
    ("prepare", ["{files}/random.ckpt", "--out", "{out}"], "inputs: {files}/random.ckpt is not text (not UTF-8"),
    ("prepare", ["{files}/loop", "--out", "{out}"], "inputs: {files}/loop is a link that loops or leads nowhere."),
    ("prepare", ["{files}/fifo", "--out", "{out}"], "inputs: {files}/fifo is not a regular file (a FIFO, a device)."),
    (
        "prepare",
        ["{files}/corpus", "--out", "{files}/corpus/out"],
        "--out: {files}/corpus/out is inside the input {files}/corpus: what it writes would be read as documents",
    ),
    (
        "prepare",
        ["{files}/prepared", "--out", "{out}"],
        "inputs: {files}/prepared is a corpus prepared already (its meta.json): its files are token shards, not text.",
    ),
    (
        "prepare",
        ["{files}/tiny.txt", "--out", "{out}"],
        "inputs: hold 1 document (1 piece of up to 65,536 characters), which give the train split none",
    ),
    ("prepare", ["{files}/notes.jsonl", "--out", "{out}", "--vocab-size", "10"], "--vocab-size: is 10, fewer than"),
    ("prepare", ["{files}/notes.jsonl", "--out", "{out}", "--val-fraction", "2"], "--val-fraction: is 2.0"),
    ("prepare", ["{files}/notes.jsonl", "--out", "{out}", "--shard-tokens", "0"], "--shard-tokens: is 0."),
    (
        "prepare",
        ["{files}/notes.jsonl", "--out", "{out}", "--tokenizer", "{files}/corpus.txt"],
        "--tokenizer: {files}/corpus.txt is not a tokenizer file Hugging Face tokenizers can read",
    ),
    (
        "prepare",
        ["{files}/notes.jsonl", "--out", "{files}/frozen/out"],
        "--out: {files}/frozen/out is not writable by this process",
    ),
    ("prepare", ["{files}/notes.jsonl", "--out", "{out}", "--text-key", "body"], "--text-key: is 'body', but line 1"),
    ("prepare", ["{files}/notes.jsonl", "--out", "{files}/shards"], "--out: {files}/shards holds a preparation"),
    (
        "prepare",
        ["{files}/notes.jsonl", "--out", "{out}", "--separator", "<nope>"],
        "--separator: '<nope>' is not a token of the BPE prepare trains",
    ),
    ("export", ["/nonexistent", "{out}"], "checkpoint: /nonexistent does not exist."),
    ("export", ["{files}/random.ckpt", "{out}"], "checkpoint: {files}/random.ckpt is not a checkpoint file"),
    ("export", ["{files}/a_dir", "{out}"], "checkpoint: {files}/a_dir is a directory, not a sharded checkpoint"),
    ("export", ["{mlp_ckpt}", "{out}"], "checkpoint: holds a model of class MLP; Hugging Face model dirs hold"),
    ("export", ["{files}/lonely.ckpt", "{out}"], "--config: is not given, and "),
    ("export", ["{mlp_ckpt}", "{out}", "--adapter"], "--adapter: the run trained no LoRA adapters"),
    ("export", ["{gpt_lora_ckpt}", "{files}/chat/model"], "out: {files}/chat/model holds files an export did not"),
    ("export", ["{gpt_lora_ckpt}", "/proc/exported"], "out: /proc/exported cannot be made in /proc: No such file"),
    (
        "export",
        ["{gpt_lora_ckpt}", "{out}", "--adapter"],
        "--adapter: writes Llama adapters; this run's model is a GPT",
    ),
    ("export", ["{mlp_ckpt}", "{out}", "--config", "{files}/nothing.yaml"], "--config: {files}/nothing.yaml does not"),
    ("generate", ["{files}/random.ckpt", "--prompt", "hi"], "checkpoint: {files}/random.ckpt is not a checkpoint"),
    ("generate", ["{mlp_ckpt}", "--prompt", "hi"], "checkpoint: is of a job whose data (project.data.synthetic."),
    ("generate", ["{mlp_ckpt}", "--prompt", "hi", "--config", "{files}/bad.yaml"], "--config: {files}/bad.yaml is not"),
    (
        "generate",
        ["{gpt_lora_ckpt}", "--prompt", "hi", "--chat"],
        "--chat: needs a data=chat or data=preference run; this one's data is",
    ),
    ("report", ["/nonexistent"], "paths: /nonexistent is not a directory."),
    ("report", ["{files}/a_dir"], "paths: {files}/a_dir holds no job with a result.json and config.yaml."),
    ("report", ["{mlp_job}", "--output", "{files}/a_dir"], "--output: {files}/a_dir is a directory."),
]
CLI_IDS = [f"{tool} {' '.join(arguments)}" for tool, arguments, _ in CLI_CASES]

# Legal and almost surely not meant: (overrides, the one-line warning). Each runs with plan=true (checked and planned,
# nothing trained), which must succeed; the same checks run before every launch.
NOTICES = [
    (
        ["model=gpt", "model.lora.rank=4096"],
        "model.lora.rank=4096 is above the width of ... layers it adapts (the narrowest: 32, the smaller of its input "
        "and output): such a layer's update has rank 32 at most ... Use model.lora.rank=32 or less",
    ),
    (
        ["model=gpt", "model.lora.targets=[q,k,v]", "model.lora.alpha=32"],
        "model.lora.rank is 0: no adapters, so model.lora.alpha, model.lora.targets do nothing and every weight "
        "trains. Give the adapters a rank (model.lora.rank=16) for LoRA.",
    ),
    (
        [*DPO, "data.path={files}/chat/preference.jsonl", "trainer.precision=bf16-true"],
        "trainer.precision=bf16-true keeps the weights in bfloat16 (8 significant bits), where an Adam step of about "
        "the learning rate (model.optimizer.lr=1e-06) rounds away on every weight larger than 5.1e-04 in size ... "
        "Use trainer.precision=bf16-mixed (float32 weights, bfloat16 matmuls), or a learning rate of 2e-05 or more.",
    ),
]
NOTICE_IDS = [f"notice {' '.join(overrides)}" for overrides, _ in NOTICES]


def fill(text: str, names: dict) -> str:
    for name, value in names.items():
        text = text.replace("{" + name + "}", str(value))
    return text


@pytest.fixture(scope="module")
def invocations(tmp_path_factory, home, single_run, ddp_fsdp_sweep, gpt_lora_auto):
    """Every case run once, each with a job dir and a launch dir of its own; returns
    ``{id: (result, job dir, launch dir, names)}``."""
    root = tmp_path_factory.mktemp("bad-input")
    files = root / "files"
    (files / "a_dir").mkdir(parents=True)
    (files / "a_file").write_text("not a dir")
    (files / "empty.txt").write_text("")
    (files / "bad.yaml").write_text("data: [1, 2")
    (files / "tiny.txt").write_text("hello world")
    (files / "random.ckpt").write_bytes(random.Random(0).randbytes(5000))
    (files / "loop").symlink_to(files / "loop")
    os.mkfifo(files / "fifo")
    (files / "corpus.txt").write_text("the cat sat on the mat. " * 800)  # 19200 bytes
    # A prepared corpus of a few shards, and copies of it broken in the ways a disk or a copy breaks them.
    documents = [json.dumps({"text": f"Note {i}: the cat sat on the mat. " * (1 + i % 5)}) for i in range(200)]
    (files / "notes.jsonl").write_text("\n".join(documents) + "\n")
    prepare([files / "notes.jsonl"], files / "shards", vocab_size=300, shard_tokens=1000, val_fraction=0.1)
    for broken in ("missing", "cut", "bad-tokenizer"):
        shutil.copytree(files / "shards", files / f"shards-{broken}")
    (files / "shards-missing" / "train_000001.bin").unlink()
    with open(files / "shards-cut" / "train_000000.bin", "r+b") as shard:
        shard.truncate(2024)  # the header and 500 of its 1000 uint16 tokens
    (files / "shards-bad-tokenizer" / "tokenizer.json").write_text("not a tokenizer")
    write_example(files / "chat", count=16)  # a chat model dir (its tokenizer and template)
    good = (files / "chat" / "hello.jsonl").read_text().splitlines()[0]
    (files / "bad_chat.jsonl").write_text(good + '\n{"messages": [{"content": "hi"}]}\n')
    latin1 = '{"messages": [{"role": "user", "content": "caf\u00e9"}]}'.encode("latin-1")
    (files / "latin1_chat.jsonl").write_bytes(good.encode() + b"\n" + latin1 + b"\n")
    good_pair = (files / "chat" / "preference.jsonl").read_text().splitlines()[1]  # a plain-text pair
    without_chosen = {key: value for key, value in json.loads(good_pair).items() if key != "chosen"}
    (files / "pair_without_chosen.jsonl").write_text(good_pair + "\n" + json.dumps(without_chosen) + "\n")
    empty_response = {**json.loads(good_pair), "rejected": ""}
    (files / "pair_with_empty_response.jsonl").write_text(good_pair + "\n" + json.dumps(empty_response) + "\n")
    (files / "adapter").mkdir()  # a peft adapter dir, as export --adapter writes one
    (files / "adapter" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/models/base"}))
    (files / "corpus").mkdir()
    (files / "corpus" / "a.txt").write_text("the quick brown fox " * 50)
    (files / "prepared").mkdir()  # what prepare leaves (its shards aside)
    (files / "prepared" / "meta.json").write_text("{}")
    (files / "prepared" / "tokenizer.json").write_text("{}")
    blank_response = {**json.loads(good_pair), "chosen": " \n "}
    (files / "pair_with_blank_response.jsonl").write_text(good_pair + "\n" + json.dumps(blank_response) + "\n")
    good_prompt = (files / "chat" / "prompts.jsonl").read_text().splitlines()[0]
    (files / "prompts_not_json.jsonl").write_text(good_prompt + "\n{not json\n")
    (files / "prompt_missing.jsonl").write_text(good_prompt + '\n{"question": "Greet Ada."}\n')
    (files / "prompt_empty.jsonl").write_text(good_prompt + '\n{"prompt": ""}\n')
    (files / "bad_rewards.py").write_text(
        "threshold = 0.5\n\n\ndef raises(completions, **kwargs):\n    raise ValueError('no reward today')\n\n\n"
        "def too_few(completions, **kwargs):\n    return []\n\n\ndef words(completions, **kwargs):\n"
        "    return ['good' for _ in completions]\n"
    )
    shutil.copytree(files / "chat" / "model", files / "chat-bad-template")
    (files / "chat-bad-template" / "chat_template.jinja").write_text("{% for message in messages %}\n{% if %}")
    (files / "frozen").mkdir()
    freeze(files / "frozen")  # unwritable, for root too
    names = {
        "files": files,
        "mlp_job": single_run,
        "mlp_ckpt": single_run / "checkpoints" / "last.ckpt",
        "fsdp_ckpt": ddp_fsdp_sweep[1] / "checkpoints" / "last.ckpt",
        "gpt_lora_ckpt": gpt_lora_auto / "checkpoints" / "last.ckpt",
    }
    shutil.copy(names["mlp_ckpt"], files / "lonely.ckpt")  # a checkpoint with no job dir around it
    cases, dirs = [], []
    for number, (overrides, _) in enumerate(
        CASES + [(["plan=true", *overrides], warning) for overrides, warning in NOTICES]
    ):
        overrides = [fill(item, names) for item in overrides]
        language_model = any(mark in overrides for mark in LM_MARKS)
        base = [item for item in TINY_GPT if item != "model=gpt"] if language_model else TINY
        if any(
            f"data={name}" in overrides for name in ("text", "shards", "chat", "preference", "prompts")
        ):  # their own data
            base = [item for item in base if not item.startswith(("data=", "data.vocab", "data.seq", "data.num"))]
        job_dir, launch_dir = (
            root / "jobs" / str(number),
            root / "launch" / str(number),
        )  # nothing may land in the latter
        launch_dir.mkdir(parents=True)
        # A case's own hydra.run.dir comes last, so it wins.
        cases.append({"args": [*base, f"hydra.run.dir={job_dir}", *overrides], "cwd": str(launch_dir)})
        dirs.append((job_dir, launch_dir))
    for number, (tool, arguments, _) in enumerate(CLI_CASES):
        out = root / "cli-out" / str(number)  # nothing may land there
        tool_names = {**names, "out": out}
        cases.append(
            {
                "program": ["-m", f"project.cli.{tool}"],
                "args": [fill(item, tool_names) for item in arguments],
                "cwd": str(REPO),
            }
        )
        dirs.append((out, None))
    try:
        results = run_all(train_server(home), cases, root / "output")
    finally:
        thaw(files / "frozen")
    ids = IDS + NOTICE_IDS + CLI_IDS
    return {id: (result, *where, names) for id, result, where in zip(ids, results, dirs, strict=True)}


def run_all(server, cases: list[dict], output: Path) -> list[dict]:
    """Every case as ``python train.py`` (or its ``program``) in its own dir, as many at once as there are cores
    (each is a short CPU-bound process); ``{"exit_code", "stdout", "stderr"}`` per case, in order."""
    output.mkdir()
    files = [(output / f"{number}.out", output / f"{number}.err") for number in range(len(cases))]
    results: list[dict | None] = [None] * len(cases)
    running: dict[int, int] = {}  # pid: case number
    pending = list(enumerate(cases))
    while pending or running:
        while pending and len(running) < len(os.sched_getaffinity(0)):
            number, case = pending.pop(0)
            program = case.get("program", TRAIN)
            running[server.start(case["args"], case["cwd"], *files[number], program)] = number
        ended = server.wait(timeout=300)
        assert ended is not None, f"cases {sorted(running.values())} still running after 300 s"
        number = running.pop(ended[0])
        results[number] = {
            "exit_code": ended[1],
            "stdout": files[number][0].read_text(),
            "stderr": files[number][1].read_text(),
        }
    return results


def test_the_table_is_large_and_every_case_distinct():
    assert len(CASES) >= 40 and len(set(IDS)) == len(IDS)


@pytest.mark.parametrize("overrides,message", CASES, ids=IDS)
def test_bad_input_fails_fast_with_a_clear_message(overrides, message, invocations):
    result, job_dir, launch_dir, names = invocations[" ".join(overrides)]
    message = fill(message, names)
    stderr = result["stderr"]
    assert result["exit_code"] == 1, stderr[-3000:]
    parts = message.split(" ... ")
    assert all(part in stderr for part in parts), stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    if "Config error:" in stderr:  # ours: one paragraph, the key first, then the problem and the fix
        assert stderr.strip().splitlines()[-1].startswith(f"Config error: {parts[0]}") and "Fix:" in stderr
    # Nothing started: no worker processes (their launcher dir), no W&B run, no checkpoint, no config record.
    for where in (job_dir, launch_dir):
        assert not (where / "workers").exists() and not (where / "wandb").exists()
        assert not (where / "checkpoints").exists() and not (where / "config.yaml").exists()
    assert not any(launch_dir.iterdir())


@pytest.mark.parametrize("overrides,warning", NOTICES, ids=NOTICE_IDS)
def test_a_setting_legal_but_almost_surely_not_meant_is_said_in_one_line(overrides, warning, invocations):
    result, job_dir, _, names = invocations[f"notice {' '.join(overrides)}"]
    output = result["stdout"] + result["stderr"]
    assert result["exit_code"] == 0, output[-3000:]
    lines = [line for line in output.splitlines() if warning.split(" ... ")[0] in line]
    assert len(lines) == 1 and all(part in lines[0] for part in fill(warning, names).split(" ... ")), output[-3000:]


def test_the_tools_table_is_large_and_every_case_distinct():
    assert {tool for tool, _, _ in CLI_CASES} == {"prepare", "export", "generate", "report"}
    assert len(set(CLI_IDS)) == len(CLI_IDS)


@pytest.mark.parametrize("tool,arguments,message", CLI_CASES, ids=CLI_IDS)
def test_bad_arguments_to_a_tool_fail_with_a_clear_message_and_write_nothing(tool, arguments, message, invocations):
    result, out, _, names = invocations[f"{tool} {' '.join(arguments)}"]
    message, stderr = fill(message, names), result["stderr"]
    assert result["exit_code"] == 1 and "Traceback" not in stderr, stderr[-3000:]
    # One paragraph, the tool first, then the argument, the problem and the fix.
    assert stderr.strip().splitlines() == [stderr.strip()], stderr[-3000:]
    assert stderr.startswith(f"python -m project.cli.{tool}: {message}") and " Fix: " in stderr, stderr[-3000:]
    assert not out.exists()


def test_a_failing_worker_stops_the_job_with_a_clear_message(home, tmp_path):
    """A failure inside the workers (past the checks) ends all of them and says which rank failed and how."""
    job_dir = tmp_path / "job"
    result = train(
        [
            *TINY,
            f"hydra.run.dir={job_dir}",
            "strategy=ddp",
            "trainer.devices=2",
            "+callbacks.fail._target_=helpers.probes.FailInFit",
        ],
        home,
        expect_ok=False,
        timeout=120,
    )
    assert result.returncode == 1
    report = f" raised ValueError: a failure in fit, on rank {{rank}} (its traceback is in {job_dir / 'train.log'})."
    assert "Training failed in the workers:\n- rank " in result.output and "All 2 workers were stopped" in result.output
    assert all(f"- rank {rank}{report.format(rank=rank)}" in result.output for rank in (0, 1)), result.output[-3000:]
    # The console holds the report, not the workers' tracebacks, nor torchelastic's lines on the same failures.
    assert "Traceback" not in result.output and "failed (exitcode" not in result.output, result.output[-3000:]
    assert only_run(job_dir).exit_code == 1  # the W&B run rank 0 had opened is closed as failed
    # The job's log holds both workers' records, their tracebacks and the launcher's report.
    log = (job_dir / "train.log").read_text()
    assert "[rank 0][lightning.pytorch.utilities.rank_zero][INFO] - GPU available: False" in log
    for rank in (0, 1):
        assert (
            f"[rank {rank}][project.launch.worker.file][ERROR] - Rank {rank} failed\nTraceback (most recent call last)"
            in log
        )
    assert "[project.launch.launcher][ERROR] - Training failed in the workers:" in log and report.format(rank=0) in log


def train_in_env(args: list[str], home: Path, **variables: str) -> subprocess.CompletedProcess:
    """``python train.py <args>`` in its own process (not forked: the environment is read at imports), with
    ``variables`` added to the tests' isolated environment."""
    from conftest import isolated_env

    env = {**isolated_env(home), **variables}
    command = [sys.executable, "train.py", *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("threads", ["0", "abc"])
def test_a_thread_count_that_is_not_one_is_refused_before_launch(threads, home, tmp_path):
    """``OMP_NUM_THREADS`` that libgomp would ignore (warning alone) would also skip the project's split of the
    cores: refused, naming the variable, before anything is trained."""
    job_dir = tmp_path / "job"
    result = train_in_env([*TINY, f"hydra.run.dir={job_dir}"], home, OMP_NUM_THREADS=threads)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert (
        f"Config error: OMP_NUM_THREADS: is '{threads}' in the environment, not a number of threads. Fix: unset it"
    ) in result.stderr
    assert not (job_dir / "checkpoints").exists()


def test_a_rank_left_in_the_environment_of_a_plain_run_is_ignored_and_said(home, tmp_path):
    """``RANK=1`` left by a shell that ran a distributed job made Lightning's rank-zero-only logger write nothing
    (no ``csv/``); a plain run is rank 0 and says what it ignored."""
    job_dir = tmp_path / "job"
    result = train_in_env([*TINY, f"hydra.run.dir={job_dir}", "logger=csv"], home, RANK="1", LOCAL_RANK="1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Ignoring RANK=1 LOCAL_RANK=1 in the environment: this run is no rank of a job torchrun started." in (
        result.stdout + result.stderr
    )
    assert (job_dir / "csv" / "version_0" / "metrics.csv").is_file()
