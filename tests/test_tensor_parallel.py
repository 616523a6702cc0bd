"""Tensor parallelism in its three layouts (strategy=tensor_parallel; fsdp x tensor parallel; pipeline x tensor
parallel): the numbers of one device, 1/(data-parallel x tensor-parallel ranks) of the model state per device, and
checkpoints that move between layouts. Each layout against the hand-written loop: test_reference; errors before
launch: test_bad_input; planned against measured memory: test_memory_plan."""

import pytest

from conftest import TINY_GPT, assert_close, assert_matches_reference, only_run, train
from project.checkpoints import is_sharded_checkpoint

# Each layout's run (conftest) and its ranks: data-parallel replicas x tensor-parallel ranks (x pipeline stages).
LAYOUTS = {"tensor_parallel": "gpt_tensor_parallel", "fsdp x tensor_parallel": "gpt_fsdp_tensor_parallel",
           "pipeline x tensor_parallel": "gpt_pipeline_tensor_parallel"}
RUN_NAMES = {"tensor_parallel": "gpt-tensor_parallel-tp2-2dev-1node", "fsdp x tensor_parallel": "gpt-fsdp-tp2-4dev-1node",
             "pipeline x tensor_parallel": "gpt-pipeline-tp2-4dev-1node"}
GPT_32 = [*TINY_GPT, "data.batch_size=32"]  # gpt_auto's config: one device, the layouts' global batch


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_logs_the_numbers_of_one_device(layout, gpt_auto, request):
    run, auto = only_run(request.getfixturevalue(LAYOUTS[layout])), only_run(gpt_auto)
    assert run.config["strategy"]["tensor_parallel_size"] == 2 and run.name == RUN_NAMES[layout]
    for key in ("train/loss", "val/loss", "val/perplexity"):
        assert_close(run.series(key), auto.series(key), rel=1e-5)


@pytest.mark.slow
def test_each_device_holds_its_share_of_the_model_state(gpt_auto, gpt_tensor_parallel, gpt_fsdp_tensor_parallel,
                                                        gpt_pipeline_tensor_parallel, gpt_pipeline_compiled):
    """Split over 2 tensor-parallel ranks, a device holds half of one device's parameters, gradients and AdamW
    state; with FSDP over 2 replicas too, a quarter; in a pipeline, half of its stage's. A little more: the norms,
    the position table and the biases added after a row-wise split are whole on every rank (960 of the tiny GPT's
    28,032 parameters)."""
    def state(job_dir) -> float:
        return only_run(job_dir).series("memory/model_state_mb")[-1]

    whole, stage = state(gpt_auto), state(gpt_pipeline_compiled)  # one device; the fuller of 2 pipeline stages
    for job_dir, share in ((gpt_tensor_parallel, whole / 2), (gpt_fsdp_tensor_parallel, whole / 4),
                           (gpt_pipeline_tensor_parallel, stage / 2)):
        assert share <= state(job_dir) <= 1.1 * share, (job_dir.name, state(job_dir), share)


@pytest.mark.slow
def test_a_checkpoint_moves_from_layout_to_layout(gpt_tensor_parallel, reference, runs_dir, home):
    """tensor_parallel over 2 ranks saves epoch 0 (each rank its slices); fsdp over 2 devices resumes it and trains
    epochs 1 and 2; from fsdp's epoch 1, auto on one device (consolidated into one file) and pipeline x tensor
    parallel on 4 train epoch 2. Every epoch is the hand-written loop's: weights, AdamW moments, the learning rate
    where the schedule left it, and the data order carry over."""
    expected = reference(GPT_32, 32).history
    tensor_parallel_epoch_0 = gpt_tensor_parallel / "checkpoints" / "epoch000.ckpt"
    assert is_sharded_checkpoint(tensor_parallel_epoch_0) and len(list(tensor_parallel_epoch_0.glob("*.distcp"))) == 2
    fsdp_dir, auto_dir, pipeline_dir = (runs_dir / f"gpt-tp2-to-{name}" for name in ("fsdp2", "auto", "pp2-tp2"))
    train([*TINY_GPT, "data.batch_size=16", "strategy=fsdp", "trainer.devices=2", f"hydra.run.dir={fsdp_dir}",
           f"ckpt_path={tensor_parallel_epoch_0}", "callbacks.model_checkpoint.save_top_k=-1"], home)
    fsdp = only_run(fsdp_dir)
    assert [row["epoch"] for row in fsdp.history] == [1, 2]
    assert_matches_reference(fsdp, expected[1:])
    fsdp_epoch_1 = fsdp_dir / "checkpoints" / "epoch001.ckpt"
    train([*GPT_32, f"hydra.run.dir={auto_dir}", f"ckpt_path={fsdp_epoch_1}"], home)
    assert (auto_dir / "consolidated.ckpt").is_file()
    assert_matches_reference(only_run(auto_dir), expected[2:])
    train([*GPT_32, "strategy=pipeline", "trainer.devices=4", "strategy.num_stages=2", "strategy.tensor_parallel_size=2",
           f"hydra.run.dir={pipeline_dir}", f"ckpt_path={fsdp_epoch_1}"], home)
    assert_matches_reference(only_run(pipeline_dir), expected[2:])


@pytest.mark.slow
def test_a_pipeline_x_tensor_parallel_checkpoint_evaluates_under_tensor_parallel(gpt_pipeline_tensor_parallel,
                                                                                  runs_dir, home):
    """The 3D layout's sharded checkpoint (each of 4 ranks a tensor-parallel half of a stage) read by 2 ranks that
    each hold half of every layer: the run's own last val/loss."""
    eval_dir = runs_dir / "gpt-pp2-tp2-eval-tp2"
    last = gpt_pipeline_tensor_parallel / "checkpoints" / "last.ckpt"
    assert len(list(last.glob("*.distcp"))) == 4
    train([*GPT_32, "mode=eval", "strategy=tensor_parallel", "trainer.devices=2", f"hydra.run.dir={eval_dir}",
           f"ckpt_path={last}"], home)
    evaluated = only_run(eval_dir).series("val/loss")
    assert_close(evaluated, only_run(gpt_pipeline_tensor_parallel).series("val/loss")[-1:], rel=1e-5)
