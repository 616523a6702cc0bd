"""strategy=model_parallel and strategy=pipeline: the numbers of one device, 1/stages of the model per device,
checkpoints, and clear errors for splits that cannot work."""

import pytest
from conftest import (
    COUNTED,
    LOSS_KEYS,
    TINY,
    assert_close,
    assert_epoch_metrics,
    assert_matches_reference,
    only_run,
    train,
)
from test_step_counts import assert_collectives_as_planned

from project.checkpointing.files import is_sharded_checkpoint
from project.parallel.parallelize import split_blocks

pytestmark = pytest.mark.torch_internals

BATCH_64 = ["data.batch_size=64"]  # the single_run's global batch, one replica


def test_balanced_split_minimises_the_largest_stage():
    assert split_blocks([50_005_000, 5_001_000, 10_010], 2) == [range(0, 1), range(1, 3)]  # seed 000's LargeModel
    assert split_blocks([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    assert split_blocks([4, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 5)]
    assert split_blocks([5, 5, 5], 2, blocks_per_stage=[1, 2]) == [range(0, 1), range(1, 3)]
    with pytest.raises(ValueError, match="3 stages need at least 3 blocks"):
        split_blocks([1, 1], 3)
    with pytest.raises(ValueError, match="cover all 3 blocks"):
        split_blocks([1, 1, 1], 2, blocks_per_stage=[1, 1])


@pytest.mark.slow
def test_model_parallel_three_stages_and_its_plain_checkpoint(model_parallel_run, reference, runs_dir, home):
    job_dir = runs_dir / "model-parallel-3"
    train([*TINY, *BATCH_64, f"hydra.run.dir={job_dir}", "strategy=model_parallel", "trainer.devices=3"], home)
    run = only_run(job_dir)
    assert run.name == "mlp-model_parallel-3dev-1node"
    assert_epoch_metrics(run, epochs=3)
    assert_matches_reference(run, reference([*TINY, *BATCH_64], 64).history)
    # A plain single-file checkpoint: strategy=auto resumes it as it is.
    resumed_dir = runs_dir / "model-parallel-to-auto"
    train(
        [
            *TINY,
            *BATCH_64,
            f"hydra.run.dir={resumed_dir}",
            "trainer.max_epochs=4",
            f"ckpt_path={model_parallel_run}/checkpoints/last.ckpt",
        ],
        home,
    )
    assert [row["epoch"] for row in only_run(resumed_dir).history if "val/loss" in row] == [3]


@pytest.mark.slow
def test_pipeline_sweep_runs_each_schedule(pipeline_sweep):
    for job_dir, schedule in zip(pipeline_sweep, ["gpipe", "1f1b"]):
        run = only_run(job_dir)
        assert run.config["strategy"]["schedule"] == schedule
        assert run.config["trainer"]["precision"] == 32  # Lightning's spelling of 32-true is accepted
        assert_epoch_metrics(run, epochs=3)  # metrics from the last stage reach rank 0's W&B run


# Two stages x two data-parallel shards (FSDP inside each stage), with gradient accumulation and clipping by norm.
PIPELINE_2X2 = [*TINY, "data.batch_size=32", "trainer.accumulate_grad_batches=2", "trainer.gradient_clip_val=0.3"]


@pytest.mark.slow
def test_pipeline_times_data_parallel_accumulates_clips_and_runs_lightning_hooks(reference, runs_dir, home):
    """Accumulation and clipping (by the norm of the whole model: both stages, both shards) give the hand-written
    loop's numbers; Lightning's backward hooks run once per batch and see the gradients; FSDP gathers each
    stage's parameters once per batch, not once per micro-batch, and moves the bytes its memory plan predicts."""
    job_dir = runs_dir / "pipeline-2x2"
    result = train(
        [
            *PIPELINE_2X2,
            f"hydra.run.dir={job_dir}",
            "strategy=pipeline",
            "trainer.devices=4",
            "strategy.num_stages=2",
            "+callbacks.hooks._target_=helpers.probes.BackwardHooks",
            "+callbacks.gathers._target_=helpers.probes.AllGatherCount",
            *COUNTED,
        ],
        home,
    )
    assert "Starting with 4 processes" in result.output
    assert_collectives_as_planned(job_dir)  # the plan's pipeline x FSDP collectives, link by link
    expected = reference(PIPELINE_2X2, 64)
    assert expected.clipped_steps > 0  # the threshold bites, so clipping is tested
    run = only_run(job_dir)
    assert_matches_reference(run, expected.history)
    batches = 1024 // 64
    assert run.series("probe/before_backward") == run.series("probe/after_backward") == [batches] * 3
    assert run.series("probe/params_with_grad") == [1.0] * 3
    # The fuller stage has 2 FSDP units (blocks 1 and 2); 4 micro-batches with resharding would gather 8 times each.
    assert run.series("probe/all_gathers_per_batch") == [2.0] * 3


@pytest.mark.slow
def test_pipeline_in_bf16(reference, runs_dir, home):
    """bf16-mixed: autocast around the schedule; within bf16's tolerance of the float32 loop, but not equal to it."""
    job_dir = runs_dir / "pipeline-bf16"
    train(
        [
            *TINY,
            *BATCH_64,
            f"hydra.run.dir={job_dir}",
            "strategy=pipeline",
            "trainer.devices=2",
            "trainer.precision=bf16-mixed",
        ],
        home,
    )
    expected = [row["val/loss"] for row in reference([*TINY, *BATCH_64], 64).history]
    got = only_run(job_dir).series("val/loss")
    assert got == pytest.approx(expected, rel=3e-2)
    assert max(abs(a - b) / b for a, b in zip(got, expected)) > 1e-4  # computed in bf16 indeed


# Four stages, two per rank, on a model whose four blocks have the same shapes (a swap would load silently).
DEEPER = [*TINY, *BATCH_64, "model.net.hidden_dims=[32,32,32]"]


@pytest.mark.slow
def test_interleaved_pipeline_and_its_consolidated_checkpoint(reference, runs_dir, home):
    """Interleaved 1F1B matches the hand-written loop; its sharded checkpoint, consolidated for one device,
    carries every momentum buffer to its own parameter: the next epoch on one device is the loop's next epoch."""
    expected = reference([*DEEPER, "trainer.max_epochs=3"], 64).history
    job_dir, continued_dir = runs_dir / "interleaved", runs_dir / "interleaved-to-auto"
    train(
        [
            *DEEPER,
            "trainer.max_epochs=2",
            f"hydra.run.dir={job_dir}",
            "strategy=pipeline",
            "trainer.devices=2",
            "strategy.schedule=interleaved_1f1b",
            "strategy.num_stages=4",
            "strategy.stages_per_rank=2",
            *COUNTED,
        ],
        home,
    )
    assert_matches_reference(only_run(job_dir), expected[:2])
    assert_collectives_as_planned(job_dir)  # each rank's sends between its two stages and the other rank's
    train(
        [
            *DEEPER,
            "trainer.max_epochs=3",
            f"hydra.run.dir={continued_dir}",
            f"ckpt_path={job_dir}/checkpoints/last.ckpt",
        ],
        home,
    )
    assert (continued_dir / "consolidated.ckpt").is_file()
    assert_matches_reference(only_run(continued_dir), expected[2:])


# A model whose blocks are all the same size, for one epoch.
EVEN = [*TINY, *BATCH_64, "data.num_features=64", "model.net.hidden_dims=[64,64,64,64]", "trainer.max_epochs=1"]


@pytest.fixture(scope="module")
def even_auto_run(runs_dir, home):
    job_dir = runs_dir / "even-auto"
    train([*EVEN, f"hydra.run.dir={job_dir}"], home)
    return job_dir


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["model_parallel", "pipeline"])
def test_each_device_holds_its_stage(strategy, even_auto_run, runs_dir, home):
    """With 2 stages of a model whose blocks are even, the fullest device holds about half of auto's model state."""
    job_dir = runs_dir / f"even-{strategy}"
    train([*EVEN, f"hydra.run.dir={job_dir}", f"strategy={strategy}", "trainer.devices=2"], home)
    auto_state = only_run(even_auto_run).series("memory/model_state_mb")[-1]
    stage_state = only_run(job_dir).series("memory/model_state_mb")[-1]
    assert 0.4 * auto_state < stage_state <= (1 / 2 + 0.1) * auto_state, (stage_state, auto_state)


@pytest.mark.slow
def test_pipeline_checkpoint_resumes_and_loads_into_one_device(pipeline_sweep, single_run, runs_dir, home):
    straight = only_run(pipeline_sweep[1])  # 1f1b, 3 epochs
    job_dir = runs_dir / "pipeline-resumed"
    common = [*TINY, *BATCH_64, "strategy=pipeline", "trainer.devices=2", f"hydra.run.dir={job_dir}"]
    train([*common, "trainer.max_epochs=2"], home)
    last = job_dir / "checkpoints" / "last.ckpt"
    assert is_sharded_checkpoint(last) and len(list(last.glob("*.distcp"))) == 2  # each stage saved its own blocks
    first_part = only_run(job_dir)
    first_part.path.rename(job_dir / "first-part")
    train([*common, "ckpt_path=last"], home)
    for key in LOSS_KEYS:
        assert_close(first_part.series(key) + only_run(job_dir).series(key), straight.series(key), rel=1e-6)
    auto_dir = runs_dir / "pipeline-to-auto"
    train([*TINY, *BATCH_64, "trainer.max_epochs=4", f"hydra.run.dir={auto_dir}", f"ckpt_path={last}"], home)
    continued = only_run(auto_dir)
    assert [row["epoch"] for row in continued.history if "val/loss" in row] == [3]
    assert continued.series("train/loss")[0] < only_run(single_run).series("train/loss")[-1]  # it went on learning
