"""``scripts/gpu_smoke.py`` (``make gpu-check``'s first part) on the CPU: its combinations, what the run's checks
refuse before launch, real ``train.py`` runs of the rest, and the table ``scripts/gpu_report.py`` takes in."""

import json
import math
import subprocess
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
from gpu_smoke import FEATURES, combinations, first_error_line, short_list  # noqa: E402

FIXED = {"model": "dense", "strategy": "auto", "compile": "eager", "checkpointing": "off"}


def test_every_combination_once():
    every = list(combinations({}))
    assert len(every) == len({tuple(c.values()) for c in every}) == math.prod(map(len, FEATURES.values())) == 216
    assert list(combinations(FIXED)) == [c for c in every if all(c[name] == FIXED[name] for name in FIXED)]


def test_the_short_list_runs_each_setting_once_beside_the_first_of_the_others():
    short = list(short_list())
    first = short[0]
    assert len(short) == 1 + sum(len(options) - 1 for options in FEATURES.values()) == 10
    for name, options in FEATURES.items():
        for setting in options:  # each setting in a combination of the short list, the other features at their first
            assert any(c[name] == setting and all(c[o] == first[o] for o in FEATURES if o != name) for c in short)
    assert all(c in list(combinations({})) for c in short)


def test_the_error_line_is_the_one_raised_below_its_causes():
    output = "\n".join(
        [
            "Traceback (most recent call last):",
            '  File "x.py", line 1, in f',
            "KeyError: 'a'",
            "",
            "The above exception was the direct cause of the following exception:",
            "Traceback (most recent call last):",
            "torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised: AssertionError: two modes",
            "[rank0]: done",
        ]
    )
    assert first_error_line(output).startswith("torch._dynamo.exc.BackendCompilerFailed: backend='inductor'")
    assert first_error_line("starting\nkilled by signal 9\n") == "killed by signal 9"


def test_the_smoke_trains_what_is_allowed_and_names_the_rule_of_what_is_not(tmp_path):
    """The dense model on one CPU, eager, without checkpointing: bf16 with full weights, LoRA and QLoRA, and Float8,
    each trains 3 steps; Float8 with LoRA or QLoRA is refused by Float8's rule, not run."""
    only = [f"{name}={setting}" for name, setting in FIXED.items()]
    command = [sys.executable, "scripts/gpu_smoke.py", "--cpu", "--jobs", "2", "--out", str(tmp_path), "--only", *only]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu_smoke.json").read_text())["rows"]
    outcomes = {(row["combination"]["matmuls"], row["combination"]["weights"]): row for row in rows}
    assert len(rows) == len(outcomes) == 6
    for key in [("bf16", "full"), ("bf16", "lora"), ("bf16", "qlora"), ("float8", "full")]:
        row = outcomes[key]
        assert row["outcome"] == "passed" and row["train_loss"] > 0, row
        log = (tmp_path / "runs" / "-".join(row["combination"].values()) / "output.log").read_text()
        assert "`max_steps=3` reached" in log
    for key in [("float8", "lora"), ("float8", "qlora")]:
        row = outcomes[key]
        assert row["outcome"] == "refused" and row["message"].startswith("model.float8.enabled: "), row
        assert not (tmp_path / "runs" / "-".join(row["combination"].values())).exists()
    table = (tmp_path / "gpu_smoke.md").read_text()
    assert "6 combinations, 4 passed, 2 refused, 0 failed" in table
    assert "| dense | auto | eager | off | float8 | lora | refused |  | model.float8.enabled: " in table

    report = [sys.executable, "scripts/gpu_report.py", str(tmp_path), "--smoke-exit", "0", "--tests-exit", "not-run"]
    subprocess.run([*report, "--benchmark-exit", "not-run"], cwd=REPO, check=True, capture_output=True, timeout=300)
    assert table in (tmp_path / "gpu_check.md").read_text()
