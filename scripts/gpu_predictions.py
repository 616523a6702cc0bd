"""make gpu-check's last part: each GPU benchmark case, measured, beside what ``plan=true`` predicts for the same run
on the GPU's datasheet cluster and on the cluster ``python -m project.cli.calibrate`` measured on the box.

    python scripts/gpu_predictions.py <out dir>    # reads gpu_benchmark.json and calibrated.yaml there

Writes ``gpu_predictions.md`` (the table docs/gpu.md takes) and ``gpu_predictions.json``.
"""

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from project.cli.calibrate import BASES  # noqa: E402

PREDICTED = re.compile(r"Predicted on \S+: .*?([\d,]+) tokens/s per GPU")
PEAK = re.compile(r"^Peak ([\d.]+) (GiB|MiB|KiB) per device", re.M)
MIB = {"GiB": 1024, "MiB": 1, "KiB": 1 / 1024}


def predict(overrides: list[str], cluster: list[str]) -> tuple[float | None, float | None]:
    """Tokens/s per GPU and the planned peak in MiB of ``python train.py plan=true`` on ``cluster``."""
    command = [sys.executable, "train.py", "plan=true", "memory_plan.if_over=warn", *overrides, *cluster]
    output = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600).stdout
    tokens, peak = PREDICTED.search(output), PEAK.search(output)
    mib = None if peak is None else float(peak[1]) * MIB[peak[2]]
    return (None if tokens is None else float(tokens[1].replace(",", ""))), mib


def error(predicted: float | None, measured: float | None) -> str:
    return "-" if predicted is None or not measured else f"{predicted / measured - 1:+.1%}"


def main(out: Path) -> None:
    report = json.loads((out / "gpu_benchmark.json").read_text())
    gpu = report["machine"]["gpu"] or ""
    datasheet = next((base for part, base in BASES if part in gpu), None)
    clusters = {"datasheet": [f"cluster={datasheet}"] if datasheet else None}
    if (out / "calibrated.yaml").is_file():
        (out / "cluster").mkdir(exist_ok=True)  # where Hydra finds it as cluster=calibrated
        (out / "cluster" / "calibrated.yaml").write_text((out / "calibrated.yaml").read_text())
        clusters["calibrated"] = [f"hydra.searchpath=[file://{out.resolve()}]", "cluster=calibrated"]
    rows: list[dict[str, Any]] = []
    for case in report["cases"]:
        if "error" in case or "tokens_per_sec" not in case:  # failed, or the checkpoint-save case (no throughput)
            continue
        row = {"case": case["case"], "tokens_per_sec": case["tokens_per_sec"], "peak_mb": case["peak_allocated_mb"]}
        for name, cluster in clusters.items():
            row[name] = predict(case["overrides"], cluster) if cluster else (None, None)
        rows.append(row)
    (out / "gpu_predictions.json").write_text(json.dumps({"gpu": gpu, "datasheet": datasheet, "rows": rows}))
    lines = [
        f"Predicted by `plan=true` on `cluster={datasheet}` (datasheet) and on the box's `calibrate` file, beside "
        f"the benchmark's measurements ({gpu}):",
        "",
        "| case | measured tokens/s | datasheet | error | calibrated | error | measured peak MiB | planned | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        (sheet, planned), (calibrated, _) = row["datasheet"], row.get("calibrated", (None, None))
        measured = row["tokens_per_sec"]
        lines.append(
            f"| {row['case']} | {measured:,.0f} | {sheet or 0:,.0f} | {error(sheet, measured)} | "
            f"{calibrated or 0:,.0f} | {error(calibrated, measured)} | "
            f"{row['peak_mb'] or 0:,.0f} | {planned or 0:,.0f} | {error(planned, row['peak_mb'])} |"
        )
    (out / "gpu_predictions.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
