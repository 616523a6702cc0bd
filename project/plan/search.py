"""What is the fastest way to train this? ``plan=search``: every layout of the job's devices, each simulated (its
memory plan, with its FLOPs and collective bytes) and timed by the step-time model on ``cluster``, ranked.

The layouts: each strategy's own (``Layout.search_space``: DDP's one, FSDP's tensor-parallel sizes, a pipeline's
sizes, schedules and micro-batches), each with activation checkpointing off, selective and full, each at the
config's global batch (``data.batch_size`` per replica x replicas x ``trainer.accumulate_grad_batches``) cut into
the layout's replicas. Those that fail the run's checks are dropped. A deep model's plans are extended from
shallow copies (``project.plan.depth``), and the layout named fastest is simulated whole before it is named. The
simulations run in parallel, one process per core, and are cached on disk (``${paths.cache_dir}/plan_cache``:
``~/.cache/project`` by default, shared by every search wherever it is launched), keyed by everything a simulation
reads and the project's source.

Branch and bound (``plan_search.prune``): the layouts without a pipeline bubble are simulated first. A layout's
devices share the step's FLOPs, so none can be faster than its share of them at the cluster's efficiency, stretched
by its bubble (``throughput_bound``). Those whose bound is below the fastest layout that fits are left out, not
simulated; the others are simulated, and the test repeats until none is left that could beat the fastest. A layout
is simulated only up to the first moment a device holds more than the GPU's memory: it cannot be the answer.
"""

import ctypes
import hashlib
import json
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from project.config.build import overrides, with_strategy
from project.job.cluster import Cluster
from project.job.job import Job, Setting
from project.job.rules import layout_problem
from project.options.errors import ConfigError, made_dir
from project.parallel.parallelize import Checkpointing
from project.plan.depth import extrapolated_plan
from project.plan.memory_plan import MemoryPlan, _size, device_capacity, plan_memory, with_checkpointing
from project.plan.simulate import DevicePlan, GenerationPlan
from project.plan.step_time import StepTime, compute_floor, predict_step, throughput_bound, throughput_unit

SEARCHABLE = ("ddp", "fsdp", "pipeline")  # the strategy group's options a search can lay out (conf/strategy)
CHECKPOINTING_MODES: tuple[Checkpointing, ...] = ("off", "selective", "full")  # each layout is tried with each
PR_SET_PDEATHSIG = 1  # prctl(2)'s option: the signal a process gets when its parent dies
SOURCE = Path(__file__).resolve().parents[1]  # the project package: a change to it invalidates the cache


@dataclass
class Candidate:
    """One layout the search tries: the overrides that make it (as a user types them), its job, and its overrides
    but activation checkpointing's (what it shares with its twin, checkpointing the other way)."""

    overrides: str
    job: Job
    apart_from_checkpointing: str
    plan: MemoryPlan | None = None
    extrapolated: bool = False  # the plan extended from shallow copies (project.plan.depth), not simulated whole
    time: StepTime | None = None  # predicted from its plan, unless partial
    bound: float | None = None  # not simulated, or partial: the most tokens/s per device it could reach


def candidate_layouts(job: Job) -> Iterator[Candidate]:
    """Every layout of ``job``'s devices at its global batch that can run (``layout_problem``)."""
    batch = job.global_batch
    named = {Setting.STRATEGY, Setting.BATCH_SIZE} | ({Setting.ACCUMULATE} if job.accumulate != 1 else set())
    for name in job.search.strategies:
        base = with_strategy(job, name)
        for change in base.layout.search_space(base, batch):
            # The model's activation checkpointing says it for every layout: a layout's own (FSDP's) is off.
            layout = change.job.layout.with_activation_checkpointing("off")
            for checkpointing in CHECKPOINTING_MODES:
                laid_out = replace(with_checkpointing(change.job, checkpointing), layout=layout, accumulate=1)
                if layout_problem(laid_out) is not None or laid_out.global_batch != batch:
                    continue
                sets = change.sets | named
                apart = overrides(laid_out, sets)
                yield Candidate(overrides(laid_out, sets | {Setting.ACTIVATION_CHECKPOINTING}), laid_out, apart)


