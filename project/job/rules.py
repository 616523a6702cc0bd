"""The rules of a typed job (``Job``) that depend on how its devices divide the work and on its batch:
``layout_problem``, asked of the job a config becomes before launch (``project.config.checks.check_config``) and of
every job the memory plan and ``plan=search`` try. Each owner's rules are its own: the layout's (``Layout.problem``),
each model option's (``ModelOption.problem``), the task's (``TaskModule.problem``); here they are asked in order,
beside the machine's GPUs and the batches each replica gets."""

import torch

from project.job.job import Job
from project.job.model_option import ModelOption
from project.models.sequence import BlockSequence
from project.options.errors import ConfigError


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def gpus_problem(accelerator: str, on_cuda: bool, devices: int) -> ConfigError | None:
    """On CUDA (``on_cuda``, by ``trainer.accelerator``): what is wrong with asking this machine for ``devices`` GPUs,
    or None."""
    if not on_cuda:
        return None
    available = torch.cuda.device_count()
    if available == 0:
        return ConfigError(
            "trainer.accelerator",
            f"is {accelerator!r} but this machine has no CUDA GPU.",
            "use trainer.accelerator=cpu (or auto), or run on a machine with GPUs.",
        )
    if devices > available:
        return ConfigError(
            "trainer.devices",
            f"asks for {devices} GPUs but this machine has {available}.",
            f"set trainer.devices={available} or fewer, or trainer.accelerator=cpu for CPU processes.",
        )
    return None


def _train_batches(job: Job, batches_per_epoch: int) -> int:
    """Training batches an epoch runs, as Lightning counts them with ``trainer.limit_train_batches`` (N batches or a
    fraction of the epoch)."""
    limit = job.validation.limit_train_batches
    if isinstance(limit, int) and not isinstance(limit, bool):
        return min(batches_per_epoch, limit)
    if isinstance(limit, float):
        return int(batches_per_epoch * limit)
    return batches_per_epoch


def _val_interval_problem(job: Job, batches_per_epoch: int) -> ConfigError | None:
    """``trainer.val_check_interval``: null (each epoch's end), a fraction of an epoch, or every N training batches,
    which within an epoch (``check_val_every_n_epoch`` set) Lightning refuses past the epoch's length, late.

    With ``trainer.accumulate_grad_batches`` > 1 a validation must fall where an optimizer step ends: one inside an
    accumulation would save checkpoints holding half a step, which no resumed run can continue exactly.
    """
    interval = job.validation.val_check_interval
    fix = (
        "use N training batches (e.g. trainer.val_check_interval=500), a fraction of an epoch in (0, 1], or null "
        "for each epoch's end."
    )
    every_epoch = job.validation.check_val_every_n_epoch
    if every_epoch is None and not is_int(interval):
        return ConfigError(
            "trainer.val_check_interval",
            f"is {interval!r}, but with trainer.check_val_every_n_epoch="
            "null validation is counted in training batches only.",
            "set trainer.val_check_interval=N (batches), or trainer.check_val_every_n_epoch=1.",
        )
    if interval is None:
        return None
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or interval <= 0:
        return ConfigError("trainer.val_check_interval", f"is {interval!r}.", fix)
    if isinstance(interval, float) and interval > 1:
        return ConfigError("trainer.val_check_interval", f"is {interval}, a fraction of an epoch above 1.", fix)
    batches = _train_batches(job, batches_per_epoch)
    if is_int(interval) and every_epoch is not None and interval > batches:
        return ConfigError(
            "trainer.val_check_interval",
            f"is {interval} batches, but an epoch has {batches}.",
            f"use at most {batches}, or trainer.check_val_every_n_epoch=null to count batches across "
            "epochs (for runs of trainer.max_steps).",
        )
    accumulate = job.accumulate
    if accumulate == 1 or (isinstance(interval, float) and interval == 1.0):
        return None
    every = interval if is_int(interval) else max(1, int(batches * interval))  # Lightning's val_check_batch
    if every % accumulate and not (every == batches and every_epoch is not None):  # an epoch's end is a step's
        multiple = max(accumulate, every - every % accumulate)
        return ConfigError(
            "trainer.val_check_interval",
            f"validates every {every} training batches, inside an "
            f"optimizer step of trainer.accumulate_grad_batches={accumulate} batches: its checkpoints "
            "would hold half a step.",
            f"validate every multiple of {accumulate} batches, e.g. trainer.val_check_interval={multiple}.",
        )
    if every_epoch is None and batches % accumulate:
        return ConfigError(
            "trainer.val_check_interval",
            f"counts batches across epochs, but an epoch's {batches} "
            f"batches are no multiple of trainer.accumulate_grad_batches={accumulate} (each epoch ends "
            "with a shorter step), so validations would fall inside steps.",
            f"set trainer.check_val_every_n_epoch=1, or trainer.limit_train_batches to a multiple of {accumulate}.",
        )
    return None


