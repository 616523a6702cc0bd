"""strategy=fsdp: the numbers of one device, 1/N of the model state per device, sharded checkpoints."""

import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import LOSS_KEYS, TINY, assert_close, assert_epoch_metrics, assert_matches_reference, only_run, train

from project.checkpointing.files import is_sharded_checkpoint
from project.strategies import FSDPStrategy

pytestmark = pytest.mark.torch_internals

TWO_DEVICES = ["trainer.devices=2", "data.batch_size=32"]  # the single_run's global batch of 64


@pytest.mark.slow
def test_fsdp_run_joins_its_sweep(ddp_fsdp_sweep):
    ddp, fsdp = (only_run(job) for job in ddp_fsdp_sweep)
    assert fsdp.name == "mlp-fsdp-2dev-1node" and fsdp.group == ddp.group
    assert_epoch_metrics(fsdp, epochs=3)


@pytest.mark.slow
def test_fsdp_holds_half_the_model_state_of_ddp_per_device(ddp_fsdp_sweep):
    ddp, fsdp = (only_run(job) for job in ddp_fsdp_sweep)
    for part in ["params", "grads", "optimizer"]:
        assert fsdp.series(f"memory/{part}_mb")[-1] > 0
    ddp_state, fsdp_state = ddp.series("memory/model_state_mb")[-1], fsdp.series("memory/model_state_mb")[-1]
    assert ddp_state > 0 and fsdp_state <= 0.55 * ddp_state, (fsdp_state, ddp_state)
    # DDP holds the whole model: params + grads + one momentum buffer, each the size of the model.
    num_params = (32 * 64 + 64) + (64 * 32 + 32) + (32 * 10 + 10)  # TINY's MLP 32 -> 64 -> 32 -> 10
    assert ddp_state == pytest.approx(3 * num_params * 4 / 2**20)


@pytest.mark.slow
def test_fsdp_options_keep_the_numbers(reference, runs_dir, home):
    """ZeRO-2-like resharding and activation checkpointing change memory and speed, not results (here with gradient
    accumulation and clipping by the norm of the sharded gradient); bf16 stays close."""
    clipped = ["trainer.accumulate_grad_batches=2", "trainer.gradient_clip_val=0.3"]
    expected = reference([*TINY, "data.batch_size=64", *clipped], 64)
    assert expected.clipped_steps > 0  # the threshold bites
    exact_dir, bf16_dir = runs_dir / "fsdp-zero2-ac", runs_dir / "fsdp-bf16"
    fsdp_args = [*TINY, *TWO_DEVICES, "strategy=fsdp"]
    train(
        [
            *fsdp_args,
            *clipped,
            f"hydra.run.dir={exact_dir}",
            "strategy.reshard_after_forward=false",
            "strategy.activation_checkpointing=true",
        ],
        home,
    )
    train(
        [
            *fsdp_args,
            f"hydra.run.dir={bf16_dir}",
            "trainer.precision=bf16-mixed",
            "strategy.save_distributed_checkpoint=false",
        ],
        home,
    )
    assert_matches_reference(only_run(exact_dir), expected.history)
    fp32 = [row["val/loss"] for row in reference([*TINY, "data.batch_size=64"], 64).history]
    assert_close(only_run(bf16_dir).series("val/loss"), fp32, rel=3e-2)
    assert (bf16_dir / "checkpoints" / "last.ckpt").is_file()  # one full file when not distributed


@pytest.mark.slow
def test_fsdp_over_one_rank_trains_unwrapped_with_the_loops_numbers_and_resumes_over_two(reference, runs_dir, home):
    """Over one data-parallel rank FSDP shards nothing: the model trains unwrapped (said in one line), with the
    hand-written loop's numbers, and its distributed checkpoint resumes under FSDP over 2 ranks."""
    job_dir = runs_dir / "fsdp-one-rank"
    one_rank = [*TINY, "data.batch_size=64", "strategy=fsdp", f"hydra.run.dir={job_dir}"]
    result = train([*one_rank, "trainer.devices=1"], home)
    assert "strategy=fsdp over one data-parallel rank: nothing to shard, so FSDP does not wrap" in result.output
    assert_matches_reference(only_run(job_dir), reference([*TINY, "data.batch_size=64"], 64).history)
    last = job_dir / "checkpoints" / "last.ckpt"
    assert is_sharded_checkpoint(last)
    resumed = runs_dir / "fsdp-one-rank-resumed"
    train(
        [*TINY, *TWO_DEVICES, "strategy=fsdp", "trainer.max_epochs=4", f"ckpt_path={last}", f"hydra.run.dir={resumed}"],
        home,
    )
    assert len(only_run(resumed).series("val/loss")) == 1  # the fourth epoch, from the third's weights


@pytest.mark.slow
def test_sharded_checkpoint_resumes_and_consolidates_into_one_device(ddp_fsdp_sweep, single_run, runs_dir, home):
    straight = only_run(ddp_fsdp_sweep[1])
    job_dir = runs_dir / "fsdp-resumed"
    common = [*TINY, *TWO_DEVICES, "strategy=fsdp", f"hydra.run.dir={job_dir}"]
    train([*common, "trainer.max_epochs=1"], home)
    last = job_dir / "checkpoints" / "last.ckpt"
    assert is_sharded_checkpoint(last) and len(list(last.glob("*.distcp"))) == 2  # one shard file per rank
    epoch_one = shutil.copytree(last, runs_dir / "fsdp-epoch-1.ckpt")
    first_part = only_run(job_dir)
    first_part.path.rename(job_dir / "first-part")
    train([*common, "ckpt_path=last"], home)  # resume to epoch 3
    resumed = only_run(job_dir)
    for key in LOSS_KEYS:
        assert_close(first_part.series(key) + resumed.series(key), straight.series(key), rel=1e-6)

    # The sharded checkpoint of epoch 1 into strategy=auto on one device: consolidated, then trained onwards
    # as if the whole run had been on one device.
    auto_dir = runs_dir / "fsdp-to-auto"
    train([*TINY, "data.batch_size=64", f"hydra.run.dir={auto_dir}", f"ckpt_path={epoch_one}"], home)
    assert (auto_dir / "consolidated.ckpt").is_file()
    continued, single = only_run(auto_dir), only_run(single_run)
    for key in LOSS_KEYS:
        assert_close(continued.series(key), single.series(key)[1:], rel=1e-5)


def test_an_interrupted_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    """A save that dies half-way (here: raises after writing one shard) never replaces `last`."""
    last = tmp_path / "last.ckpt"
    last.mkdir()
    (last / "meta.pt").write_text("epoch 1, complete")

    def dies_while_writing(state, checkpoint_id, **kwargs):
        (checkpoint_id / "__0_0.distcp").write_text("half of epoch 2")
        raise KeyboardInterrupt  # the run is killed here

    monkeypatch.setattr(dcp, "save", dies_while_writing)
    strategy = FSDPStrategy()
    with pytest.raises(KeyboardInterrupt):
        strategy.save_checkpoint({"state_dict": {}}, last)
    assert sorted(p.name for p in last.iterdir()) == ["meta.pt"]
    assert (last / "meta.pt").read_text() == "epoch 1, complete"

    def writes_completely(state, checkpoint_id, **kwargs):
        (checkpoint_id / "__0_0.distcp").write_text("epoch 2")

    monkeypatch.setattr(dcp, "save", writes_completely)
    strategy.save_checkpoint({"state_dict": {}, "epoch": 2}, last)  # the next save also clears the dead one's leftovers
    assert (last / "__0_0.distcp").read_text() == "epoch 2"
    assert torch.load(last / "meta.pt") == {"epoch": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
