"""Tensor parallelism in its three layouts (strategy=tensor_parallel; fsdp x tensor parallel; pipeline x tensor
parallel): the numbers of one device, 1/(data-parallel x tensor-parallel ranks) of the model state per device, and
checkpoints that move between layouts. Each layout against the hand-written loop: test_reference; errors before
launch: test_bad_input; planned against measured memory: test_memory_plan."""

import pytest
import torch
from conftest import FIRST_EPOCH, TINY, TINY_GPT, assert_close, assert_matches_reference, only_run, train
from test_memory_plan import resolved
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor

from project.checkpointing.files import is_sharded_checkpoint
from project.checkpointing.hf import HFWeights, net_options, read_config
from project.models import GPT, Llama
from project.options.errors import ConfigError
from project.parallel.fake_process_group import fake_process_group
from project.parallel.parallelize import apply_fsdp, materialize
from project.parallel.tensor_parallel_plans import apply_tensor_parallel

pytestmark = pytest.mark.torch_internals

# Each layout's run (conftest) and its ranks: data-parallel replicas x tensor-parallel ranks (x pipeline stages).
LAYOUTS = {
    "tensor_parallel": "gpt_tensor_parallel",
    "fsdp x tensor_parallel": "gpt_fsdp_tensor_parallel",
    "pipeline x tensor_parallel": "gpt_pipeline_tensor_parallel",
}
RUN_NAMES = {
    "tensor_parallel": "gpt-tensor_parallel-tp2-2dev-1node",
    "fsdp x tensor_parallel": "gpt-fsdp-tp2-4dev-1node",
    "pipeline x tensor_parallel": "gpt-pipeline-tp2-4dev-1node",
}
GPT_32 = [*TINY_GPT, "data.batch_size=32"]  # gpt_auto's config: one device, the layouts' global batch


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_logs_the_numbers_of_one_device(layout, gpt_auto, request):
    """Each layout's epochs (the 4-device ones resumed from the layout before: FIRST_EPOCH) are one device's."""
    run, auto = only_run(request.getfixturevalue(LAYOUTS[layout])), only_run(gpt_auto)
    assert run.config["strategy"]["tensor_parallel_size"] == 2 and run.name == RUN_NAMES[layout]
    first = FIRST_EPOCH.get(LAYOUTS[layout], 0)
    assert [row["epoch"] for row in run.history] == list(range(first, 3))
    for key in ("train/loss", "val/loss", "val/perplexity"):
        assert_close(run.series(key), auto.series(key)[first:], rel=1e-5)


@pytest.mark.slow
def test_each_device_holds_its_share_of_the_model_state(
    gpt_auto, gpt_tensor_parallel, gpt_fsdp_tensor_parallel, gpt_pipeline_tensor_parallel, gpt_pipeline_compiled
):
    """Split over 2 tensor-parallel ranks, a device holds half of one device's parameters, gradients and AdamW
    state; with FSDP over 2 replicas too, a quarter; in a pipeline, half of its stage's. A little more: the norms,
    the position table and the biases added after a row-wise split are whole on every rank (960 of the tiny GPT's
    28,032 parameters)."""

    def state(job_dir) -> float:
        return only_run(job_dir).series("memory/model_state_mb")[-1]

    whole, stage = state(gpt_auto), state(gpt_pipeline_compiled)  # one device; the fuller of 2 pipeline stages
    for job_dir, share in (
        (gpt_tensor_parallel, whole / 2),
        (gpt_fsdp_tensor_parallel, whole / 4),
        (gpt_pipeline_tensor_parallel, stage / 2),
    ):
        assert share <= state(job_dir) <= 1.1 * share, (job_dir.name, state(job_dir), share)


@pytest.mark.slow
def test_a_checkpoint_moves_from_layout_to_layout(
    gpt_tensor_parallel, gpt_fsdp_tensor_parallel, gpt_pipeline_tensor_parallel, reference, runs_dir, home
):
    """tensor_parallel over 2 ranks saves epoch 0 (each rank its slices); fsdp over 2 replicas of 2 tensor-parallel
    ranks resumes it and trains epochs 1 and 2 (each rank its shard of its slices); from that run's epoch 1, auto on
    one device (consolidated into one file) and pipeline x tensor parallel on 4 train epoch 2 (the conftest runs,
    but for auto). Every epoch is the hand-written loop's: weights, AdamW moments, the learning rate where the
    schedule left it, and the data order carry over."""
    expected = reference(GPT_32, 32).history
    tensor_parallel_epoch_0 = gpt_tensor_parallel / "checkpoints" / "epoch000.ckpt"
    assert is_sharded_checkpoint(tensor_parallel_epoch_0) and len(list(tensor_parallel_epoch_0.glob("*.distcp"))) == 2
    fsdp = only_run(gpt_fsdp_tensor_parallel)
    assert [row["epoch"] for row in fsdp.history] == [1, 2]
    assert_matches_reference(fsdp, expected[1:])
    fsdp_epoch_1 = gpt_fsdp_tensor_parallel / "checkpoints" / "epoch001.ckpt"
    assert len(list(fsdp_epoch_1.glob("*.distcp"))) == 4
    auto_dir = runs_dir / "gpt-fsdp2-tp2-to-auto"
    train([*GPT_32, f"hydra.run.dir={auto_dir}", f"ckpt_path={fsdp_epoch_1}"], home)
    assert (auto_dir / "consolidated.ckpt").is_file()
    assert_matches_reference(only_run(auto_dir), expected[2:])
    pipeline = only_run(gpt_pipeline_tensor_parallel)
    assert [row["epoch"] for row in pipeline.history] == [2]
    assert_matches_reference(pipeline, expected[2:])


