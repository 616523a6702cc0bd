"""``make gpu-collect`` (scripts/gpu_collect.py) on the CPU: without CUDA every part skipped and named; its CPU
checks run for real; its JSON's schema; and ``benchmarks/step_time.py --refit FILE`` fitting on such a file."""

import json
import subprocess
import sys

import pytest
from conftest import REPO
from omegaconf import OmegaConf

sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_collect import SCHEMA, SHARES, check  # noqa: E402


def collect(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    command = [sys.executable, "scripts/gpu_collect.py", "--out", str(tmp_path), *args]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    return done, json.loads((tmp_path / "gpu_collect.json").read_text())


def test_without_cuda_every_part_is_skipped_and_named(tmp_path):
    done, report = collect(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert check(report) == []
    assert report["schema"] == SCHEMA and report["machine"]["gpu"] is None
    assert {part: entry["skipped"] for part, entry in report["parts"].items()} == dict.fromkeys(
        SHARES, "no CUDA device"
    )
    assert report["cases"] == report["smoke"] == [] and report["peer"] is None
    # What the GPU box would run: the smoke's short list, the cases without the hand loop, the compiled peer
    commands = {part: entry["command"][1:] for part, entry in report["parts"].items()}
    assert commands["smoke"][:2] == ["scripts/gpu_smoke.py", "--short"]
    assert "--framework-only" in commands["cases"] and "llama_1b-compile-float8" in commands["cases"]
    assert "--compile" in commands["peer"]


def test_the_check_names_what_breaks_the_schema():
    assert "schema is None, not 1" in check({})
    report = {"schema": SCHEMA, "machine": {"date": "d", "gpu": None, "torch": "t"}, "budget_s": 1, "smoke": []}
    report["parts"] = {part: {"command": None, "exit": None, "seconds": 0, "skipped": "x"} for part in SHARES}
    report["cases"] = [{"case": "gpt", "model": "gpt", "compile": False, "float8": False, "overrides": []}]
    assert check(report) == []
    del report["cases"][0]["overrides"]
    report["cases"][0]["tokens_per_sec"] = "fast"
    assert check(report) == ["cases[0].overrides: not a list", "cases[0].tokens_per_sec: not a number"]


@pytest.mark.slow
def test_the_cpu_checks_run_and_write_what_refit_reads(tmp_path):
    """--cpu: the benchmark's tiny GPT case and the peer trainer's tiny Llama train for real (figures of no worth)."""
    done, report = collect(tmp_path, "--cpu")
    assert done.returncode == 0, done.stdout + done.stderr
    assert check(report) == []
    assert [case["case"] for case in report["cases"]] == ["gpt"]
    assert report["cases"][0]["tokens_per_sec"] > 0 and report["cases"][0]["throughput_ratio"] is None
    assert report["peer"]["tokens_per_sec"] > 0 and report["peer"]["trainer"].startswith("transformers")
    assert report["parts"]["cases"]["exit"] == report["parts"]["peer"]["exit"] == 0


@pytest.mark.slow
@pytest.mark.torch_internals  # the plan's simulation
def test_refit_recovers_the_host_speed_that_made_the_measurements(tmp_path):
    """A collected file whose throughputs are the model's own predictions on an H100 with the host at 30.0 us an op
    (roofline.yaml says 24.4): ``--refit FILE`` fits it back from the host-bound cases (the tiny GPT's, eager and
    compiled), and every row then comes out within half a percent."""
    from step_time import Row, planned

    roofline = OmegaConf.load(REPO / "conf" / "step_time" / "roofline.yaml")
    truth = {name: roofline[name] for name in ("matmul_efficiency", "attention_efficiency", "bandwidth_efficiency")}
    truth |= {"float8_matmul_efficiency": roofline["float8_matmul_efficiency"], "host_op_us": 30.0}
    cases = []
    for model, compiled in [("gpt", False), ("gpt", True), ("llama", False)]:
        overrides = [f"model={model}", "data=tokens", "data.seq_length=64", "data.batch_size=8"]
        overrides += [f"model.compile={str(compiled).lower()}", "trainer.accelerator=gpu", "trainer.devices=1"]
        overrides += ["trainer.precision=bf16-mixed"]
        row = Row("test", model, 1.0, [o for o in overrides if "accelerator" not in o] + ["cluster=h100_sxm_8x"])
        row.over_sequence = False
        name = f"{model}{'-compile' if compiled else ''}"
        predicted = planned(row).step(truth).tokens_per_device_per_s
        cases.append({"case": name, "model": model, "compile": compiled, "float8": False, "overrides": overrides})
        cases[-1] |= {"tokens_per_sec": predicted, "peak_allocated_mb": None}
    report = {"schema": SCHEMA, "machine": {"date": "2026-12-06", "gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11"}}
    report |= {"budget_s": 540, "wall_s": 1.0, "smoke": [], "cases": cases, "peer": None}
    report["parts"] = {part: {"command": None, "exit": 0, "seconds": 1.0, "skipped": None} for part in SHARES}
    path = tmp_path / "gpu_collect.json"
    path.write_text(json.dumps(report))
    command = [sys.executable, "benchmarks/step_time.py", "own", "--refit", str(path)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    assert "host_op_us 30.00" in done.stdout
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| gpu_collect.json")]
    assert [row[1] for row in rows] == ["llama", "gpt", "gpt-compile"]  # fitted on the file's rows, not ours
    assert all(abs(float(row[4].rstrip("%"))) <= 0.5 for row in rows), rows
