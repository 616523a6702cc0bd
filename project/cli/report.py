"""One self-contained HTML report of runs and sweeps, readable offline:
``python -m project.cli.report <run or sweep dirs...> [--by KEY] [--output FILE]``.

It reads what every job writes whatever the logger: ``result.json`` (rank 0's record: every epoch's metrics, the
latest epoch's memory and throughput per device, status, runtime) and ``config.yaml`` (the resolved config). The
charts are Plotly's, with plotly.js inlined once, so the file needs no network.
"""

import argparse
import html
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
from omegaconf import OmegaConf
from plotly.colors import qualitative, sample_colorscale

from project.cli.usage import run_cli
from project.launch.results import RESULT_FILE, sweep_rows
from project.options.errors import ConfigError, check_writable

# Curves drawn when the runs logged them, one chart each.
CURVES = [
    "train/loss",
    "val/loss",
    "train/acc",
    "val/acc",
    "val/perplexity",
    "experts/balance_loss",  # a mixture of experts' routing (project.model_options.expert_balancing.ExpertLoad)
    "experts/imbalance",
    # DPO's (project.tasks.dpo.PAIR_METRICS, TRL's names; its loss above), spelt out: importing the task would import
    # torch into the report.
    *(
        f"{split}/{name}"
        for name in ("rewards/margins", "rewards/accuracies", "rewards/chosen", "rewards/rejected")
        + ("logps/chosen", "logps/rejected")
        for split in ("train", "val")
    ),
]
EXPERT_LOAD = "experts/load/"  # experts/load/<e>: expert e's share of a mixture's assignments in the epoch
FLOOR = "data/entropy_floor"  # drawn on the loss charts: the best loss the data allows


@dataclass
class Job:
    """One job of the report: its dir, result.json, resolved config and legend label."""

    dir: Path
    result: dict[str, Any]
    config: Any
    label: str = ""
    group: str = ""  # the value of the --by key: runs with the same value share a colour


def find_jobs(paths: list[Path]) -> list[Job]:
    """Each path is a job dir (it has a result.json) or a sweep dir (its job subdirs do), in job order."""
    jobs = []
    for path in paths:
        if not path.is_dir():
            raise ConfigError(
                "paths",
                f"{path} is not a directory.",
                "give job dirs (each with a result.json) or sweep dirs, e.g. logs/train/runs/<date_time>.",
            )
        dirs = [path] if (path / RESULT_FILE).is_file() else [path / row["job"] for row in sweep_rows(path)]
        for job_dir in dirs:
            if (job_dir / RESULT_FILE).is_file() and (job_dir / "config.yaml").is_file():
                try:
                    result = json.loads((job_dir / RESULT_FILE).read_text())
                    jobs.append(Job(job_dir, result, OmegaConf.load(job_dir / "config.yaml")))
                except Exception as error:  # a truncated file: the report shows the others and names this one
                    print(f"Left out {job_dir}: {' '.join(str(error).split())[:200]}", file=sys.stderr)
    if not jobs:
        raise ConfigError(
            "paths",
            f"{', '.join(map(str, paths))} holds no job with a {RESULT_FILE} and config.yaml.",
            "give job dirs or sweep dirs that training wrote (a job writes result.json as it ends each epoch).",
        )
    return jobs


def label_jobs(jobs: list[Job], by: str | None) -> None:
    """Legend labels: the overrides that differ between the jobs (the dir name where none do); the colour group
    is the value of ``by`` (a config key such as ``model.optimizer.lr``, or a config group such as ``strategy``),
    each job its own for ``objective``."""
    overrides = [list(job.config.get("overrides", [])) for job in jobs]
    shared = set.intersection(*(set(items) for items in overrides))
    for job, items in zip(jobs, overrides):
        differing = " ".join(item for item in items if item not in shared)
        job.label = f"{job.dir.name}: {differing}" if differing else str(job.dir)
        if by and by != OBJECTIVE:
            value = OmegaConf.select(job.config, f"choices.{by}", default=None)
            job.group = str(value if value is not None else OmegaConf.select(job.config, by, default="(unset)"))
        else:
            job.group = job.label


