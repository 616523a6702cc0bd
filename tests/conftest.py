"""Shared helpers: run ``python train.py`` (or torchrun) as a user would, in an isolated HOME, and find its outputs."""

import contextlib
import importlib
import math
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from filelock import FileLock
from helpers.command_line import split_command
from helpers.preloaded import TRAIN, TrainServer
from helpers.reference import ReferenceRun, reference_run
from helpers.wandb_offline import OfflineRun, offline_runs

REPO = Path(__file__).resolve().parents[1]

# A model and data small enough for a few seconds per run; everything else is the real default config.
TINY = [
    "data.num_features=32",
    "data.num_train=1024",
    "data.num_val=250",  # not a multiple of any global batch: exercises the uneven evaluation split
    "model.net.hidden_dims=[64,32]",
    "model.optimizer.lr=0.1",
    "trainer.max_epochs=3",
    "print_config=false",
    "~callbacks.progress_bar",
    "+trainer.enable_progress_bar=false",
]


# A GPT and a language small enough for seconds per run; the default optimizer and schedule.
TINY_GPT = [
    "model=gpt",
    "data=tokens",
    "data.vocab_size=32",
    "data.seq_length=16",
    "data.num_train=256",
    "data.num_val=100",
    "model.net.dim=32",
    "model.net.num_heads=2",
    "trainer.max_epochs=3",
    "print_config=false",
    "~callbacks.progress_bar",
    "+trainer.enable_progress_bar=false",
]


# The tiny Llama on the same language; its 2 query heads share 1 key/value head (grouped-query attention).
TINY_LLAMA = ["model=llama", *TINY_GPT[1:], "model.net.num_kv_heads=1", "model.net.hidden_dim=64"]

# The tiny Llama as 2 tensor-parallel ranks can split it: 4 query heads (of width 8) sharing 2 key/value heads.
TINY_LLAMA_TP = [*TINY_LLAMA, "model.net.num_heads=4", "model.net.num_kv_heads=2"]

# The same shape with Qwen's departures (model=qwen2: query, key and value biases; model=qwen3: per-head query and
# key norms), on heads of 16 dimensions, wider than dim / num_heads (as Qwen 3's are).
TINY_QWEN = [*TINY_LLAMA_TP[1:], "model.net.head_dim=16"]


def require_extra(module: str, extra: str) -> ModuleType:
    """``module``, of the project's optional dependencies ``extra``; without it the test is skipped (not in CI, whose
    dev install has every extra)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        assert not os.environ.get("CI"), f"the dev install has project[{extra}]"
        pytest.skip(f"no {module} here (pip install -e '.[{extra}]')")


def isolated_env(home: Path) -> dict[str, str]:
    """No W&B credentials or mode from the developer's machine: runs must decide offline by themselves. Caches
    under ``home`` (no ``XDG_CACHE_HOME``). The tests folder is importable, so a run can load a probe callback from
    ``tests/helpers/probes.py``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "XDG_CACHE_HOME"}
    env.update(HOME=str(home), PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO / "tests"))
    return env