def why_unlaid(job: Job, name: str) -> ConfigError:
    """Why strategy option ``name`` lays out none of ``candidate_layouts``: the first rule its layouts break."""
    base = with_strategy(job, name)
    changes = base.layout.search_space(base, job.global_batch)
    problem = next(filter(None, (layout_problem(change.job) for change in changes)), None) or layout_problem(base)
    return problem or ConfigError(
        "data.batch_size",
        f"gives a global batch of {job.global_batch}, which none of its layouts of {job.world_size} device(s) keeps.",
        "choose a global batch its ranks divide.",
    )


def _source_digest() -> str:
    digest = hashlib.sha256(torch.__version__.encode())
    for path in sorted(SOURCE.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def cache_key(job: Job, source: str) -> str:
    """What the simulation reads of ``job`` (``Job.simulation_key``) and the project's ``source`` digest, hashed."""
    return hashlib.sha256(json.dumps([job.simulation_key(), source]).encode()).hexdigest()[:32]


def _simulate(job: Job, whole: bool) -> dict[str, Any]:
    """In a worker process: the plan of ``job``'s layout, as JSON, from its shallow copies where they are on a line
    and cheaper, else (or if ``whole``) simulated whole, device by device up to the first moment one does not fit (a
    layout that does not fit cannot be the answer)."""
    torch.set_num_threads(1)  # fake tensors compute nothing; one core per worker
    plan = None if whole else extrapolated_plan(job)
    simulated = plan or plan_memory(job, suggest=False, stop_over_capacity=True)
    return {"plan": simulated.to_json(), "extrapolated": plan is not None}


def _plan_of(saved: dict[str, Any]) -> MemoryPlan:
    fields = {name: saved[name] for name in MemoryPlan.__dataclass_fields__}
    generation = saved["generation"]
    if generation is not None:
        names = ("gather", "prompt_pass", "token_pass", "reference_pass")
        passes = {name: DevicePlan(**generation[name]) for name in names if generation.get(name) is not None}
        generation = GenerationPlan(**{**generation, **passes})
    devices = [DevicePlan(**device) for device in saved["devices"]]
    return MemoryPlan(**{**fields, "devices": devices, "generation": generation})


def _keep(candidate: Candidate, saved: dict[str, Any]) -> None:
    candidate.plan, candidate.extrapolated = _plan_of(saved["plan"]), saved["extrapolated"]


def from_cache(
    candidates: list[Candidate], cache_dir: Path, capacity: int, whole: bool = False
) -> dict[str, list[Candidate]]:
    """Each layout's plan from the cache where it is there (``whole``: simulated whole) and holds for a device of
    ``capacity`` bytes (a partial plan only says its layout needs more than its peak); returns the others, by the
    file their plan will be cached in."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    source = _source_digest()
    missing: dict[str, list[Candidate]] = {}
    for candidate in candidates:
        path = cache_dir / f"{cache_key(candidate.job, source)}{'-whole' if whole else ''}.json"
        saved = json.loads(path.read_text()) if path.exists() else None
        if saved is not None and not (saved["plan"]["partial"] and saved["plan"]["peak"] <= capacity):
            _keep(candidate, saved)
        else:
            missing.setdefault(path.name, []).append(candidate)
    return missing


def _end_with_parent() -> None:
    """A worker gets SIGTERM when the search's process dies (Linux's parent-death signal): a search killed outright
    (SIGTERM's default, SIGKILL) runs no cleanup, and its workers would go on simulating for minutes."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class Simulations:
    """The search's plans: from the cache, or simulated in ``workers`` processes, started at the first simulation
    (none when every plan is cached) and kept for the search's rounds. Spawned: a forked worker would inherit this
    process's torch threads and Hydra's state."""

    def __init__(self, cache_dir: Path, capacity: int, workers: int) -> None:
        self.cache_dir, self.capacity, self.workers = cache_dir, capacity, workers
        self.simulated = 0  # how many plans were simulated rather than read from the cache
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> "Simulations":
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)

    def run(self, candidates: list[Candidate], whole: list[Candidate]) -> None:
        """Each layout's plan, and that of each in ``whole`` simulated whole (not extrapolated), with a progress
        bar."""
        missing = [
            (name, same, simulated_whole)
            for group, simulated_whole in ((candidates, False), (whole, True))
            for name, same in from_cache(group, self.cache_dir, self.capacity, simulated_whole).items()
        ]
        if not missing:
            return
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                self.workers, mp_context=multiprocessing.get_context("spawn"), initializer=_end_with_parent
            )
        futures = {
            self._pool.submit(_simulate, same[0].job, simulated_whole): (name, same)
            for name, same, simulated_whole in missing
        }
        bar = tqdm(total=len(futures), desc="Simulating layouts", unit="layout", leave=False)
        for future in as_completed(futures):
            name, same = futures[future]
            saved = future.result()
            (self.cache_dir / name).write_text(json.dumps(saved))
            for candidate in same:
                _keep(candidate, saved)
            bar.update()
        bar.close()
        self.simulated += len(missing)