OBJECTIVE = "objective"  # --by objective: a colour scale from the best objective to the worst
SCALE = "Viridis"  # dark to bright, so the order reads in grey too; the best is the dark end
NO_OBJECTIVE = "#aaaaaa"  # a job that logged no objective (it failed before its first validation)


def colours(jobs: list[Job], by: str | None) -> dict[str, str]:
    """A colour per group: qualitative, or along ``SCALE`` by the job's objective for ``by=objective``."""
    if by != OBJECTIVE:
        palette = qualitative.Plotly
        groups = list(dict.fromkeys(job.group for job in jobs))
        return {group: palette[index % len(palette)] for index, group in enumerate(groups)}
    place = objective_places(jobs)
    return {
        job.group: NO_OBJECTIVE
        if job.result.get("objective") is None
        else sample_colorscale(SCALE, place[job.result["objective"]])[0]
        for job in jobs
    }


def objective_places(jobs: list[Job]) -> dict[float, float]:
    """Each objective's place on the colour scale, 0 for the best to 1 for the worst, by rank: one diverged trial
    whose loss is 100 times the others' would otherwise leave them all one colour."""
    values = {job.result["objective"] for job in jobs if job.result.get("objective") is not None}
    ranked = sorted(values, reverse=jobs[0].result.get("mode") == "max")  # best first
    return {value: index / max(1, len(ranked) - 1) for index, value in enumerate(ranked)}


def colour_bar(jobs: list[Job]) -> go.Scatter:
    """An invisible trace that draws the objective's colour bar beside a chart, its ticks labelled with the
    objectives at those places (at most 6)."""
    place = objective_places(jobs)
    ticks = [value for index, value in enumerate(place) if index % math.ceil(len(place) / 6) == 0]
    metric = next((job.result.get("metric") for job in jobs if job.result.get("metric")), OBJECTIVE)
    return go.Scatter(
        x=[None],
        y=[None],
        mode="markers",
        showlegend=False,
        hoverinfo="skip",
        marker={
            "colorscale": SCALE,
            "cmin": 0,
            "cmax": 1,
            "color": [0],
            "showscale": True,
            "colorbar": {
                "title": {"text": f"{metric}<br>(by rank)"},
                "tickvals": [place[value] for value in ticks],
                "ticktext": [f"{value:.4g}" for value in ticks],
                "len": 0.6,
            },
        },
    )


DASHES = ["solid", "dash", "dot", "dashdot"]  # runs with the same numbers (ddp and fsdp) stay visible on one another


def curve_figure(metric: str, jobs: list[Job], colour: dict[str, str], by: str | None) -> go.Figure:
    figure = go.Figure()
    for index, job in enumerate(jobs):
        rows = [row for row in job.result.get("history", []) if metric in row]
        figure.add_scatter(
            x=[row["epoch"] for row in rows],
            y=[row[metric] for row in rows],
            mode="lines+markers",
            name=job.label,
            legendgroup=job.group,
            line={"color": colour[job.group], "dash": DASHES[index % len(DASHES)]},
        )
    if by == OBJECTIVE and objective_places(jobs):
        figure.add_trace(colour_bar(jobs))
    last_epoch = max((row["epoch"] for job in jobs for row in job.result.get("history", [])), default=0)
    floors = {row[FLOOR] for job in jobs for row in job.result.get("history", []) if FLOOR in row}
    if metric.endswith("/loss") and len(floors) == 1:
        figure.add_hline(y=floors.pop(), line_dash="dash", annotation_text="entropy floor")
    figure.update_layout(
        title=metric,
        xaxis_title="epoch",
        yaxis_title=metric,
        height=420,
        showlegend=True,
        legend={"orientation": "h", "y": -0.25},
        # A tick at each whole epoch (at most about 10 ticks): Plotly's own choice for 2 epochs is 0, 0.2, ... 1,
        # which "d" prints as 0 0 0 1 1 1.
        xaxis={"tickformat": "d", "tick0": 0, "dtick": max(1, math.ceil(last_epoch / 10))},
    )
    return figure


