"""Bad input: a one-paragraph error naming the key and the fix, exit code != 0, before any worker or W&B run."""

import pytest

from conftest import TINY, train

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
]


@pytest.mark.parametrize("overrides,message", BAD_INPUTS, ids=[" ".join(o) for o, _ in BAD_INPUTS])
def test_bad_input_fails_fast_with_a_clear_message(overrides, message, home, tmp_path):
    job_dir = tmp_path / "job"
    result = train([*TINY, f"hydra.run.dir={job_dir}", *overrides], home, expect_ok=False, timeout=60)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Fix:" in result.stderr and "Traceback" not in result.stderr
    # Nothing started: no worker processes (their launcher dir), no W&B run, no checkpoint.
    assert not (job_dir / "workers").exists()
    assert not (job_dir / "wandb").exists()
    assert not (job_dir / "checkpoints").exists()


def test_a_failing_worker_stops_the_job_with_a_clear_message(home, tmp_path):
    """A failure inside the workers (past the checks) ends all of them and says which rank failed."""
    job_dir = tmp_path / "job"
    result = train(
        [*TINY, f"hydra.run.dir={job_dir}", "strategy=ddp", "trainer.devices=2", "model.net._target_=no.such.Model"],
        home,
        expect_ok=False,
        timeout=120,
    )
    assert result.returncode != 0
    assert "Training failed in worker rank" in result.stderr and "All 2 workers were stopped" in result.stderr
    assert "no.such.Model" in result.output  # the worker's own traceback is shown
    assert not (job_dir / "wandb").exists()