def rank_layouts(candidates: list[Candidate], cluster: Cluster, capacity: int) -> list[Candidate]:
    """Each layout's step time; those that fit first, fastest first (the smaller peak first among equals), then
    the others (a partial plan by its ``bound``)."""
    for candidate in candidates:
        assert candidate.plan is not None
        # A partial plan's step was not simulated through (the fastest's whole simulation may stop too).
        candidate.time = None if candidate.plan.partial else predict_step(candidate.plan, candidate.job, cluster)

    def order(candidate: Candidate) -> tuple[bool, float, int]:
        assert candidate.plan is not None
        throughput = candidate.time.tokens_per_device_per_s if candidate.time else candidate.bound or 0.0
        return candidate.plan.peak > capacity, -throughput, candidate.plan.peak

    return sorted(candidates, key=order)


@dataclass
class Search:
    """A search's outcome: the layouts simulated, ranked; those left out as slower than the fastest that fits
    (each with its ``bound``); on which cluster, a device's bytes, how many layouts were simulated (the others
    came from the cache), in how many seconds; and why each strategy option with no layout here has none."""

    ranked: list[Candidate]
    pruned: list[Candidate]
    cluster: Cluster
    capacity: int = 0
    simulated: int = 0
    seconds: float = 0.0
    unlaid: dict[str, str] = field(default_factory=dict)

    def fastest_fitting(self, capacity: int | None = None) -> Candidate | None:
        """The first of the ranked layouts that fits in ``capacity`` bytes (the search's device's when None)."""
        capacity = self.capacity if capacity is None else capacity
        return next(
            (candidate for candidate in self.ranked if candidate.plan and candidate.plan.peak <= capacity), None
        )


def writable_cache(path: Path) -> Path:
    """``path``, created; refused (naming ``paths.cache_dir``) where it cannot be created or written."""
    fix = "set paths.cache_dir to a dir you can write to (or XDG_CACHE_HOME, which it defaults under)."
    return made_dir("paths.cache_dir", path, fix)