def expert_load_figure(job: Job) -> go.Figure | None:
    """A mixture of experts' load over the epochs: a heatmap of each expert's share of the assignments (x: expert,
    y: epoch), the value written in each cell where the experts are few enough to read it (None: not logged)."""
    rows = [row for row in job.result.get("history", []) if f"{EXPERT_LOAD}0" in row]
    if not rows:
        return None
    experts = sum(key.startswith(EXPERT_LOAD) for key in rows[0])
    shares = [[row[f"{EXPERT_LOAD}{expert}"] for expert in range(experts)] for row in rows]
    figure = go.Figure(
        go.Heatmap(
            z=shares,
            x=list(range(experts)),
            y=[row["epoch"] for row in rows],
            colorscale=SCALE,
            colorbar={"title": {"text": "share"}},
            texttemplate="%{z:.3f}" if experts <= 16 else None,
            hovertemplate="expert %{x}, epoch %{y}: %{z:.4f} of the assignments<extra></extra>",
        )
    )
    figure.update_layout(
        title=f"Load per expert: {job.label} (even: {1 / experts:.3g} each)",
        xaxis={"title": "expert", "dtick": max(1, math.ceil(experts / 16))},
        yaxis={"title": "epoch", "dtick": max(1, math.ceil(len(rows) / 10))},
        height=420,
    )
    return figure


def device_label(device: dict[str, Any]) -> str:
    stage = device.get("stage", 0)
    return f"rank {device['rank']}" + (f" stage {stage}" if stage else "")


def device_figure(key: str, title: str, jobs: list[Job]) -> go.Figure:
    """Grouped bars: one group per job, one bar per device, the value written on it."""
    figure = go.Figure()
    devices = sorted({device_label(d) for job in jobs for d in job.result.get("devices", []) if key in d})
    for device in devices:
        xs, ys = [], []
        for job in jobs:
            values = [d[key] for d in job.result.get("devices", []) if key in d and device_label(d) == device]
            if values:
                xs.append(job.label)
                ys.append(values[0])
        figure.add_bar(x=xs, y=ys, name=device, text=[f"{y:.4g}" for y in ys], textposition="outside")
    figure.update_layout(title=title, barmode="group", yaxis_title=key, height=460, showlegend=True)
    return figure


