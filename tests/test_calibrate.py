"""``python -m project.cli.calibrate``: refused clearly on a machine without a GPU (this one), and the cluster file it
writes on a GPU box is one ``cluster=<name>`` composes into the Cluster the step-time model reads, with the measured
figures over the datasheet ones. (The measuring itself runs on a GPU: ``make gpu-check``.)"""

import json
import re
import subprocess
import sys
from dataclasses import fields

import pytest
from conftest import REPO, TINY_GPT, train
from test_memory_plan import resolved

from project.cli.calibrate import Measured, base_cluster, cluster_file
from project.job.cluster import Cluster


def test_without_a_gpu_it_is_refused_naming_the_fix_and_writes_nothing(tmp_path):
    clusters = sorted((REPO / "conf" / "cluster").iterdir())
    result = subprocess.run(
        [sys.executable, "-m", "project.cli.calibrate", "--out", str(tmp_path / "box.yaml")],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""},
        timeout=120,
    )
    assert result.returncode == 1
    assert "python -m project.cli.calibrate: device: calibrate times this machine's GPUs" in result.stderr
    assert "Fix: run it on the GPU box" in result.stderr and "cluster=h100_sxm_8x" in result.stderr
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.iterdir()) and sorted((REPO / "conf" / "cluster").iterdir()) == clusters


