"""Bad input: a one-paragraph error naming the key and the fix, exit code != 0, before any worker or W&B run."""

import pytest

from conftest import TINY, TINY_GPT, only_run, train
from project.errors import ConfigError
from project.launch import checked_job_config
from test_config import compose_train

BAD_INPUTS = [
    (["trainer.devices=0"], "trainer.devices: must be a positive integer, got 0"),
    (["strategy=ddp", "trainer.devices=-2"], "trainer.devices: must be a positive integer, got -2"),
    (["data.batch_size=0"], "data.batch_size: must be a positive integer, got 0"),
    (["strategy=ddp", "trainer.devices=2", "data.batch_size=-1"], "data.batch_size: must be a positive integer"),
    (["trainer.accelerator=gpu", "trainer.devices=2"], "trainer.accelerator: is 'gpu' but this machine has no CUDA GPU"),
    (["ckpt_path=/nonexistent/model.ckpt"], "ckpt_path: /nonexistent/model.ckpt does not exist"),
    (["ckpt_path=last"], "ckpt_path=last resumes the run dir given by hydra.run.dir"),
    (["strategy=ddp", "trainer.devices=2", "data.batch_size=600"], "data.batch_size: gives a global batch of 600 x 2"),
    (["strategy=ddp", "trainer.devices=4", "data.num_val=3"], "data.num_val: gives 3 validation samples"),
    (["strategy=ddp", "trainer.devices=2", "trainer.num_nodes=2"], "trainer.num_nodes: is more than 1"),
    (["trainer.precision=16-mixed"], "trainer.precision: is '16-mixed', but float16 training needs a CUDA GPU"),
    (
        ["strategy=fsdp", "trainer.devices=2", "strategy.cpu_offload=true"],
        "strategy.cpu_offload: moves parameter shards from GPU to CPU memory, but this run has no GPU",
    ),
    (["strategy=model_parallel", "trainer.devices=4"], "strategy.num_stages: cannot split the model: 4 stages"),
    (
        ["strategy=pipeline", "trainer.devices=2", "strategy.blocks_per_stage=[1,1]"],
        "strategy.blocks_per_stage: cannot split the model",
    ),
    (
        ["strategy=pipeline", "trainer.devices=2", "data.batch_size=30", "strategy.microbatches=4"],
        "strategy.microbatches: is 4, which does not divide data.batch_size=30",
    ),
    (
        ["strategy=pipeline", "trainer.devices=2", "strategy.microbatches=1"],
        "strategy.microbatches: is 1, fewer than the 2 pipeline ranks",
    ),
    (
        ["strategy=pipeline", "trainer.devices=3", "strategy.num_stages=2"],
        "trainer.devices: gives 3 processes, not a multiple of the 2 ranks one pipeline needs",
    ),
    (["strategy=fsdp", "trainer.devices=2", "trainer.precision=64"], "trainer.precision: is '64-true', which Lightning's"),
    (["trainer.precision=17"], "trainer.precision: Precision 17 is invalid"),
    (["model.net._target_=no.such.Model"], "model.net: cannot be built: Error locating target 'no.such.Model'"),
    (["model.no_weight_decay=[bias,layernorm]"], "model.no_weight_decay: names ['layernorm'], which are not parameter"),
    (
        ["model.scheduler={_target_:torch.optim.lr_scheduler.StepLR,_partial_:true,step_size:10}"],
        "model.scheduler: cannot be built as factory(optimizer, run_steps=...)",
    ),
]
CASES = [
    *[(TINY, *case) for case in BAD_INPUTS],
    (TINY_GPT, ["model.scheduler.warmup_steps=10"], "model.scheduler.warmup_fraction: is 0.08 while model.scheduler.warmup_steps"),
    ([], ["model=gpt", "data=text", "data.path=corpus.txt"], "data.path: corpus.txt is not a file"),  # README's example
]
IDS = [" ".join(overrides) for _, overrides, _ in CASES]


@pytest.mark.parametrize("base,overrides,message", CASES, ids=IDS)
def test_bad_input_is_a_config_error(base, overrides, message):
    """What ``python train.py <overrides>`` checks before anything starts, in this process: every case."""
    cfg = compose_train([*base, *overrides])
    del cfg.hydra
    with pytest.raises(ConfigError) as error:
        checked_job_config(cfg, torchrun=False)
    assert message in str(error.value) and "Fix:" in str(error.value)


# One case of each kind of rule, through a real `python train.py`: the config, the launcher, a strategy, the
# LightningModule, the data module.
END_TO_END = ["trainer.devices=0", "strategy=ddp trainer.devices=2 trainer.num_nodes=2",
              "strategy=pipeline trainer.devices=2 strategy.microbatches=1", "model.scheduler.warmup_steps=10",
              "model=gpt data=text data.path=corpus.txt"]


@pytest.mark.parametrize("base,overrides,message", [case for case, id in zip(CASES, IDS) if id in END_TO_END],
                         ids=END_TO_END)
def test_bad_input_fails_fast_with_a_clear_message(base, overrides, message, home, tmp_path):
    job_dir = tmp_path / "job"
    result = train([*base, f"hydra.run.dir={job_dir}", *overrides], home, expect_ok=False, timeout=60)
    assert result.returncode == 1
    assert f"Config error: {message}" in result.stderr
    assert "Fix:" in result.stderr and "Traceback" not in result.stderr
    # Nothing started: no worker processes (their launcher dir), no W&B run, no checkpoint.
    assert not (job_dir / "workers").exists()
    assert not (job_dir / "wandb").exists()
    assert not (job_dir / "checkpoints").exists()


def test_a_failing_worker_stops_the_job_with_a_clear_message(home, tmp_path):
    """A failure inside the workers (past the checks) ends all of them and says which rank failed."""
    job_dir = tmp_path / "job"
    result = train(
        # Lightning refuses this inside fit, in the workers (it needs the number of batches, which the checks lack).
        [*TINY, f"hydra.run.dir={job_dir}", "strategy=ddp", "trainer.devices=2", "+trainer.val_check_interval=1000"],
        home,
        expect_ok=False,
        timeout=120,
    )
    assert result.returncode != 0
    assert "Training failed in worker rank" in result.stderr and "All 2 workers were stopped" in result.stderr
    assert "val_check_interval" in result.output  # the worker's own traceback is shown
    assert only_run(job_dir).exit_code == 1  # the W&B run rank 0 had opened is closed as failed