@pytest.mark.slow
def test_a_pipeline_x_tensor_parallel_checkpoint_evaluates_under_tensor_parallel(
    gpt_pipeline_tensor_parallel, runs_dir, home
):
    """The 3D layout's sharded checkpoint (each of 4 ranks a tensor-parallel half of a stage) read by 2 ranks that
    each hold half of every layer: the run's own last val/loss."""
    eval_dir = runs_dir / "gpt-pp2-tp2-eval-tp2"
    last = gpt_pipeline_tensor_parallel / "checkpoints" / "last.ckpt"
    assert len(list(last.glob("*.distcp"))) == 4
    train(
        [
            *GPT_32,
            "mode=eval",
            "strategy=tensor_parallel",
            "trainer.devices=2",
            f"hydra.run.dir={eval_dir}",
            f"ckpt_path={last}",
        ],
        home,
    )
    evaluated = only_run(eval_dir).series("val/loss")
    assert_close(evaluated, only_run(gpt_pipeline_tensor_parallel).series("val/loss")[-1:], rel=1e-5)


@pytest.mark.parametrize(
    "devices, nodes, size, fits", [(6, 2, 4, False), (6, 2, 3, True), (4, 2, 8, True), (4, 3, 6, False)]
)
def test_a_tensor_parallel_group_stays_within_a_node_or_takes_whole_ones(devices, nodes, size, fits):
    """A group's ranks are consecutive: T dividing the devices of a node keeps it inside one, a multiple of them
    takes whole nodes; anything else would straddle nodes (checked before launch; the MLP's 96 units split 3, 4, 6
    and 8 ways)."""
    job = resolved(
        [
            *TINY,
            "model.net.hidden_dims=[96,32]",
            "data.num_val=256",
            "strategy=fsdp",
            f"trainer.devices={devices}",
            f"trainer.num_nodes={nodes}",
            f"strategy.tensor_parallel_size={size}",
            "logger=none",
        ]
    )
    problem = job.layout.problem(job, job.meta_net())
    if fits:
        assert problem is None
    else:
        assert isinstance(problem, ConfigError)
        assert f"groups of {size} consecutive ranks would straddle nodes of {devices}" in str(problem)


@pytest.mark.parametrize("family, tied", [("gpt2", True), ("llama", False), ("phi3", False), ("qwen3", False)])
def test_each_rank_reads_its_own_part_of_hugging_face_weights(family, tied, tmp_path):
    """model.init_from under FSDP over 2 replicas of 2 tensor-parallel ranks: each rank reads from the safetensors
    exactly its part of every tensor, as torch's own distribute_tensor cuts the tensor one device reads whole (GPT-2's
    fused query/key/value: each rank's heads of each third; Phi-3's: of its query rows and of its fewer key/value
    rows, and its units of the fused gate and up; Qwen 3's norms whole on each; an uneven vocabulary of 61). The 4
    ranks are simulated one after another on torch's fake process group: reading sends nothing."""
    pytest.importorskip("transformers")
    from test_hf import hf_model

    hf_model(family, tied).save_pretrained(tmp_path / "hf")
    weights, options = HFWeights(tmp_path / "hf"), net_options(read_config(tmp_path / "hf"))
    model_class = GPT if family == "gpt2" else Llama
    with torch.device("meta"):
        whole = model_class(**options)
    materialize(whole, torch.device("cpu"), seed=0, weights=weights)
    for rank in range(4):
        with fake_process_group(4, rank):
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
            with torch.device("meta"):
                net = model_class(**options)
            apply_tensor_parallel(net, mesh["tensor_parallel"])
            apply_fsdp(net, mesh["data_parallel"])
            materialize(net, torch.device("cpu"), seed=0, weights=weights)
            for name, parameter in net.named_parameters():
                expected = distribute_tensor(
                    whole.get_parameter(name).detach(), parameter.device_mesh, parameter.placements, src_data_rank=None
                ).to_local()
                assert torch.equal(parameter.to_local(), expected), (rank, name)
            assert (net.head.output.weight is net.stem.tokens.weight) == tied