@pytest.mark.parametrize(
    "arguments,message",
    [
        (["--smoke", "--name", "../../evil"], "--name: is '../../evil': the cluster's name"),
        (["--smoke", "--name", "a/b"], "--name: is 'a/b'"),
        (["--smoke", "--shapes", "64x64x64"], "--shapes: is given with --smoke, which times sizes of its own"),
        (["--cpu", "--seq", "128"], "--seq: is given with --cpu, which times sizes of its own"),
        (["--cpu", "--base", "h200_8x"], "--base: is given with --cpu, which measures this CPU itself"),
        (["--smoke", "--seq", "128"], "--seq: is given with --smoke"),
        (["--shapes", "0x64x64"], "--shapes: '0x64x64' is not MxNxK."),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_timed_or_written(arguments, message):
    """Checked before any measurement: a name that would write outside conf/cluster, arguments --smoke ignores."""
    clusters = sorted((REPO / "conf" / "cluster").iterdir())
    result = subprocess.run(
        [sys.executable, "-m", "project.cli.calibrate", *arguments],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.startswith(f"python -m project.cli.calibrate: {message}"), result.stderr[-2000:]
    assert sorted((REPO / "conf" / "cluster").iterdir()) == clusters and not (REPO / "evil.yaml").exists()


def calibrated(mode: str, name: str, out) -> subprocess.CompletedProcess:
    """``python -m project.cli.calibrate <mode> --name <name> --out <out>``, which must succeed."""
    command = [sys.executable, "-m", "project.cli.calibrate", mode, "--name", name, "--out", str(out)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_smoke_runs_every_measurement_on_the_cpu_into_a_cluster_file(tmp_path):
    """--smoke: the matmuls, attention, the copy and a 2-process gloo all-gather, timed here, written as a cluster
    that composes: the code path make gpu-check takes, with the CPU's figures."""
    out = tmp_path / "cluster" / "smoke.yaml"
    result = calibrated("--smoke", "smoke", out)
    assert f"Wrote {out}: use cluster=smoke" in result.stdout
    job = resolved(["plan=search", f"hydra.searchpath=[file://{tmp_path}]", "cluster=smoke"])
    assert job.cluster is not None and job.cluster.name == "smoke" and job.cluster.devices_per_node == 2
    for efficiency in (job.cluster.matmul_efficiency, job.cluster.attention_efficiency):
        assert 0 < efficiency < 0.1  # a CPU's BF16 against an H100's 989 TFLOPS (tiny matmuls: over their waves)
    assert 0 < job.cluster.bandwidth_efficiency < 1 and job.cluster.intra_node_gb_per_s > 0
    text = out.read_text()
    assert "all-gather (gloo) of 1 MiB over 2 devices" in text and "causal, 4 heads of 32, sequence 256" in text


@pytest.mark.slow
def test_cpu_measures_this_cpu_into_a_cluster_that_plan_true_predicts_on(tmp_path):
    """--cpu: this CPU as the device that trains, every figure measured; plan=true on it prints the host's share."""
    calibrated("--cpu", "mine", tmp_path / "cluster" / "mine.yaml")
    job = resolved(["plan=true", f"hydra.searchpath=[file://{tmp_path}]", "cluster=mine"])
    cluster = job.cluster
    assert cluster is not None and cluster.kind == "cpu" and not job.on_gpus and cluster.float8_peak_tflops is None
    assert cluster.host_op_us > 0 and cluster.collective_latency_us and cluster.peak_tflops > 0
    assert 0 < cluster.matmul_efficiency <= 1 and 0 < cluster.bandwidth_efficiency <= 1
    plan = train(["plan=true", f"hydra.searchpath=[file://{tmp_path}]", "cluster=mine", *TINY_GPT], tmp_path).output
    assert re.search(r"Predicted on mine: .* the host's share \d+%", plan), plan[-2000:]


MEASURED = Measured(
    device="NVIDIA H200",
    devices=4,
    multiprocessors=132,
    memory_gb=150.1,
    power_limit_w=600.0,
    matmul_efficiency=0.71,
    attention_efficiency=0.33,
    bandwidth_efficiency=0.88,
    intra_node_gb_per_s=381.0,
    notes={"matmul_efficiency": "the median share over 5 shapes: TFLOPS 8192x4096x4096 700"},
)


def test_the_file_composes_as_a_cluster_with_the_measured_figures_over_the_datasheets(tmp_path):
    base = base_cluster("h200_8x", "NVIDIA H200")
    (tmp_path / "cluster").mkdir()
    (tmp_path / "cluster" / "box.yaml").write_text(cluster_file("box", base, MEASURED))
    job = resolved(["plan=search", f"hydra.searchpath=[file://{tmp_path}]", "cluster=box"])
    assert isinstance(job.cluster, Cluster)
    measured = {
        "name": "box",
        "multiprocessors": 132,
        "memory_gb": 150.1,
        "power_limit_w": 600.0,
        "matmul_efficiency": 0.71,
        "attention_efficiency": 0.33,
        "bandwidth_efficiency": 0.88,
        "devices_per_node": 4,
        "intra_node_gb_per_s": 381.0,
    }
    for field in fields(Cluster):
        expected = measured.get(field.name, getattr(base, field.name))
        assert getattr(job.cluster, field.name) == pytest.approx(expected) if field.name != "name" else expected
    text = (tmp_path / "cluster" / "box.yaml").read_text()
    assert "matmul_efficiency: 0.71  # the median share over 5 shapes: TFLOPS 8192x4096x4096 700" in text
    assert "memory_tb_per_s: 4.8  # h200_8x's" in text  # not measured: the datasheet's, said so


def test_one_gpu_keeps_the_datasheet_links_and_an_unknown_gpu_needs_a_base():
    base = base_cluster("a100_80g_8x", "NVIDIA A100-SXM4-80GB")
    single = Measured(**{**MEASURED.__dict__, "devices": 1, "intra_node_gb_per_s": None, "power_limit_w": None})
    text = cluster_file("one", base, single)
    assert "devices_per_node: 8  #" in text and "intra_node_gb_per_s: 300" in text and "power_limit_w: 400" in text
    with pytest.raises(Exception, match=r"--base: no datasheet cluster is known for a Tesla T4"):
        base_cluster(None, "Tesla T4")
    assert base_cluster(None, "NVIDIA H100 80GB HBM3").name == "h100_sxm_8x"


def test_gpu_predictions_sets_plan_trues_figures_beside_the_benchmarks(tmp_path):
    """make gpu-check's last part (scripts/gpu_predictions.py) on a benchmark report of one case: the tiny GPT's
    throughput and peak as if measured, beside what `python train.py plan=true` predicts for it on the datasheet
    cluster and on a calibrated file, each error worked out from those."""
    overrides = [*TINY_GPT, "data.batch_size=8", "trainer.precision=bf16-mixed"]
    case = {"case": "tiny", "tokens_per_sec": 1.0e6, "peak_allocated_mb": 10.0, "overrides": overrides}
    (tmp_path / "gpu_benchmark.json").write_text(json.dumps({"machine": {"gpu": "NVIDIA H200"}, "cases": [case]}))
    base = base_cluster("h200_8x", "NVIDIA H200")
    # A host twice as slow: the tiny GPT's step on an H200 is the host's (its matmuls would change nothing)
    slower = Measured(**{**MEASURED.__dict__, "host_op_us": 2 * base.host_op_us, "devices": 1})
    (tmp_path / "calibrated.yaml").write_text(cluster_file("calibrated", base, slower))
    subprocess.run([sys.executable, "scripts/gpu_predictions.py", str(tmp_path)], cwd=REPO, check=True, timeout=600)
    (row,) = json.loads((tmp_path / "gpu_predictions.json").read_text())["rows"]
    (sheet, planned), (calibrated, _) = row["datasheet"], row["calibrated"]
    plan = train(["plan=true", "cluster=h200_8x", *overrides], tmp_path).output
    assert f"{sheet:,.0f} tokens/s per GPU" in plan and f"Peak {planned * 1024:.1f} KiB per device" in plan
    assert 0 < calibrated < sheet  # a slower host on the calibrated box
    table = (tmp_path / "gpu_predictions.md").read_text()
    assert f"| tiny | 1,000,000 | {sheet:,.0f} | {sheet / 1e6 - 1:+.1%} | {calibrated:,.0f} |" in table
    assert f"| 10 | {planned:,.0f} | {planned / 10 - 1:+.1%} |" in table and planned > 0
