"""The hand-written PyTorch loop ``benchmarks/overhead.py`` times the framework against.

``python benchmarks/hand_loop.py <clock file> <strategy> <Hydra overrides...>``, under ``torchrun`` for ddp, fsdp
and pipeline. It trains what ``python train.py <overrides>`` trains (the model, data, batch, optimizer and LR
schedule of the composed config; the project builds the model and data, everything else is written here) and does
each epoch what the framework does: train on the epoch's shuffled global batches (this rank's slice of each), sum
the loss (and accuracy) over the epoch, validate on the whole validation set, reduce the sums across ranks, and
save the model and optimizer state (unless ``+trainer.enable_checkpointing=false``, the framework's own switch,
is among the overrides). Rank 0 appends ``{"event": "epoch_start" | "first_step" | "end", "time": ...}``
lines to the clock file, read by the benchmark.

It is written as one would write it by hand for speed: whole batches indexed from the in-memory tensors, no
``.item()`` inside the epoch, the collectives of the strategy and nothing else.

It runs where the framework would: on ``cuda:<LOCAL_RANK>`` (nccl between ranks) when ``trainer.accelerator`` is
gpu, or auto on a machine with CUDA, else on the CPU (gloo). On a GPU the in-memory tensors are moved to it once,
before the first epoch. As the framework does, it computes forward and loss in bfloat16 autocast under
``trainer.precision=bf16-mixed``, lets float32 matmuls on a GPU use TF32 with ``tf32`` and compiles each block (and
the loss, unless fused) with ``model.compile``. With ``model.float8.enabled`` it converts the blocks' Linear layers of
widths in 16s (not a router; not the small ones torchao's filter leaves, unless ``model.float8.small_layers``) to
torchao's Float8 training itself, before compiling, as torchao's README does (on a CPU, emulated). With
``model.fused_loss`` (not under pipeline) its loss is the net's own ``net(inputs, targets)``, the output layer and
loss in chunks, as the framework's.
"""

import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from helpers.reference import decayed_and_spared, epoch_order, lr_factor  # noqa: E402 (the tests' hand-written rules)

from project.launch.training import set_tf32  # noqa: E402
from project.layouts.pipeline_layout import StageModule  # noqa: E402
from project.models import init_weights  # noqa: E402
from project.parallel.parallelize import block_sizes, compile_blocks, split_blocks, stage_modules  # noqa: E402


def mean_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