def search(job: Job, workers: int | None = None) -> Search:
    """``plan=search``: the layouts of ``job``'s devices, simulated (``workers`` processes: one per core) and
    ranked."""
    start = time.perf_counter()
    cluster = job.cluster
    if cluster is None:
        raise ConfigError(
            "cluster",
            "is not set: plan=search predicts step times on a cluster's GPUs and network.",
            "choose one: cluster=h100_sxm_8x, h200_8x or a100_80g_8x (conf/cluster), and override its keys as needed.",
        )
    unknown = sorted(set(job.search.strategies) - set(SEARCHABLE))
    if unknown:
        raise ConfigError(
            "plan_search.strategies",
            f"names {', '.join(unknown)}, which plan=search cannot lay out.",
            f"choose among {', '.join(SEARCHABLE)}, e.g. plan_search.strategies=[fsdp,pipeline].",
        )
    candidates = list(candidate_layouts(job))
    if not candidates:
        whys = {name: why_unlaid(job, name) for name in job.search.strategies}
        raise ConfigError(
            "plan_search.strategies",
            f"is {list(job.search.strategies)}, which lays out no layout of the job's {job.world_size} device(s) "
            f"(plan_search.max_pipeline_ranks={job.search.max_pipeline_ranks})."
            + "".join(f" strategy={name}: {why.key} {why.problem}" for name, why in whys.items()),
            "search more strategies, e.g. plan_search.strategies=[ddp,fsdp,pipeline]"
            + "".join(f"; for strategy={name}: {why.fix.rstrip('.')}" for name, why in whys.items())
            + ".",
        )
    cache, workers = writable_cache(job.plan_cache), workers or os.cpu_count() or 1
    capacity, _ = device_capacity(job)
    from_cache(candidates, cache, capacity)
    # Without pruning, every layout; with it, first those without a bubble, then those that could still be faster.
    waiting = [
        candidate for candidate in candidates if not job.search.prune or candidate.job.layout.bubble_fraction() == 0
    ]
    to_check: list[Candidate] = []
    with Simulations(cache, capacity, workers) as simulations:
        while True:
            simulations.run([candidate for candidate in waiting if candidate.plan is None], to_check)
            set_bounds(candidates, cluster)
            found = Search(
                rank_layouts([candidate for candidate in candidates if candidate.plan], cluster, capacity), [], cluster
            )
            fastest = found.fastest_fitting(capacity)
            # The fastest that fits is simulated whole before it is named (an extrapolated peak may miss a late
            # rise), beside the layouts that could beat it: its throughput is the same either way.
            to_check = [fastest] if fastest is not None and fastest.extrapolated else []
            waiting = unbeaten(candidates, fastest)
            if not waiting and not to_check:
                break
    found.pruned = sorted(
        (candidate for candidate in candidates if candidate.plan is None), key=lambda candidate: -(candidate.bound or 0)
    )
    laid = {candidate.job.strategy_name for candidate in candidates}
    found.unlaid = {name: str(why_unlaid(job, name)) for name in job.search.strategies if name not in laid}
    found.simulated, found.seconds, found.capacity = simulations.simulated, time.perf_counter() - start, capacity
    return found


def set_bounds(candidates: list[Candidate], cluster: Cluster) -> None:
    """Sets the ``bound`` of each layout not simulated, or simulated only in part: its ``throughput_bound`` at the
    least ``compute_floor`` per device (in proportion to its FLOPs) of any layout simulated through with its
    activation checkpointing (every layout computes the same step: at the same global batch, its devices share its
    FLOPs; checked in ``tests/test_plan_search.py``), if there is one."""
    least: dict[Checkpointing, float] = {}
    for candidate in candidates:
        if candidate.plan is not None and not candidate.plan.partial:
            devices = candidate.plan.devices
            mean = sum(compute_floor(device, cluster) for device in devices) / len(devices)
            checkpointing = candidate.job.activation_checkpointing
            least[checkpointing] = min(mean, least.get(checkpointing, mean))
    for candidate in candidates:
        floor = least.get(candidate.job.activation_checkpointing)
        if (candidate.plan is None or candidate.plan.partial) and floor is not None:
            candidate.bound = throughput_bound(candidate.job, cluster, floor)


def unbeaten(candidates: list[Candidate], fastest: Candidate | None) -> list[Candidate]:
    """The layouts not simulated that could be faster than ``fastest`` (the fastest that fits so far): those
    without a ``bound`` (``set_bounds``), and those whose bound is above its throughput."""
    if fastest is None or fastest.time is None:
        return [candidate for candidate in candidates if candidate.plan is None]
    return [
        candidate
        for candidate in candidates
        if candidate.plan is None
        and (candidate.bound is None or candidate.bound > fastest.time.tokens_per_device_per_s)
    ]


