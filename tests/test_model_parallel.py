"""strategy=model_parallel and strategy=pipeline: the numbers of one device, 1/stages of the model per device,
checkpoints, and clear errors for splits that cannot work."""

import pytest

from conftest import LOSS_KEYS, TINY, assert_close, assert_epoch_metrics, only_run, train
from project.checkpoints import is_sharded_checkpoint
from project.parallel import split_blocks

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
@pytest.mark.parametrize("stages", [2, 3])
def test_model_parallel_gives_the_numbers_of_one_device(stages, single_run, runs_dir, home):
    job_dir = runs_dir / f"model-parallel-{stages}"
    train([*TINY, *BATCH_64, f"hydra.run.dir={job_dir}", "strategy=model_parallel", f"trainer.devices={stages}"], home)
    run, single = only_run(job_dir), only_run(single_run)
    assert run.name == f"mlp-model_parallel-{stages}dev"
    assert_epoch_metrics(run, epochs=3)
    for key in LOSS_KEYS:
        assert_close(run.series(key), single.series(key), rel=1e-4)
    # A plain single-file checkpoint: strategy=auto resumes it as it is.
    resumed_dir = runs_dir / f"model-parallel-{stages}-to-auto"
    train([*TINY, *BATCH_64, f"hydra.run.dir={resumed_dir}", "trainer.max_epochs=4",
           f"ckpt_path={job_dir}/checkpoints/last.ckpt"], home)
    assert [row["epoch"] for row in only_run(resumed_dir).history if "val/loss" in row] == [3]


@pytest.fixture(scope="session")
def pipeline_sweep(runs_dir, home):
    """`-m strategy=pipeline strategy.schedule=gpipe,1f1b trainer.devices=2`: jobs 0 and 1."""
    sweep_dir = runs_dir / "pipeline"
    train(["-m", *TINY, *BATCH_64, f"hydra.sweep.dir={sweep_dir}", "strategy=pipeline", "trainer.devices=2",
           "strategy.schedule=gpipe,1f1b"], home, timeout=400)
    return sweep_dir / "0", sweep_dir / "1"


@pytest.mark.slow
def test_pipeline_schedules_give_the_numbers_of_one_device(pipeline_sweep, single_run):
    single = only_run(single_run)
    for job_dir, schedule in zip(pipeline_sweep, ["gpipe", "1f1b"]):
        run = only_run(job_dir)
        assert run.config["strategy"]["schedule"] == schedule
        assert_epoch_metrics(run, epochs=3)  # metrics from the last stage reach rank 0's W&B run
        for key in LOSS_KEYS:
            assert_close(run.series(key), single.series(key), rel=1e-4)


@pytest.mark.slow
def test_pipeline_times_data_parallel_gives_the_numbers_of_one_device(single_run, runs_dir, home):
    job_dir = runs_dir / "pipeline-2x2"
    result = train([*TINY, "data.batch_size=32", f"hydra.run.dir={job_dir}", "strategy=pipeline", "trainer.devices=4",
                    "strategy.num_stages=2"], home)
    assert "Starting with 4 processes" in result.output
    run, single = only_run(job_dir), only_run(single_run)
    for key in LOSS_KEYS:
        assert_close(run.series(key), single.series(key), rel=1e-4)


@pytest.mark.slow
def test_interleaved_pipeline_matches_model_parallel(runs_dir, home):
    """Four stages, two per rank, on a four-block model; model_parallel (= one device) is the reference."""
    deeper = [*TINY, *BATCH_64, "model.net.hidden_dims=[64,32,32]", "trainer.max_epochs=2"]
    reference_dir, job_dir = runs_dir / "mp-4-blocks", runs_dir / "interleaved"
    train([*deeper, f"hydra.run.dir={reference_dir}", "strategy=model_parallel", "trainer.devices=4"], home)
    train([*deeper, f"hydra.run.dir={job_dir}", "strategy=pipeline", "trainer.devices=2",
           "strategy.schedule=interleaved_1f1b", "strategy.num_stages=4",
           "strategy.stages_per_rank=2"], home)
    for key in LOSS_KEYS:
        assert_close(only_run(job_dir).series(key), only_run(reference_dir).series(key), rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["model_parallel", "pipeline"])
def test_each_device_holds_its_stage(strategy, runs_dir, home):
    """With 2 stages of a model whose blocks are even, the fullest device holds about half of auto's model state."""
    even = [*TINY, *BATCH_64, "data.num_features=64", "model.net.hidden_dims=[64,64,64,64]", "trainer.max_epochs=1"]
    auto_dir, job_dir = runs_dir / f"even-auto-{strategy}", runs_dir / f"even-{strategy}"
    train([*even, f"hydra.run.dir={auto_dir}"], home)
    train([*even, f"hydra.run.dir={job_dir}", f"strategy={strategy}", "trainer.devices=2"], home)
    auto_state = only_run(auto_dir).series("memory/model_state_mb")[-1]
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