def layout_problem(job: Job) -> ConfigError | None:
    """The first rule of a run that depends on how its devices divide the work and its batch that ``job`` breaks, or
    None: the devices this machine has, the layout's own rules, each model option's, the task's, a text sample's need
    for ranks that run the whole model, and the batches each replica gets. ``check_config`` raises it; the memory
    plan and ``plan=search`` ask it of every layout they try."""
    net, module = job.model.meta_model()
    return (
        gpus_problem(job.accelerator, job.uses_cuda, job.devices)
        or _options_problem(job, net, module.options)
        or job.layout.problem(job, net)
        or module.problem(job)
        or _text_sample_problem(job)
        or _batch_problem(job)
        or _val_interval_problem(job, job.train_samples // job.samples_per_step)
        or _val_samples_problem(job)
    )


def _options_problem(job: Job, net: BlockSequence, options: list[ModelOption]) -> ConfigError | None:
    """The first rule of the model options (``ModelOption.problem``) that ``job`` breaks, asked before the layout's
    own rules (an option that cannot take a layout at all says so before the layout's sizes are judged), unless the
    job's ranks do not divide as its layout says: then it has no dims yet, and the layout's rules name the key."""
    try:
        job.layout.dims(job.world_size)  # ParallelDims refuses ranks that do not divide
    except ValueError:
        return None
    return next(filter(None, (option.problem(job, net) for option in options)), None)


def _text_sample_problem(job: Job) -> ConfigError | None:
    """A text sample (``TextSample``'s prompt set) needs a layout whose ranks each run the whole model."""
    key = job.text_sample_prompt
    if key is not None and not job.dims.runs_whole_model:
        return ConfigError(
            key,
            f"is set, but under strategy={job.strategy_name} as configured no rank runs the whole model (pipeline "
            "stages, tensor-parallel splits).",
            f"set {key}=null, and generate from the checkpoint: python -m project.cli.generate.",
        )
    return None


def _batch_problem(job: Job) -> ConfigError | None:
    """Each data-parallel replica needs a training sample a step, and an epoch a full global batch."""
    data_parallel, samples, global_batch = job.dims.data_parallel, job.train_samples, job.samples_per_step
    if data_parallel > samples:  # no batch size helps: blame the replicas
        return ConfigError(
            "trainer.devices",
            f"x trainer.num_nodes gives {data_parallel} data-parallel replicas, more than the "
            f"{samples} training samples: each replica needs one a step.",
            f"use at most {samples} replicas, or more training data.",
        )
    if global_batch > samples:
        return ConfigError(
            "data.batch_size",
            f"gives a global batch of {job.batch_size} x {data_parallel} data-parallel replicas = {global_batch} "
            f"samples, more than the {samples} training samples, so an epoch would have no full batch.",
            f"lower data.batch_size to at most {samples // data_parallel}, or use more training data.",
        )
    return None


def _val_samples_problem(job: Job) -> ConfigError | None:
    data_parallel = job.dims.data_parallel
    if job.val_samples < data_parallel:
        return ConfigError(
            "data.num_val",
            f"gives {job.val_samples} validation samples, fewer than the {data_parallel} data-parallel "
            "replicas that each need one.",
            f"use at least {data_parallel} validation samples, or fewer devices.",
        )
    return None