def runs_table(jobs: list[Job]) -> str:
    header = [
        "job",
        "overrides",
        "status",
        "objective",
        "best epoch",
        "final",
        "epochs",
        "data parallel",
        "global batch",
        "runtime (s)",
    ]
    rows = []
    for job in jobs:
        result = job.result
        metric = result.get("metric") or ""
        final = (result.get("final") or {}).get(metric)
        cells = [
            job.label,
            " ".join(job.config.get("overrides", [])),
            result.get("status"),
            f"{metric} ({result.get('mode')}) {result['objective']:.6g}" if result.get("objective") is not None else "",
            result.get("best_epoch"),
            "" if final is None else f"{final:.6g}",
            result.get("epochs"),
            result.get("batch", {}).get("data_parallel"),  # jobs of equal overrides can differ here: pipeline's 1
            result.get("batch", {}).get("global"),
            result.get("runtime_s"),
        ]
        rows.append("<tr>" + "".join(f"<td>{html.escape(str('' if c is None else c))}</td>" for c in cells) + "</tr>")
    head = "".join(f"<th>{html.escape(name)}</th>" for name in header)
    return f'<table id="runs"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def write_report(
    paths: list[Path], found: list[Job], output: Path, by: str | None = None, statuses: list[str] | None = None
) -> Path:
    """The report of the jobs ``found`` in ``paths`` (``find_jobs``) whose status is one of ``statuses`` (all:
    None). Without ``by``, the trials of an Optuna search are coloured by their objective, other jobs one colour
    each."""
    jobs = [job for job in found if not statuses or job.result.get("status") in statuses]
    if not jobs:
        raise ConfigError("--status", f"matches none of the jobs in {', '.join(map(str, paths))}.", "drop it.")
    if by is None and all(job.config.get("trial") for job in jobs):
        by = OBJECTIVE
    label_jobs(jobs, by)
    colour = colours(jobs, by)
    logged = {key for job in jobs for row in job.result.get("history", []) for key in row}
    curves = {
        f"curve-{metric.replace('/', '-')}": curve_figure(metric, jobs, colour, by)
        for metric in CURVES
        if metric in logged
    }
    device_keys = {key for job in jobs for device in job.result.get("devices", []) for key in device}
    per_device = {}
    if "memory/model_state_mb" in device_keys:
        per_device["memory"] = device_figure(
            "memory/model_state_mb", "Model state per device (MB): parameters, gradients, optimizer state", jobs
        )
    rate = next(
        (key for key in ("perf/tokens_per_sec_per_device", "perf/samples_per_sec_per_device") if key in device_keys),
        None,
    )
    if rate:
        per_device["throughput"] = device_figure(rate, f"Throughput per device ({rate.split('/')[1]})", jobs)
    loads = {f"experts-load-{index}": expert_load_figure(job) for index, job in enumerate(jobs)}
    experts = {name: figure for name, figure in loads.items() if figure is not None}
    first = next(iter([*curves, *experts, *per_device]), None)  # the one that carries plotly.js

    def charts(figures: dict[str, go.Figure]) -> str:
        return "".join(
            figure.to_html(full_html=False, include_plotlyjs=name == first, div_id=name)
            for name, figure in figures.items()
        )

    sources = ", ".join(html.escape(str(path)) for path in paths)
    shown = f" ({html.escape(' or '.join(statuses))} only)" if statuses else ""
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>Training report</title>
<style>body {{font-family: sans-serif; margin: 2em;}} table {{border-collapse: collapse;}}
td, th {{border: 1px solid #ccc; padding: 4px 8px; text-align: left;}}
.charts {{display: grid; grid-template-columns: repeat(auto-fill, minmax(600px, 1fr)); gap: 1em;}}</style></head>
<body><h1>Training report</h1>
<p>{len(jobs)} jobs from {sources}{shown}, {time.strftime("%Y-%m-%d %H:%M")}; colour: {html.escape(by or "job")}.</p>
<h2>Runs</h2>{runs_table(jobs)}
<h2>Per epoch</h2><div class="charts">{charts(curves)}</div>
{f'<h2>Experts</h2><div class="charts">{charts(experts)}</div>' if experts else ""}
<h2>Per device (latest epoch)</h2><div class="charts">{charts(per_device)}</div>
</body></html>
"""
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(page)
    return output


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m project.cli.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="job dirs and sweep dirs")
    parser.add_argument(
        "--by",
        help="colour runs by this config key or group (strategy, trainer.devices, model.optimizer.lr...), or by "
        "objective (a colour scale, the best dark); default: by objective for an Optuna search's trials, else one "
        "colour per run",
    )
    parser.add_argument(
        "--status",
        action="append",
        choices=["completed", "pruned", "failed", "interrupted", "running"],
        help="only the jobs of this status (repeat it for several), e.g. --status completed for an Optuna search's "
        "completed trials",
    )
    parser.add_argument("--output", "-o", type=Path, help="the HTML file (default: report.html in the first dir)")
    args = parser.parse_args()
    jobs = find_jobs(args.paths)  # the paths first: a bad one is the problem, not where the report would go
    output = args.output or args.paths[0] / "report.html"
    fix = "give a file in a dir you can write: --output <file>.html."
    if output.is_dir():
        raise ConfigError("--output", f"{output} is a directory.", fix)
    check_writable("--output", output.parent, fix)
    print(f"Report: {write_report(args.paths, jobs, output, args.by, args.status)}")


if __name__ == "__main__":
    run_cli("python -m project.cli.report", main)