def kill_process_tree(root: int, signum: int = signal.SIGKILL) -> None:
    """Send ``signum`` to ``root`` and all its descendants (found through /proc), the descendants listed before any
    dies."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(parent, []).append(int(stat.parent.name))
    tree, index = [root], 0
    while index < len(tree):
        tree += children.get(tree[index], [])
        index += 1
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


@pytest.fixture
def small_disk(tmp_path):
    """A function mounting a tmpfs of ``size`` (mount's syntax: ``2m``) at a new dir and returning the dir: a real
    file system that fills, for the full-disk tests; ``resize(dir, size)`` grows it. Unmounted after the test.
    Needs the right to mount (root, as on this project's machines and CI); skipped without it."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        target = tmp_path / f"disk{len(mounted)}"
        target.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(target)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(target)
        return target

    yield mount
    for target in mounted:
        subprocess.run(["umount", "--lazy", str(target)], check=True)


def resize(disk: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(disk)], check=True)


# One per HOME (tests/helpers/preloaded.py), started on first use, the least recently used closed past 3 (each holds
# torch).
TRAIN_SERVERS: dict[Path, TrainServer] = {}


def train_server(home: Path) -> TrainServer:
    server = TRAIN_SERVERS.pop(home, None) or TrainServer(isolated_env(home))
    TRAIN_SERVERS[home] = server  # last: the most recently used
    if len(TRAIN_SERVERS) > 3:
        TRAIN_SERVERS.pop(next(iter(TRAIN_SERVERS))).close()
    return server


@pytest.fixture(scope="session", autouse=True)
def close_train_servers():
    yield
    for server in TRAIN_SERVERS.values():
        server.close()


def run_preloaded(args: list[str], home: Path, timeout: int, program: list[str] = TRAIN) -> subprocess.CompletedProcess:
    """``python <program> <args>`` (``train.py`` by default), forked by the preloaded server, as ``subprocess.run``
    would report it."""
    server = train_server(home)
    with tempfile.TemporaryDirectory() as tmp:
        stdout, stderr = Path(tmp) / "stdout", Path(tmp) / "stderr"
        pid = server.start(args, REPO, stdout, stderr, program)
        ended = server.wait(pid, timeout)
        if ended is None:
            kill_process_tree(pid)
            server.wait(pid, 60)
            raise subprocess.TimeoutExpired([*program, *args], timeout, stdout.read_text(), stderr.read_text())
        return subprocess.CompletedProcess(
            [sys.executable, *program, *args], ended[1], stdout.read_text(), stderr.read_text()
        )


class PreloadedRun:
    """``python train.py <args>`` forked by the preloaded server, as ``subprocess.Popen(..., stdout=PIPE,
    stderr=STDOUT, text=True)`` would start it: for tests that signal or kill a run, or watch it as it goes. The
    run's pid is a real process, its workers forked too, unless ``fresh_workers`` (the tests of process trees:
    then they are its children, started from scratch; ``tests/helpers/preloaded.py``)."""

    def __init__(self, args: list[str], home: Path, fresh_workers: bool = False) -> None:
        self.server = train_server(home)
        self.output_file = Path(tempfile.mkdtemp(prefix="preloaded-run-")) / "output"  # stdout and stderr both
        self.pid = self.server.start(args, REPO, self.output_file, self.output_file, fresh_workers=fresh_workers)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.wait(timeout=0) if self.returncode is None else self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code (negative: the signal that killed it); ``TimeoutExpired`` after ``timeout`` s (0: None)."""
        if self.returncode is None:
            ended = self.server.wait(self.pid, 10**9 if timeout is None else timeout)
            if ended is None:
                if timeout == 0:
                    return None
                raise subprocess.TimeoutExpired(["train.py"], timeout or 0)
            self.returncode = ended[1]
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        """Its output once it has ended."""
        self.wait(timeout)
        return self.output_file.read_text(), None


def run_command(command: list[str], home: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``command`` in the repo with the isolated environment; a ``python`` command is forked from the preloaded
    server (the same process but for the imports already done)."""
    if command[0] == sys.executable:
        program, args = split_command(command[1:])
        result = run_preloaded(args, home, timeout, program)
    else:
        result = subprocess.run(
            command, cwd=REPO, env=isolated_env(home), capture_output=True, text=True, timeout=timeout
        )
    result.output = result.stdout + result.stderr
    return result


def train(args: list[str], home: Path, expect_ok: bool = True, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python train.py <args>``; fails the test with the output if it did not exit 0 (and expect_ok)."""
    result = run_command([sys.executable, "train.py", *args], home, timeout)
    if expect_ok:
        assert result.returncode == 0, result.output[-6000:]
    return result


def torchrun(nproc: int, args: list[str], home: Path) -> subprocess.CompletedProcess:
    # torch's own module rather than the torchrun script, which sits beside the interpreter that installed torch
    result = run_command(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "train.py", *args],
        home,
    )
    assert result.returncode == 0, result.output[-6000:]
    return result


@pytest.fixture(scope="session")
def shared_tmp(tmp_path_factory, worker_id) -> Path:
    """The session's temporary dir, the same for every pytest-xdist worker (each has a basetemp of its own below
    it; ``worker_id`` is "master" without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base if worker_id == "master" else base.parent


@pytest.fixture(scope="session")
def home(shared_tmp) -> Path:
    home = shared_tmp / "home"
    home.mkdir(exist_ok=True)
    return home


@pytest.fixture(scope="session")
def runs_dir(shared_tmp) -> Path:
    """Where the session's shared runs go: each is made once, by whichever xdist worker needs it first
    (``shared_run``)."""
    runs = shared_tmp / "runs"
    runs.mkdir(exist_ok=True)
    return runs


def shared_run(runs_dir: Path, name: str, make: Callable[[], str]) -> str:
    """``make()``'s output, made once for the session however many xdist workers ask: the first makes it under a
    lock, and the others wait for it and read what it said (or fail with the error it failed with)."""
    output, failure = runs_dir / f"{name}.output", runs_dir / f"{name}.failure"
    with FileLock(runs_dir / f"{name}.lock"):
        if failure.exists():
            pytest.fail(f"the shared run {name} failed in another worker:\n{failure.read_text()}")
        if not output.exists():
            try:
                output.write_text(make())
            except BaseException as error:
                failure.write_text(str(error)[-6000:])
                raise
    return output.read_text()


# The per-epoch results that must not depend on how a run is parallelised.
LOSS_KEYS = ["train/loss", "val/loss", "train/acc", "val/acc"]

# Logged once per epoch by every run.
EPOCH_KEYS = [
    "train/loss",
    "train/acc",
    "val/loss",
    "val/acc",
    "perf/samples_per_sec",
    "perf/epoch_time_s",
    "perf/tflops_per_device",
    "memory/params_mb",
    "memory/grads_mb",
    "memory/optimizer_mb",
    "memory/model_state_mb",
]


def only_run(job_dir) -> OfflineRun:
    runs = offline_runs(job_dir)
    assert len(runs) == 1, f"expected one W&B run in {job_dir}, found {len(runs)}"
    return runs[0]


def assert_close(a: list[float], b: list[float], rel: float) -> None:
    assert len(a) == len(b) and a, (a, b)
    for x, y in zip(a, b):
        assert math.isclose(x, y, rel_tol=rel), (a, b)


@pytest.fixture(scope="session")
def reference():
    """``reference(overrides, global_batch, device="cpu", autocast=None, forwards=1)``: the hand-written loop
    (reference.py) on the config that ``python train.py <overrides>`` composes, computed once per config."""
    from test_config import compose_train

    cache: dict[tuple, ReferenceRun] = {}

    def run(
        overrides: list[str],
        global_batch: int,
        device: str = "cpu",
        autocast: torch.dtype | None = None,
        forwards: int = 1,
    ) -> ReferenceRun:
        key = (tuple(overrides), global_batch, device, autocast, forwards)
        if key not in cache:
            cache[key] = reference_run(compose_train(overrides), global_batch, device, autocast, forwards)
        return cache[key]

    return run


def assert_matches_reference(
    run: OfflineRun, history: list[dict[str, float]], rel: float = 1e-5, epochs: int | None = None
) -> None:
    """Every per-epoch number of the hand-written loop, in the W&B run, to ``rel`` (of the first ``epochs``
    epochs, if given). Perplexity is exp(loss): its relative error is the loss's absolute error, so it is held to
    ``rel`` x the loss, as strictly as the loss."""
    history = history[:epochs]
    for key in history[0]:
        expected = [row[key] for row in history]
        if key.endswith("/perplexity"):
            losses = [row[key.replace("/perplexity", "/loss")] for row in history]
            assert all(
                abs(got / want - 1) <= rel * max(loss, 1.0)
                for got, want, loss in zip(run.series(key)[:epochs], expected, losses, strict=True)
            ), key
        else:
            assert run.series(key)[:epochs] == pytest.approx(expected, rel=rel), key


def assert_epoch_metrics(run: OfflineRun, epochs: int) -> None:
    """One history row per epoch, `epoch` 0..epochs-1, each with every key (training and validation together)."""
    assert [row["epoch"] for row in run.history] == list(range(epochs))
    for row in run.history:
        assert set(EPOCH_KEYS) <= set(row), set(EPOCH_KEYS) - set(row)
        assert "trainer/global_step" not in row


# Session runs that several tests read. MLP runs have a global batch of 64, GPT runs of 32.

# Runs that also track every tensor of their first two steps, for the memory plan's peak (test_memory_plan).
TRACKED = "callbacks.memory.tracked_steps=2"
# Each rank counts the bytes of every training batch's collectives (tests/test_step_counts.py).
COUNTED = ["+callbacks.collectives._target_=helpers.probes.CollectiveBytesPerBatch"]


def one_run(name: str, args: list[str], runs_dir: Path, home: Path) -> Path:
    """``python train.py <args>`` into the job dir ``runs_dir/name`` (once a session), which it returns."""
    job_dir = runs_dir / name
    shared_run(runs_dir, name, lambda: train([*args, f"hydra.run.dir={job_dir}"], home).output)
    return job_dir


def two_job_sweep(name: str, args: list[str], runs_dir: Path, home: Path) -> tuple[str, tuple[Path, Path]]:
    """``python train.py -m <args>`` into ``runs_dir/name`` (once a session); returns its output and the dirs of
    jobs 0 and 1."""
    sweep_dir = runs_dir / name
    output = shared_run(
        runs_dir, name, lambda: train(["-m", *args, f"hydra.sweep.dir={sweep_dir}"], home, timeout=400).output
    )
    return output, (sweep_dir / "0", sweep_dir / "1")


@pytest.fixture(scope="session")
def single_run(runs_dir, home):
    """auto on one device, global batch 64."""
    return one_run("single", [*TINY, "data.batch_size=64", TRACKED], runs_dir, home)


@pytest.fixture(scope="session")
def ddp_fsdp_sweep(runs_dir, home):
    """`python train.py -m strategy=ddp,fsdp,pipeline trainer.devices=2`, 32 per device: returns job 0 (ddp) and job 1
    (fsdp). Job 2 (pipeline: one replica of two stages, so a global batch of 32) serves the report's test."""
    result, jobs = two_job_sweep(
        "ddp-fsdp",
        [*TINY, "trainer.devices=2", "data.batch_size=32", "strategy=ddp,fsdp,pipeline", TRACKED, *COUNTED],
        runs_dir,
        home,
    )
    assert "distributed_backend=gloo" in result and "Starting with 2 processes" in result
    assert "sync_dist=True" not in result  # no Lightning advice on every ddp/fsdp run
    # The model summary counts the whole MLP (32*64+64 + 64*32+32 + 32*10+10 = 4,522) under each strategy: the
    # pipeline's rank 0 holds one stage of it
    assert result.count("Total params: 4.5 K") == 3, result
    assert "FLOPs" not in result  # Lightning's column reads 0 without an example input: dropped, not shown as 0
    return jobs


@pytest.fixture(scope="session")
def model_parallel_run(runs_dir, home):
    return one_run(
        "model-parallel", [*TINY, "data.batch_size=64", "strategy=model_parallel", "trainer.devices=2"], runs_dir, home
    )


@pytest.fixture(scope="session")
def pipeline_sweep(runs_dir, home):
    """`-m strategy=pipeline strategy.schedule=gpipe,1f1b trainer.devices=2`: jobs 0 and 1 (precision given as 32,
    Lightning's other spelling of 32-true)."""
    return two_job_sweep(
        "pipeline",
        [
            *TINY,
            "data.batch_size=64",
            "strategy=pipeline",
            "trainer.devices=2",
            "strategy.schedule=gpipe,1f1b",
            "trainer.precision=32",
            TRACKED,
            *COUNTED,
        ],
        runs_dir,
        home,
    )[1]


@pytest.fixture(scope="session")
def gpt_auto(runs_dir, home):
    return one_run("gpt-auto", [*TINY_GPT, "data.batch_size=32", TRACKED], runs_dir, home)


@pytest.fixture(scope="session")
def gpt_ddp_fsdp_sweep(runs_dir, home):
    """The GPT's ddp and fsdp jobs over 2 devices, 16 per device: jobs 0 and 1."""
    output, jobs = two_job_sweep(
        "gpt-ddp-fsdp",
        [*TINY_GPT, "trainer.devices=2", "data.batch_size=16", "strategy=ddp,fsdp", TRACKED],
        runs_dir,
        home,
    )
    assert "sync_dist=True" not in output  # no Lightning advice for the language model's metrics either
    return jobs


# The fused output layer and loss (model.fused_loss), at most 8192 logits a chunk: 64 of the 96-token vocabulary's
# rows (project/models/linear_cross_entropy.py: chunk_rows), so that a device's step of 16 x 16 tokens (ddp, fsdp)
# computes its loss in 4 chunks, and of 32 x 16 (model_parallel) in 8.
GPT_FUSED = [*TINY_GPT, "data.vocab_size=96", "model.fused_loss=true", "model.fused_loss_chunk_logits=8192"]


@pytest.fixture(scope="session")
def gpt_fused_sweep(runs_dir, home):
    """The fused loss under ddp and fsdp over 2 devices, 16 per device: jobs 0 and 1."""
    return two_job_sweep(
        "gpt-fused",
        [*GPT_FUSED, "trainer.devices=2", "data.batch_size=16", "strategy=ddp,fsdp", TRACKED],
        runs_dir,
        home,
    )[1]


@pytest.fixture(scope="session")
def gpt_fused_model_parallel(runs_dir, home):
    """The fused loss in the last of 2 model-parallel stages: the targets go to the head's device."""
    return one_run(
        "gpt-fused-model-parallel",
        [*GPT_FUSED, "trainer.devices=2", "data.batch_size=32", "strategy=model_parallel"],
        runs_dir,
        home,
    )


# LoRA on the tiny GPT's attention projections and MLP (peft's in the reference loop).
GPT_LORA = "model.lora={rank:4,alpha:8,dropout:0.0,targets:[q,v,up]}"


@pytest.fixture(scope="session")
def gpt_lora_auto(runs_dir, home):
    """The GPT with LoRA on one device, 32 a batch; its checkpoints kept (test_lora)."""
    return one_run("gpt-lora-auto", [*TINY_GPT, "data.batch_size=32", GPT_LORA, TRACKED], runs_dir, home)


@pytest.fixture(scope="session")
def gpt_lora_fsdp(runs_dir, home):
    """The GPT with LoRA under fsdp x 2, 16 per device."""
    return one_run(
        "gpt-lora-fsdp",
        [*TINY_GPT, "trainer.devices=2", "data.batch_size=16", "strategy=fsdp", GPT_LORA, TRACKED],
        runs_dir,
        home,
    )


@pytest.fixture(scope="session")
def gpt_lora_tensor_parallel(runs_dir, home):
    """The GPT with LoRA over 2 tensor-parallel ranks, every epoch's checkpoint (the adapters alone) kept."""
    args = [*TINY_GPT, "data.batch_size=32", "strategy=tensor_parallel", "trainer.devices=2", GPT_LORA]
    return one_run("gpt-lora-tp2", [*args, "callbacks.model_checkpoint.save_top_k=-1", TRACKED], runs_dir, home)


@pytest.fixture(scope="session")
def gpt_lora_fsdp_tensor_parallel(gpt_lora_tensor_parallel, runs_dir, home):
    """The GPT with LoRA under FSDP over 2 replicas of 2 tensor-parallel ranks (2D), 16 per replica: resumes
    gpt_lora_tensor_parallel's epoch 0 (its adapters; the base rebuilt) and trains epochs 1 and 2."""
    resume = f"ckpt_path={gpt_lora_tensor_parallel / 'checkpoints' / 'epoch000.ckpt'}"
    args = [*TINY_GPT, "data.batch_size=16", "strategy=fsdp", "trainer.devices=4", "strategy.tensor_parallel_size=2"]
    return one_run("gpt-lora-fsdp2-tp2", [*args, GPT_LORA, resume], runs_dir, home)


@pytest.fixture(scope="session")
def gpt_lora_pipeline_tensor_parallel(gpt_lora_tensor_parallel, runs_dir, home):
    """The GPT with LoRA in 2 pipeline stages, each split over 2 tensor-parallel ranks: resumes
    gpt_lora_tensor_parallel's epoch 1 (its adapters; the base rebuilt) and trains epoch 2."""
    resume = f"ckpt_path={gpt_lora_tensor_parallel / 'checkpoints' / 'epoch001.ckpt'}"
    args = [*TINY_GPT, "data.batch_size=32", "strategy=pipeline", "trainer.devices=4", "strategy.num_stages=2"]
    return one_run("gpt-lora-pp2-tp2", [*args, "strategy.tensor_parallel_size=2", GPT_LORA, resume], runs_dir, home)


@pytest.fixture(scope="session")
def gpt_lora_ddp(runs_dir, home):
    """The GPT with LoRA under ddp x 2, 16 per device."""
    return one_run(
        "gpt-lora-ddp", [*TINY_GPT, "trainer.devices=2", "data.batch_size=16", "strategy=ddp", GPT_LORA], runs_dir, home
    )


@pytest.fixture(scope="session")
def gpt_lora_pipeline(runs_dir, home):
    """The GPT with LoRA in a pipeline of 2 stages (one replica: 32 a batch), 1F1B."""
    return one_run(
        "gpt-lora-pipeline",
        [*TINY_GPT, "trainer.devices=2", "data.batch_size=32", "strategy=pipeline", GPT_LORA],
        runs_dir,
        home,
    )


# A Llama whose Linear weights NF4 can store (multiples of 64 x 256 weights), for QLoRA: 2 query heads of width 128
# sharing 1 key/value head. Under fsdp x 2, the larger weights split into whole blocks; k and v (128 x 128) do not,
# and stay whole on each rank.
TINY_LLAMA_NF4 = [
    *TINY_LLAMA,
    "model.net.dim=128",
    "model.net.num_heads=2",
    "model.net.head_dim=128",
    "model.net.hidden_dim=256",
]
QLORA = "model.lora={rank:4,alpha:8,dropout:0.0,targets:[q,v,up],quantize_base:true}"


@pytest.fixture(scope="session")
def llama_qlora_auto(runs_dir, home):
    """The NF4-sized Llama with QLoRA on one device, 32 a batch, with selective activation checkpointing (whose
    recompute dequantizes the base again)."""
    args = [*TINY_LLAMA_NF4, "data.batch_size=32", QLORA, "model.activation_checkpointing=selective", TRACKED]
    return one_run("llama-qlora-auto", args, runs_dir, home)


@pytest.fixture(scope="session")
def llama_qlora_sweep(runs_dir, home):
    """The NF4-sized Llama with QLoRA on 2 devices, 16 per device: ddp and fsdp (jobs 0 and 1, a global batch of
    32), and a pipeline of 2 stages (job 2: one replica, so a global batch of 16)."""
    _, (ddp, fsdp) = two_job_sweep(
        "llama-qlora",
        [*TINY_LLAMA_NF4, "trainer.devices=2", "data.batch_size=16", QLORA, "strategy=ddp,fsdp,pipeline", TRACKED],
        runs_dir,
        home,
    )
    return ddp, fsdp, ddp.parent / "2"


# A mixture of experts on the same language: 3 blocks, the first dense, then 4 experts and a shared one. Every token
# goes to all 4 (weighted by the router): choosing fewer is discontinuous, and float rounding that differs between
# layouts (how DDP sums gradients) flips near-tied choices, moving the loss by 1e-5 to 1e-4 over 3 epochs. Top-k
# routing is checked against transformers and a per-token loop instead (test_moe).
TINY_MOE = [
    "model=moe",
    *TINY_GPT[1:],
    "model.net.num_layers=3",
    "model.net.dim=32",
    "model.net.num_heads=2",
    "model.net.num_kv_heads=1",
    "model.net.hidden_dim=64",
    "model.net.expert_hidden_dim=48",
    "model.net.first_dense_layers=1",
    "model.net.shared_expert_hidden_dim=32",
    "model.net.experts_per_token=4",
]


@pytest.fixture(scope="session")
def moe_auto(runs_dir, home):
    """The tiny mixture on one device, 32 a batch, its experts scored by sigmoids and each taking at most half a
    batch's tokens (capacity factor 0.5): the first half in token order, the other half's assignments dropped."""
    args = [*TINY_MOE, "data.batch_size=32", "model.net.router_scores=sigmoid", "model.net.capacity_factor=0.5"]
    return one_run("moe-auto", [*args, TRACKED], runs_dir, home)


@pytest.fixture(scope="session")
def moe_sweep(runs_dir, home):
    """The tiny mixture on 2 devices, 16 per device: ddp and fsdp (jobs 0 and 1, a global batch of 32), and a
    pipeline of 2 stages (job 2: one replica, a global batch of 16)."""
    _, (ddp, fsdp) = two_job_sweep(
        "moe",
        [*TINY_MOE, "trainer.devices=2", "data.batch_size=16", "strategy=ddp,fsdp,pipeline", TRACKED],
        runs_dir,
        home,
    )
    return ddp, fsdp, ddp.parent / "2"


# The tiny mixture routing each token to 2 of its 4 experts. The hand-written loop routes as the run does through
# the first epoch, counts to the assignment; later, near-tied choices flip as rounding differs (a few assignments in
# an epoch, as TINY_MOE's note says), so the runs below compare only that epoch.
TINY_MOE_TOP2 = [
    *(arg for arg in TINY_MOE if not arg.startswith("model.net.experts_per_token")),
    "model.net.experts_per_token=2",
]
# With a balance loss weighted 0.1: its gradient shows in the first epoch's experts/balance_loss, which moves by 0.2%
# (far beyond the comparison's 1e-5) when these overrides run with model.net.load_balancing_weight=0.
MOE_BALANCED = [*TINY_MOE_TOP2, "model.net.load_balancing_weight=0.1", "data.batch_size=32"]


@pytest.fixture(scope="session")
def moe_balanced(runs_dir, home):
    """The tiny mixture on one device with top-2 routing and a balance loss weighted 0.1."""
    return one_run("moe-balanced", MOE_BALANCED, runs_dir, home)


# DeepSeek-V3's balancing: sigmoid scores, top 2 of 4, each expert's score bias moved 0.01 a step by the load of both
# ranks' tokens (compared over the first epoch, as MOE_BALANCED).
MOE_BIASED = [*TINY_MOE_TOP2, "model.net.router_scores=sigmoid", "model.net.bias_update_rate=0.01"]


@pytest.fixture(scope="session")
def moe_biased(runs_dir, home):
    """The tiny mixture with DeepSeek-V3's score bias under ddp x 2, 16 per device."""
    return one_run(
        "moe-biased", [*MOE_BIASED, "strategy=ddp", "trainer.devices=2", "data.batch_size=16"], runs_dir, home
    )


# SGD with momentum, whose step is in proportion to the gradient: Adam's is nearly the same whatever the gradient's
# scale, so it would not show a gradient summed over ranks where it should be averaged.
MOE_SGD = [
    *TINY_MOE,
    "model.optimizer._target_=torch.optim.SGD",
    "~model.optimizer.betas",
    "~model.optimizer.fused",
    "model.optimizer.lr=0.3",
    "model.optimizer.weight_decay=0.0",  # (the reference loop decays every parameter under SGD, as its MLP's)
    "+model.optimizer.momentum=0.9",
]


@pytest.fixture(scope="session")
def moe_expert_parallel(runs_dir, home):
    """The tiny mixture's 4 experts split over 2 ranks (strategy.expert_parallel_size=2), 8 per device, under fsdp
    with SGD: on 2 devices (job 0, a global batch of 16: each rank holds 2 experts) and on 4 (job 1, a global batch
    of 32: each pair of ranks also shards its experts with FSDP). Every rank counts its collectives."""
    ep = [*MOE_SGD, "strategy=fsdp", "strategy.expert_parallel_size=2", "data.batch_size=8", TRACKED, *COUNTED]
    return two_job_sweep("moe-ep", [*ep, "trainer.devices=2,4"], runs_dir, home)[1]


@pytest.fixture(scope="session")
def moe_expert_parallel_capped(runs_dir, home):
    """The tiny mixture's experts split over 2 ranks, 8 per device, each expert taking at most half of a forward's
    assignments (capacity factor 0.5), where the tokens are routed: on each rank, of its own tokens."""
    ep = ["strategy=fsdp", "strategy.expert_parallel_size=2", "trainer.devices=2", "model.net.capacity_factor=0.5"]
    return one_run("moe-ep-capped", [*MOE_SGD, *ep, "data.batch_size=8"], runs_dir, home)


@pytest.fixture(scope="session")
def moe_pipeline_expert_parallel(runs_dir, home):
    """The tiny mixture in a pipeline of 2 stages, 2 replicas of it whose ranks split each stage's experts in two
    (strategy.expert_parallel_size=2), 8 per replica, SGD: a global batch of 16. Every rank counts its collectives."""
    pipeline = ["strategy=pipeline", "strategy.num_stages=2", "strategy.expert_parallel_size=2", "trainer.devices=4"]
    return one_run("moe-pipeline-ep", [*MOE_SGD, *pipeline, "data.batch_size=8", TRACKED, *COUNTED], runs_dir, home)


@pytest.fixture(scope="session")
def gpt_fsdp_selective(runs_dir, home):
    """The GPT under fsdp x 2 with selective activation checkpointing (torchtitan's per-op policy), 16 per device."""
    return one_run(
        "gpt-fsdp-selective",
        [
            *TINY_GPT,
            "trainer.devices=2",
            "data.batch_size=16",
            "strategy=fsdp",
            "model.activation_checkpointing=selective",
            TRACKED,
        ],
        runs_dir,
        home,
    )


@pytest.fixture(scope="session")
def gpt_split_selective_sweep(runs_dir, home):
    """Selective activation checkpointing where the blocks are split: a pipeline of 2 stages (1f1b) and tensor
    parallelism over 2 ranks (its sequence-parallel reduce-scatters among the outputs kept), each one replica of
    32: jobs 0 and 1."""
    return two_job_sweep(
        "gpt-split-selective",
        [
            *TINY_GPT,
            "trainer.devices=2",
            "data.batch_size=32",
            "strategy=pipeline,tensor_parallel",
            "model.activation_checkpointing=selective",
            TRACKED,
        ],
        runs_dir,
        home,
    )[1]


@pytest.fixture(scope="session")
def gpt_pipeline_compiled(runs_dir, home):
    """The GPT's blocks compiled (model.compile=true) and split into pipeline stages (1f1b)."""
    return one_run(
        "gpt-pipeline-compiled",
        [*TINY_GPT, "trainer.devices=2", "data.batch_size=32", "strategy=pipeline", "model.compile=true"],
        runs_dir,
        home,
    )


@pytest.fixture(scope="session")
def llama_auto(runs_dir, home):
    return one_run("llama-auto", [*TINY_LLAMA, "data.batch_size=32"], runs_dir, home)


@pytest.fixture(scope="session")
def llama_fsdp(runs_dir, home):
    return one_run(
        "llama-fsdp", [*TINY_LLAMA, "trainer.devices=2", "data.batch_size=16", "strategy=fsdp", TRACKED], runs_dir, home
    )


# The tiny Llama under fsdp x 2 in bf16-mixed, in bfloat16 (job 0) and with its blocks' Linear layers in Float8
# (job 1: torchao, emulated on the CPU; its weights all-gathered in float8). Every width is a multiple of 16. The
# schedule is set in steps (3 epochs of 8), so that a run stopped after one epoch and resumed follows it too.
FLOAT8 = [*TINY_LLAMA, "trainer.devices=2", "data.batch_size=16", "strategy=fsdp", "trainer.precision=bf16-mixed"]
FLOAT8 += ["model.float8.small_layers=true"]  # its layers are all small: converted all the same
FLOAT8 += ["model.scheduler.total_steps=24", "model.scheduler.warmup_steps=2", "model.scheduler.warmup_fraction=null"]


@pytest.fixture(scope="session")
def llama_float8_sweep(runs_dir, home):
    return two_job_sweep(
        "llama-float8", [*FLOAT8, "model.float8.enabled=false,true", TRACKED, *COUNTED], runs_dir, home
    )[1]


@pytest.fixture(scope="session")
def llama_split_sweep(runs_dir, home):
    """The Llama's model_parallel and pipeline (1f1b) jobs over 2 devices: jobs 0 and 1."""
    return two_job_sweep(
        "llama-split",
        [*TINY_LLAMA, "trainer.devices=2", "data.batch_size=32", "strategy=model_parallel,pipeline", TRACKED],
        runs_dir,
        home,
    )[1]


# Tensor parallelism: the tiny GPT in its three layouts, each with the global batch of 32 of gpt_auto.


@pytest.fixture(scope="session")
def gpt_tensor_parallel(runs_dir, home):
    """strategy=tensor_parallel over 2 devices, every epoch's checkpoint kept (the layouts' resume chain)."""
    return one_run(
        "gpt-tp2",
        [
            *TINY_GPT,
            "data.batch_size=32",
            "strategy=tensor_parallel",
            "trainer.devices=2",
            "callbacks.model_checkpoint.save_top_k=-1",
            TRACKED,
            *COUNTED,
        ],
        runs_dir,
        home,
    )


# The two 4-device layouts go on from the previous layout's checkpoint rather than train from scratch: each is one
# run fewer for the suite, and their resumes are the test that a checkpoint moves between layouts. The first epoch
# each trains:
FIRST_EPOCH = {
    "gpt_fsdp_tensor_parallel": 1,
    "gpt_pipeline_tensor_parallel": 2,
    "gpt_lora_fsdp_tensor_parallel": 1,
    "gpt_lora_pipeline_tensor_parallel": 2,
}


@pytest.fixture(scope="session")
def gpt_fsdp_tensor_parallel(gpt_tensor_parallel, runs_dir, home):
    """FSDP over 2 replicas of 2 tensor-parallel ranks (2D), 16 per replica: resumes gpt_tensor_parallel's epoch 0
    (each rank reads its shard of its slices) and trains epochs 1 and 2, each one's checkpoint kept."""
    return one_run(
        "gpt-fsdp2-tp2",
        [
            *TINY_GPT,
            "data.batch_size=16",
            "strategy=fsdp",
            "trainer.devices=4",
            "strategy.tensor_parallel_size=2",
            f"ckpt_path={gpt_tensor_parallel / 'checkpoints' / 'epoch000.ckpt'}",
            "callbacks.model_checkpoint.save_top_k=-1",
            TRACKED,
            *COUNTED,
        ],
        runs_dir,
        home,
    )


@pytest.fixture(scope="session")
def gpt_pipeline_tensor_parallel(gpt_fsdp_tensor_parallel, runs_dir, home):
    """2 pipeline stages, each split over 2 tensor-parallel ranks (pipeline x tensor parallel): resumes
    gpt_fsdp_tensor_parallel's epoch 1 and trains epoch 2."""
    return one_run(
        "gpt-pp2-tp2",
        [
            *TINY_GPT,
            "data.batch_size=32",
            "strategy=pipeline",
            "trainer.devices=4",
            "strategy.num_stages=2",
            "strategy.tensor_parallel_size=2",
            f"ckpt_path={gpt_fsdp_tensor_parallel / 'checkpoints' / 'epoch001.ckpt'}",
            TRACKED,
            *COUNTED,
        ],
        runs_dir,
        home,
    )


@pytest.fixture(scope="session")
def llama_tensor_parallel(runs_dir, home):
    """The Llama over 2 tensor-parallel ranks: 2 query heads and 1 key/value head each (fsdp x tensor parallel: the
    GPT's)."""
    return one_run(
        "llama-tp2",
        [*TINY_LLAMA_TP, "data.batch_size=32", "strategy=tensor_parallel", "trainer.devices=2", TRACKED],
        runs_dir,
        home,
    )


@pytest.fixture(scope="session")
def llama_tensor_parallel_compiled(runs_dir, home):
    """The same, its blocks compiled (model.compile=true): the first block's input is the stem's reduce-scattered
    share, a collective's pending result, which torch 2.13's compiled backward did not take."""
    return one_run(
        "llama-tp2-compiled",
        [*TINY_LLAMA_TP, "data.batch_size=32", "strategy=tensor_parallel", "trainer.devices=2", "model.compile=true"],
        runs_dir,
        home,
    )


def qwen_tensor_parallel(family: str, runs_dir: Path, home: Path) -> Path:
    """model=<family> over 2 tensor-parallel ranks (sequence parallel): each rank with its heads' biases (qwen2),
    or its heads normalised by the norms' one weight (qwen3)."""
    args = [f"model={family}", *TINY_QWEN, "data.batch_size=32", "strategy=tensor_parallel", "trainer.devices=2"]
    return one_run(f"{family}-tp2", [*args, TRACKED], runs_dir, home)


@pytest.fixture(scope="session")
def qwen2_tensor_parallel(runs_dir, home):
    return qwen_tensor_parallel("qwen2", runs_dir, home)


@pytest.fixture(scope="session")
def qwen3_tensor_parallel(runs_dir, home):
    return qwen_tensor_parallel("qwen3", runs_dir, home)


@pytest.fixture(scope="session")
def mlp_tensor_parallel(runs_dir, home):
    """The MLP over 2 tensor-parallel ranks: its first pair of layers split, the classifier whole on each."""
    return one_run(
        "mlp-tp2",
        [*TINY, "data.batch_size=64", "strategy=tensor_parallel", "trainer.devices=2", TRACKED],
        runs_dir,
        home,
    )