def format_search(job: Job, found: Search) -> str:
    """The ranked table and the overrides of the fastest layout that fits."""
    ranked, cluster, capacity = found.ranked, found.cluster, found.capacity
    unit = throughput_unit(job)
    world = job.world_size
    lines = [
        f"Layouts of {world} {cluster.name} GPU(s) ({job.devices} x {job.nodes} node(s)), "
        f"model={job.model.name}, global batch {job.global_batch}, ranked by predicted "
        f"{unit}/s per GPU ({len(ranked) + len(found.pruned)} layouts, {found.simulated} simulated, "
        f"{len(found.pruned)} bounded, the others cached; {found.seconds:.0f} s):"
    ]
    columns = ["#", f"{unit}/s/GPU", "MFU", "step s", "bubble s", "exposed comm s", "peak", "fits", "overrides"]
    rows = []
    for index, candidate in enumerate(ranked, 1):
        assert candidate.plan is not None
        if candidate.plan.partial:
            throughput = "-" if candidate.bound is None else f"<={candidate.bound:,.0f}"
            peak = f">={_size(candidate.plan.peak)}"
            rows.append([str(index), throughput, "-", "-", "-", "-", peak, "no", candidate.overrides])
            continue
        step = candidate.time
        assert step is not None
        rows.append(
            [
                str(index),
                f"{step.tokens_per_device_per_s:,.0f}",
                f"{100 * step.mfu:.1f}%",
                f"{step.seconds:.3g}",
                f"{step.bubble:.2g}",
                f"{step.exposed_communication:.2g}",
                ("~" if candidate.extrapolated else "") + _size(candidate.plan.peak),
                "yes" if candidate.plan.peak <= capacity else "no",
                candidate.overrides,
            ]
        )
    for index, candidate in enumerate(found.pruned, len(rows) + 1):
        assert candidate.bound is not None
        rows.append([str(index), f"<={candidate.bound:,.0f}", "-", "-", "-", "-", "-", "-", candidate.overrides])
    widths = [max(len(row[i]) for row in rows + [columns]) for i in range(len(columns))]
    lines.append("  ".join(name.rjust(width) for name, width in zip(columns[:-1], widths)) + "  " + columns[-1])
    lines += ["  ".join(cell.rjust(width) for cell, width in zip(row[:-1], widths)) + "  " + row[-1] for row in rows]
    if any(candidate.extrapolated for candidate in ranked):
        lines.append("~: extended from copies of 3 to 5 blocks a stage, not simulated whole (docs/step-time.md).")
    if any(candidate.plan and candidate.plan.partial for candidate in ranked):
        lines.append(
            ">=: simulated up to the first moment a device held more than the GPU's memory, so the peak is at "
            "least this; its throughput at most its share of the step's FLOPs with its bubble (<=)."
        )
    if found.pruned:
        lines.append(
            "<=: not simulated (plan_search.prune): even with no communication exposed, its share of the step's FLOPs "
            "and its bubble make it slower than the fastest that fits. plan_search.prune=false simulates it."
        )
    lines += [f"Not ranked: strategy={name}: {why}" for name, why in found.unlaid.items()]
    fastest = found.fastest_fitting()
    if fastest is not None:
        lines.append(f"Fastest that fits in {_size(capacity)}: {fastest.overrides}")
    else:
        lines.append(f"No layout of {world} GPU(s) fits in {_size(capacity)}: more nodes or a smaller batch may.")
    return "\n".join(lines)


def suggest_fastest(plan: MemoryPlan, job: Job) -> None:
    """With a ``cluster``, a plan that does not fit suggests the fastest layout of the job's devices that fits
    (``plan=search``'s), rather than the smallest change."""
    if plan.fits or job.cluster is None:
        return
    fastest = search(job).fastest_fitting()
    if fastest is not None:
        plan.suggestion, plan.suggested_as = fastest.overrides, f"Fastest layout that fits on {job.cluster.name}"
