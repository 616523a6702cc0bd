"""``make gpu-collect``: in one call of at most 9 minutes on one H100 or H200 (the bundle's install, then 8 of
measuring), what the step-time and memory models need measured, into one JSON that ``python benchmarks/step_time.py
--refit FILE`` reads.

    python scripts/gpu_collect.py --out DIR [--budget 480]
    python scripts/gpu_collect.py --out DIR --cpu      # the parts' CPU checks: the pipeline, figures of no worth
    python scripts/gpu_collect.py --check FILE         # FILE's schema, as --refit reads it

The parts, in order, each given at most its share of what is left of the budget (a part cut short keeps what it
wrote):

1. ``smoke``: ``scripts/gpu_smoke.py --short``, each feature's settings once, 3 steps a run;
2. ``cases``: ``benchmarks/gpu.py --framework-only``, one run each of 20 steps an epoch (``CASES``): the host-bound
   tiny GPT and gpt_125m, eager and compiled; gpt_350m and llama_1b eager and compiled (their throughput and
   ``max_memory_allocated``: the compiled and eager peaks of three models with gpt_125m's); and both compiled in
   Float8;
3. ``peer``: ``benchmarks/peer_trainer.py --compile``, transformers' ``Trainer`` on llama_1b's shape, beside the
   ``llama_1b-compile`` case.

Writes ``DIR/gpu_collect.json`` after each part: ``schema`` (``SCHEMA``), ``machine`` (date, GPU, torch, CUDA,
Python), ``budget_s``, ``wall_s``, ``parts`` (each part's command, exit code, seconds, and why it was skipped or
cut short, if it was), ``smoke`` (its rows), ``cases`` (benchmarks/gpu.py's case results: overrides,
``tokens_per_sec``, ``peak_allocated_mb``...) and ``peer``. Without CUDA (and without ``--cpu``) nothing runs: every
part is skipped, named, and the JSON written, as ``make offline-check`` checks on its simulated box. With ``--cpu``
the cases run as ``benchmarks/gpu.py --smoke`` runs them (the tiny GPT), the peer with ``--tiny``; the smoke's own
CPU check is ``tests/test_gpu_smoke.py``.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from gpu_report import machine  # noqa: E402

SCHEMA = 1
# 8 minutes: with the bundle's install before it, one device call (at most 10 minutes) holds it with room to spare.
# Not yet timed on a GPU: the estimate is from docs/gpu.md's runs (a compiled llama_1b run about 45 s, an eager one
# 25 s, the smoke's short list about 90 s), so the shares put first what --refit needs most.
BUDGET_S = 480
SHARES = {"smoke": 0.2, "cases": 0.75, "peer": 1.0}  # of what is left when the part starts
CASES = [  # in the order they run: those the efficiencies fit on first, the host-bound tiny GPT last
    "llama_1b",
    "llama_1b-compile",
    "gpt_350m",
    "gpt_350m-compile",
    "gpt_125m",
    "gpt_125m-compile",
    "llama_1b-compile-float8",
    "gpt_350m-compile-float8",
    "gpt",
    "gpt-compile",
]
CPU_CASES = ["gpt"]  # benchmarks/gpu.py --smoke's cases: eager only
STEPS = 20
CPU_STEPS = 4  # the pipeline's check: its figures are of no worth, its time is the suite's
# A case as --refit reads it: these keys, with a figure or None where the run failed.
CASE_KEYS = {"case": str, "model": str, "compile": bool, "float8": bool, "overrides": list}


def commands(out: Path, cpu: bool) -> dict[str, list[str] | None]:
    python = sys.executable
    smoke = None if cpu else [python, "scripts/gpu_smoke.py", "--short", "--out", str(out / "smoke")]
    steps = str(CPU_STEPS if cpu else STEPS)
    cases = [python, "benchmarks/gpu.py", "--framework-only", "--steps", steps, "--out", str(out / "cases")]
    cases += ["--smoke", "--cases", *CPU_CASES] if cpu else ["--cases", *CASES]
    peer = [python, "benchmarks/peer_trainer.py", "--out", str(out / "peer.json")]
    peer += ["--tiny", "--steps", "6", "--warmup", "3", "--seq-length", "64"] if cpu else ["--compile"]
    return {"smoke": smoke, "cases": cases, "peer": peer}


def read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def check(report: dict[str, Any]) -> list[str]:
    """What in ``report`` breaks the schema ``--refit`` reads (nothing: an empty list)."""
    problems = []
    if report.get("schema") != SCHEMA:
        problems.append(f"schema is {report.get('schema')!r}, not {SCHEMA}")
    for key, kind in {"machine": dict, "parts": dict, "cases": list, "smoke": list, "budget_s": (int, float)}.items():
        if not isinstance(report.get(key), kind):
            problems.append(f"{key}: not a {kind}")
    for key in ("date", "gpu", "torch"):
        if key not in report.get("machine", {}):
            problems.append(f"machine.{key}: missing")
    for part in SHARES:
        entry = report.get("parts", {}).get(part)
        if not isinstance(entry, dict) or not {"command", "exit", "seconds", "skipped"} <= set(entry):
            problems.append(f"parts.{part}: needs command, exit, seconds and skipped")
    for index, case in enumerate(report.get("cases", [])):
        for key, kind in CASE_KEYS.items():
            if not isinstance(case.get(key), kind):
                problems.append(f"cases[{index}].{key}: not a {kind.__name__}")
        for key in ("tokens_per_sec", "peak_allocated_mb"):
            if "error" not in case and not isinstance(case.get(key), int | float | type(None)):
                problems.append(f"cases[{index}].{key}: not a number")
    return problems


def run_part(command: list[str], budget: float, log: Path) -> dict[str, Any]:
    """``command`` from the repo's root, its output to ``log``, stopped at ``budget`` seconds."""
    start = time.monotonic()
    with log.open("w") as output:
        try:
            done = subprocess.run(command, cwd=REPO, stdout=output, stderr=subprocess.STDOUT, timeout=budget)
            exit_code, skipped = done.returncode, None
        except subprocess.TimeoutExpired:
            exit_code, skipped = None, f"cut short at its {budget:.0f} s of the budget"
    return {"command": command, "exit": exit_code, "seconds": time.monotonic() - start, "skipped": skipped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for every part together")
    parser.add_argument("--cpu", action="store_true", help="the parts' CPU checks (tiny models)")
    parser.add_argument("--check", type=Path, default=None, help="check a gpu_collect.json's schema and exit")
    args = parser.parse_args()
    if args.check is not None:
        problems = check(json.loads(args.check.read_text()))
        print("\n".join(problems) or f"{args.check}: schema {SCHEMA}, as --refit reads it")
        sys.exit(1 if problems else 0)
    if args.out is None:
        parser.error("--out DIR: where gpu_collect.json goes")
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    started = time.monotonic()
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "machine": machine(),
        "budget_s": args.budget,
        "wall_s": 0.0,
        "parts": {},
        "smoke": [],
        "cases": [],
        "peer": None,
    }
    path = args.out / "gpu_collect.json"
    for part, command in commands(args.out.resolve(), args.cpu).items():
        left = args.budget - (time.monotonic() - started)
        if command is None:
            entry = {"command": None, "exit": None, "seconds": 0.0, "skipped": "its CPU check is its own test"}
        elif not cuda and not args.cpu:
            entry = {"command": command, "exit": None, "seconds": 0.0, "skipped": "no CUDA device"}
        elif left < 30:
            entry = {"command": command, "exit": None, "seconds": 0.0, "skipped": "no budget left"}
        else:
            print(f"{part}: {' '.join(command[1:])} (at most {SHARES[part] * left:.0f} s)", flush=True)
            entry = run_part(command, SHARES[part] * left, args.out / f"{part}.log")
        report["parts"][part] = entry
        report["smoke"] = (read_json(args.out / "smoke" / "gpu_smoke.json") or {}).get("rows", [])
        cases = (read_json(args.out / "cases" / "gpu_benchmark.json") or {}).get("cases", [])
        report["cases"] = [{k: v for k, v in case.items() if k != "framework_epochs"} for case in cases]
        report["peer"] = read_json(args.out / "peer.json")
        report["wall_s"] = time.monotonic() - started
        path.write_text(json.dumps(report, indent=1))
        outcome = entry["skipped"] or f"exit {entry['exit']} in {entry['seconds']:.0f} s"
        print(f"{part}: {outcome}", flush=True)
    problems = check(report)
    print(f"Wrote {path} ({len(report['cases'])} cases, {len(report['smoke'])} smoke rows)")
    failed = any(entry["exit"] not in (0, None) for entry in report["parts"].values())
    sys.exit(1 if problems or failed else 0)


if __name__ == "__main__":
    main()
