"""The report of a real sweep over ddp, fsdp and pipeline, rendered by headless Chromium and read from its DOM."""

import json
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import REPO, isolated_env, require_extra

CHROMIUM = shutil.which("chromium")
# Flags for a machine without network (Chromium otherwise tries Google's hosts at every start).
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--virtual-time-budget=10000",
]
VOID = {"meta", "link", "br", "img", "input", "hr", "area", "base", "col", "embed", "source", "track", "wbr"}


class RenderedCharts(HTMLParser):
    """From a rendered page: per chart div (by id), the traces Plotly drew, their legend names, bar labels and x-axis
    tick labels; and the cells of the runs table, a row each."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[tuple[str, dict[str, str]]] = []
        self.traces: dict[str, list[str]] = defaultdict(list)  # chart id -> classes of its trace groups
        self.legend: dict[str, list[str]] = defaultdict(list)  # chart id -> legend entries
        self.bar_labels: dict[str, list[list[str]]] = defaultdict(list)  # chart id -> per bar trace, its labels
        self.xticks: dict[str, list[str]] = defaultdict(list)  # chart id -> x-axis tick labels
        self.strokes: dict[str, list[str]] = defaultdict(list)  # chart id -> per line trace, its line's stroke colour
        self.cells: dict[str, list[str]] = defaultdict(list)  # chart id -> a heatmap's cell labels, in drawing order
        self.table: list[list[str]] = []  # the runs table: the header row, then a row per job
        self._text: list[str] | None = None

    def chart(self) -> str | None:
        return next(
            (
                attrs["id"]
                for tag, attrs in reversed(self.stack)
                if tag == "div" and "id" in attrs and attrs.get("class", "").startswith("plotly-graph-div")
            ),
            None,
        )

    def handle_starttag(self, tag: str, attrs: list) -> None:
        attrs = {key: value or "" for key, value in attrs}
        classes = attrs.get("class", "").split()
        chart = self.chart()
        if chart and tag == "g" and "trace" in classes and ("scatter" in classes or "bars" in classes):
            self.traces[chart].append(" ".join(classes))
            if "bars" in classes:
                self.bar_labels[chart].append([])
        in_legend = any(tag == "g" and "legend" in attrs.get("class", "").split() for tag, attrs in self.stack)
        if chart and tag == "path" and "js-line" in classes and not in_legend:
            self.strokes[chart].append(re.search(r"stroke: (rgb\([^)]*\))", attrs.get("style", "")).group(1))
        in_xtick = any(tag == "g" and "xtick" in attrs.get("class", "").split() for tag, attrs in self.stack)
        in_cell = bool(self.stack) and "heatmap-label" in self.stack[-1][1].get("class", "").split()
        if chart and tag == "text" and ("legendtext" in classes or "bartext" in classes or in_xtick or in_cell):
            self._text = []
        if tag == "tr" and any(attrs.get("id") == "runs" for _, attrs in self.stack):
            self.table.append([])
        if tag in ("td", "th") and self.table and any(attrs.get("id") == "runs" for _, attrs in self.stack):
            self._text = []
        if tag not in VOID:
            self.stack.append((tag, attrs))

    def handle_data(self, data: str) -> None:
        if self._text is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if self._text is not None and tag in ("td", "th"):
            self.table[-1].append("".join(self._text))
            self._text = None
        if self._text is not None and tag == "text":
            tag_attrs = self.stack[-1][1]
            text, chart = "".join(self._text), self.chart()
            if "legendtext" in tag_attrs.get("class", ""):
                self.legend[chart].append(text)
            elif "bartext" in tag_attrs.get("class", ""):
                self.bar_labels[chart][-1].append(text)
            elif "heatmap-label" in self.stack[-2][1].get("class", ""):
                self.cells[chart].append(text)
            else:
                self.xticks[chart].append(text)
            self._text = None
        while self.stack:
            if self.stack.pop()[0] == tag:
                break


def render_report(
    sweep_dir: Path, out: Path, options: list[str], home: Path, screenshot: bool = True
) -> RenderedCharts:
    """``python -m project.cli.report <sweep dir> <options>``, rendered by Chromium: its DOM, and a screenshot
    beside the report."""
    if CHROMIUM is None:
        assert not os.environ.get("CI"), ".ci/run installs Debian's chromium for this test"
        pytest.skip("no chromium on this machine (apt-get install chromium)")
    require_extra("plotly", "report")
    report = out / "report.html"
    made = subprocess.run(
        [sys.executable, "-m", "project.cli.report", str(sweep_dir), *options, "-o", str(report)],
        cwd=REPO,
        env=isolated_env(home),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0 and f"Report: {report}" in made.stdout, made.stderr
    browser = [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={out / 'chromium'}"]
    dom = subprocess.run([*browser, "--dump-dom", report.as_uri()], capture_output=True, text=True, timeout=120)
    if screenshot:  # next to the report, for people to look at
        image = out / "report.png"
        subprocess.run(
            [*browser, "--window-size=1400,2400", f"--screenshot={image}", report.as_uri()],
            capture_output=True,
            timeout=120,
        )
        assert image.stat().st_size > 50_000
    charts = RenderedCharts()
    charts.feed(dom.stdout)
    return charts


@pytest.fixture(scope="session")
def rendered_report(ddp_fsdp_sweep, tmp_path_factory, home):
    """The report of the ddp/fsdp/pipeline sweep, coloured by strategy."""
    sweep_dir = ddp_fsdp_sweep[0].parent
    return render_report(sweep_dir, tmp_path_factory.mktemp("report"), ["--by", "strategy"], home), sweep_dir


@pytest.mark.slow
def test_the_report_draws_a_curve_per_run_for_every_metric(rendered_report):
    charts, _ = rendered_report
    labels = ["0: strategy=ddp", "1: strategy=fsdp", "2: strategy=pipeline"]
    for chart in ("curve-train-loss", "curve-val-loss", "curve-train-acc", "curve-val-acc"):
        assert len(charts.traces[chart]) == 3 and all("scatter" in trace for trace in charts.traces[chart]), chart
        assert charts.legend[chart] == labels, chart
        assert charts.xticks[chart] == ["0", "1", "2"], chart  # 3 epochs: a tick each


@pytest.mark.slow
def test_the_report_tables_each_jobs_data_parallel_size_and_global_batch(rendered_report):
    """32 samples per replica: ddp and fsdp split each batch over 2 replicas, the pipeline's 2 stages share one, so
    its global batch is half theirs (which is why its curves differ)."""
    charts, _ = rendered_report
    header, *rows = charts.table
    columns = [header.index("data parallel"), header.index("global batch")]
    assert [[row[column] for column in columns] for row in rows] == [["2", "64"], ["2", "64"], ["1", "32"]]


@pytest.mark.slow
def test_the_report_shows_fsdp_holding_half_of_ddps_model_state_per_device(rendered_report):
    charts, _ = rendered_report
    assert charts.legend["memory"] == ["rank 0", "rank 1"]
    per_device = [[float(label) for label in trace] for trace in charts.bar_labels["memory"]]  # [device][job]
    # MLP 32 -> 64 -> 32 -> 10: 4522 parameters; fp32 parameters, gradients and SGD momentum: 3 x 4 bytes each.
    whole = 3 * 4 * 4522 / 2**20
    for device in per_device:
        ddp, fsdp, pipeline = device
        assert ddp == pytest.approx(whole, rel=1e-3)  # the labels have 4 significant digits
        assert fsdp == pytest.approx(ddp / 2, rel=1e-3)  # sharded over 2 devices
        assert pipeline < ddp  # each stage holds its own blocks
    assert sum(trace[2] for trace in per_device) == pytest.approx(whole, rel=1e-3)  # the stages hold it all once
    assert len(charts.bar_labels["throughput"]) == 2


@pytest.mark.slow
def test_a_sweep_with_broken_job_records_is_reported_and_summarised_without_them(ddp_fsdp_sweep, tmp_path, home):
    """A copy of the ddp/fsdp/pipeline sweep with job 1's result.json truncated and job 2's overrides.yaml broken:
    the report draws job 0 and names the two it left out; the summary has a row for each, saying which is
    unreadable and why."""
    require_extra("plotly", "report")
    sweep_dir = tmp_path / "sweep"
    shutil.copytree(ddp_fsdp_sweep[0].parent, sweep_dir, ignore=shutil.ignore_patterns("checkpoints", "wandb"))
    result = sweep_dir / "1" / "result.json"
    result.write_text(result.read_text()[:100])
    (sweep_dir / "2" / ".hydra" / "overrides.yaml").write_text("- [strategy=fsdp\n")
    report = tmp_path / "report.html"
    made = subprocess.run(
        [sys.executable, "-m", "project.cli.report", str(sweep_dir), "-o", str(report)],
        cwd=REPO,
        env=isolated_env(home),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0 and "Traceback" not in made.stderr, made.stderr
    assert made.stderr.count("Left out") == 1 and f"Left out {sweep_dir / '1'}: " in made.stderr
    from project.launch.results import write_sweep_summary

    table, failed, jobs = write_sweep_summary(sweep_dir)
    rows = table.splitlines()[2:]
    assert jobs == 3 and rows[0].split("|")[3].strip() == "completed", table
    assert rows[1].split("|")[3].strip().startswith("unreadable: "), table
    assert rows[2].split("|")[3].strip().startswith("unreadable: while parsing"), table


@pytest.mark.slow
def test_the_report_shows_a_mixtures_load_per_expert_over_the_epochs(moe_balanced, tmp_path, home):
    """The tiny mixture's run (top 2 of 4 experts): a heatmap of each expert's share of the assignments, epoch by
    epoch, its cells the shares result.json holds, and the balance loss and imbalance as curves."""
    charts = render_report(moe_balanced, tmp_path, [], home, screenshot=False)
    history = json.loads((moe_balanced / "result.json").read_text())["history"]
    assert len(history) == 3
    assert charts.cells["experts-load-0"] == [f"{row[f'experts/load/{e}']:.3f}" for row in history for e in range(4)]
    for chart in ("curve-experts-balance_loss", "curve-experts-imbalance"):
        assert len(charts.traces[chart]) == 1 and charts.xticks[chart] == ["0", "1", "2"], chart
