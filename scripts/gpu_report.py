"""The tables of ``make gpu-check``: ``python scripts/gpu_report.py <out dir> --smoke-exit N --tests-exit N
--benchmark-exit N``.

Reads what the check wrote to the out dir (``gpu_smoke.md``: every feature combination's 3 steps, when the smoke
ran; ``gpu_tests*.xml``: pytest's junit reports, with the figures the GPU
tests record as properties, several where the tests ran in parts; ``gpu_benchmark.json`` when the benchmark ran)
and writes ``gpu_check.json`` and ``gpu_check.md``: the machine (date, GPU, torch, CUDA), every GPU test's outcome
and figures, the benchmark's table.
Exits 1 if a smoke run, a test or the benchmark failed.
"""

import argparse
import datetime
import json
import platform
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

import torch


def machine() -> dict[str, Any]:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def test_results(junits: list[Path]) -> list[dict[str, Any]]:
    """One entry per test case of the junit files: its name, outcome, seconds, the message of a failure or skip, its
    properties."""
    results = []
    cases = [case for junit in junits for case in ElementTree.parse(junit).getroot().iter("testcase")]
    for case in cases:
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = "failed" if tag == "failure" else tag
                message = (found.get("message") or "").splitlines()[0][:200] if found.get("message") else ""
        figures = {prop.get("name"): prop.get("value") for prop in case.iter("property")}
        results.append(
            {
                "test": case.get("name"),
                "outcome": outcome,
                "seconds": float(case.get("time", 0)),
                "message": message,
                "figures": figures,
            }
        )
    return results


def figure(value: str) -> str:
    try:
        number = float(value)
    except ValueError:
        return value
    return f"{number:.3g}" if abs(number) < 1e-2 or abs(number) >= 1e4 else f"{number:.4f}".rstrip("0").rstrip(".")


def markdown(
    report: dict[str, Any], benchmark_md: str | None, predictions_md: str | None = None, smoke_md: str | None = None
) -> str:
    m = report["machine"]
    lines = [
        f"# make gpu-check, {m['date']}",
        "",
        f"GPU: {m['gpu'] or 'none (CUDA not available)'}; torch {m['torch']} (CUDA {m['cuda']}); "
        f"Python {m['python']}. Re-measure: `make gpu-check OUT=<dir>` on the box (docs/gpu-offline.md).",
        "",
        f"## GPU smoke (`scripts/gpu_smoke.py`, exit code {report['smoke_exit']})",
        "",
        smoke_md or "Not run (not asked for) or it wrote no table.",
        "",
        f"## GPU tests (`pytest -m gpu`, exit code {report['tests_exit']})",
        "",
        "| test | outcome | s | figures |",
        "|---|---|---|---|",
    ]
    for test in report["tests"]:
        figures = "; ".join(f"{name} {figure(value)}" for name, value in test["figures"].items())
        outcome = test["outcome"] + (f": {test['message']}" if test["message"] else "")
        lines.append(f"| {test['test']} | {outcome} | {test['seconds']:.1f} | {figures} |")
    lines += ["", f"## GPU benchmark (`benchmarks/gpu.py`, exit code {report['benchmark_exit']})", ""]
    lines.append(benchmark_md if benchmark_md else "Not run (no CUDA device, or not asked for) or it wrote no table.")
    if predictions_md:  # scripts/gpu_predictions.py: the step-time model and the memory plan against the benchmark
        lines += ["", "## Predicted against measured (`scripts/gpu_predictions.py`)", "", predictions_md]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--smoke-exit", default="not-run", help="scripts/gpu_smoke.py's exit code, or not-run")
    parser.add_argument("--tests-exit", required=True, help="pytest's exit code, or not-run")
    parser.add_argument("--benchmark-exit", required=True, help="the benchmark's exit code, or not-run")
    args = parser.parse_args()
    benchmark_json, benchmark_md = args.out / "gpu_benchmark.json", args.out / "gpu_benchmark.md"
    report = {
        "machine": machine(),
        "smoke_exit": args.smoke_exit,
        "tests_exit": args.tests_exit,
        "benchmark_exit": args.benchmark_exit,
        "tests": test_results(sorted(args.out.glob("gpu_tests*.xml"))),
        "benchmark": json.loads(benchmark_json.read_text()) if benchmark_json.is_file() else None,
    }
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    predictions_md, smoke_md = args.out / "gpu_predictions.md", args.out / "gpu_smoke.md"
    text = markdown(
        report,
        benchmark_md.read_text() if benchmark_md.is_file() else None,
        predictions_md.read_text() if predictions_md.is_file() else None,
        smoke_md.read_text() if smoke_md.is_file() else None,
    )
    (args.out / "gpu_check.md").write_text(text)
    print(text)
    counts = {
        outcome: sum(test["outcome"] == outcome for test in report["tests"])
        for outcome in ("passed", "failed", "error", "skipped")
    }
    print(f"{args.out}/gpu_check.md: " + ", ".join(f"{n} {outcome}" for outcome, n in counts.items()))
    failed = any(code not in ("0", "not-run") for code in (args.smoke_exit, args.tests_exit, args.benchmark_exit))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