def training_device(accelerator: str) -> torch.device:
    """The device Lightning's ``accelerator`` would pick for this process (one per device, as under torchrun)."""
    if accelerator == "gpu" or (accelerator == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def to_float8(net: torch.nn.Module, recipe: str, small_layers: bool, device: torch.device, gather: bool) -> None:
    """torchao's Float8 training on the blocks' Linear layers of widths in 16s but the routers, and but the small
    ones unless ``small_layers`` (torchao's own filter)."""
    from torchao.float8 import Float8LinearConfig, _auto_filter_for_recipe, convert_to_float8_training

    fast_enough = _auto_filter_for_recipe(recipe, filter_fqns=[])

    config = Float8LinearConfig.from_recipe_name(recipe)
    config = dataclasses.replace(
        config, emulate=device.type != "cuda", enable_fsdp_float8_all_gather=gather and recipe == "tensorwise"
    )
    convert_to_float8_training(
        net.blocks,
        config=config,
        module_filter_fn=lambda module, name: (
            module.in_features % 16 == 0
            and module.out_features % 16 == 0
            and not name.endswith("router")
            and (small_layers or fast_enough(module, name))
        ),
    )


def main(clock_file: str, strategy: str, overrides: list[str]) -> None:
    def stamp(event: str) -> None:
        if rank == 0:
            with open(clock_file, "a") as clock:
                clock.write(json.dumps({"event": event, "time": time.time()}) + "\n")

    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    device = training_device(cfg.trainer.accelerator)
    distributed = strategy != "auto"
    if distributed:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    set_tf32(cfg.tf32, device)
    data = instantiate(cfg.data)
    data.setup("fit")
    # Onto the device once: a step then indexes its batch there, with no copy from the host.
    x, y, x_val, y_val = [tensor.to(device) for tensor in data.train_set.tensors + data.val_set.tensors]
    net = init_weights(instantiate(cfg.model.net), cfg.seed).to(device)
    float8 = cfg.model.get("float8")
    if float8 is not None and float8.enabled:
        to_float8(net, float8.recipe, float8.small_layers, device, gather=strategy == "fsdp")
    if cfg.model.compile:
        compile_blocks(net)  # before any wrapping, as the framework does
    fused_loss = cfg.model.get("fused_loss", False)  # the output layer and loss in chunks: the net's head does it
    if fused_loss and strategy == "pipeline":
        sys.exit("model.fused_loss is refused under pipeline (the framework refuses it before launch)")
    # As the framework does under model.compile: the loss of the logits compiled with the blocks
    loss_of = torch.compile(mean_loss) if cfg.model.compile and not fused_loss else mean_loss
    batch = cfg.data.batch_size  # per data-parallel replica, as the framework's
    replicas = 1 if strategy == "pipeline" else world
    global_batch = batch * replicas
    model, stage, schedule, eval_schedule = net, None, None, None
    if strategy == "ddp":
        model = DistributedDataParallel(net)
    elif strategy == "fsdp":
        for block in net.blocks:
            fully_shard(block)
        model = fully_shard(net)
    elif strategy == "pipeline":
        stages = split_blocks(block_sizes(net), world, None)
        model = StageModule(stage_modules(net, stages, rank))  # the stage's modules run in order
        microbatches = cfg.strategy.microbatches
        stage = PipelineStage(model, rank, world, device)
        schedule = Schedule1F1B(
            stage, microbatches, loss_fn=lambda out, tgt: loss_of(out, tgt) / microbatches, scale_grads=False
        )
        eval_schedule = Schedule1F1B(PipelineStage(model, rank, world, device), microbatches)
    last_stage = strategy != "pipeline" or rank == world - 1
    decayed, spared = decayed_and_spared(model)  # the configured optimizer (fused where the config says), two groups
    optimizer = instantiate(cfg.model.optimizer)(params=[{"params": decayed}, {"params": spared, "weight_decay": 0.0}])
    steps_per_epoch = len(x) // global_batch
    schedule_lr = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg, cfg.trainer.max_epochs * steps_per_epoch))
    classification = y.dim() == 1
    scales_after_step = float8 is not None and float8.enabled and strategy == "fsdp" and float8.recipe == "tensorwise"
    if scales_after_step:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    checkpoint_dir = Path(clock_file).with_suffix(".ckpt")
    checkpointing = cfg.trainer.get("enable_checkpointing", True)

    def autocast() -> torch.autocast:  # Lightning's bf16-mixed: forward and loss in bfloat16, backward outside
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.trainer.precision == "bf16-mixed")

    def forward_backward(
        inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        if schedule is None:
            with autocast():
                outputs = None if fused_loss else model(inputs)
                loss = model(inputs, targets) / targets.numel() if outputs is None else loss_of(outputs, targets)
            loss.backward()
            return outputs, loss
        losses = []
        with autocast():  # the schedule runs the backward itself, as under the framework's pipeline strategy
            outputs = schedule.step(
                *([inputs] if rank == 0 else []), target=targets if last_stage else None, losses=losses
            )
        return (outputs, torch.stack(losses).sum()) if last_stage else None

    def forward(inputs: torch.Tensor) -> torch.Tensor | None:
        if eval_schedule is None:
            return model(inputs)
        return eval_schedule.eval(*([inputs] if rank == 0 else []))

    for epoch in range(cfg.trainer.max_epochs):
        stamp("epoch_start")
        order = epoch_order(len(x), cfg.seed, epoch) if cfg.data.shuffle else torch.arange(len(x))
        order = order.to(device)  # once an epoch: host indices into device tensors would copy (and sync) every step
        sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss x targets, correct, targets
        model.train()
        for step in range(steps_per_epoch):
            rows = order[step * global_batch : (step + 1) * global_batch]
            if strategy != "pipeline":
                rows = rows[rank * batch : (rank + 1) * batch]
            result = forward_backward(x[rows], y[rows])
            optimizer.step()
            if scales_after_step:
                precompute_float8_dynamic_scale_for_fsdp(model)
            schedule_lr.step()
            optimizer.zero_grad()
            if result is not None:
                outputs, loss = result
                sums[0] += loss.detach() * y[rows].numel()
                sums[2] += y[rows].numel()
                if classification and outputs is not None:
                    sums[1] += (outputs.detach().argmax(-1) == y[rows]).sum()
            if epoch == 0 and step == 0:
                stamp("first_step")
        model.eval()
        val_sums = torch.zeros(3, dtype=torch.float64, device=device)
        # The framework's evaluation split: every sample once, near-equal slices per replica, batch by batch.
        parts = torch.arange(len(x_val), device=device).tensor_split(
            min(math.ceil(len(x_val) / global_batch) * replicas, len(x_val))
        )
        with torch.no_grad(), autocast():
            for rows in parts[(0 if strategy == "pipeline" else rank) :: replicas]:
                inputs, targets = x_val[rows], y_val[rows]
                if strategy == "pipeline" and len(rows) % microbatches:
                    continue  # equal micro-batches only (the framework pads the last; here it is left out)
                if fused_loss:
                    val_sums[0] += model(inputs, targets)
                    val_sums[2] += targets.numel()
                    continue
                outputs = forward(inputs)
                if last_stage:
                    val_sums[0] += F.cross_entropy(
                        outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1), reduction="sum"
                    )
                    val_sums[2] += targets.numel()
                    if classification:
                        val_sums[1] += (outputs.argmax(-1) == targets).sum()
        totals = torch.cat([sums, val_sums])
        if distributed:
            dist.all_reduce(totals)
        if checkpointing and strategy in ("fsdp", "pipeline"):  # each rank writes its own part
            model_state, optimizer_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=checkpoint_dir / str(epoch))
        elif checkpointing and rank == 0:
            torch.save(
                {"model": net.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_dir.with_suffix(".pt")
            )
        if rank == 0:
            print(f"epoch {epoch}: train/loss {totals[0] / totals[2]:.4f} val/loss {totals[3] / totals[5]:.4f}")
    stamp("end")
    if distributed:
        dist.barrier()  # rank 0 may still be writing its checkpoint
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
