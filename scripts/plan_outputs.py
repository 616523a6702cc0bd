"""Run every ``plan=true`` and ``plan=search`` command that README.md and docs/ give in a code block (and any given
with ``--extra``), and write what each prints, its timings blanked, into one file per command: the check that a
change of the planner's code leaves its answers as they were.

    python scripts/plan_outputs.py /tmp/before            # on the old checkout
    python scripts/plan_outputs.py /tmp/after             # on the new one
    diff -r /tmp/before /tmp/after                        # the commands' own lines only, if the plans are unchanged

Each command runs with an empty plan cache of its own (``paths.cache_dir``), so a search's count of simulated
layouts is the same every time, and with W&B off. A search over 64 GPUs takes minutes on 2 cores.
"""

import argparse
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What differs from run to run: the seconds a simulation or a search took, and the job dir's timestamped name.
TIMINGS = [
    (re.compile(r"simulated in [0-9.]+ s"), "simulated in <t> s"),
    (re.compile(r"; [0-9]+ s\)"), "; <t> s)"),
    (re.compile(r"\d{4}-\d{2}-\d{2}[_/ ]\d{2}[-:]\d{2}[-:]\d{2}"), "<time>"),
]


def documented_commands() -> list[str]:
    """The ``python train.py ... plan=...`` commands of README.md and docs/*.md's code blocks, continuation lines
    joined, comments dropped."""
    commands = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        block, joined = False, ""
        for line in page.read_text().splitlines():
            if line.strip().startswith("```"):
                block, joined = not block, ""
                continue
            if not block:
                continue
            joined += line.strip().removesuffix("\\")
            if line.rstrip().endswith("\\"):
                joined += " "
                continue
            command, joined = joined.split("  #")[0].strip(), ""
            if command.startswith("python train.py") and re.search(r"\bplan=(true|search)\b", command):
                commands.append(command)
    return list(dict.fromkeys(commands))


def blanked(text: str) -> str:
    for pattern, replacement in TIMINGS:
        text = pattern.sub(replacement, text)
    return text


def run(command: str, out: Path, index: int) -> None:
    """``command`` in the repo with its own empty cache and job dir; its exit code, stdout and stderr's config
    error (if any) into ``out``/``<index>.txt``: the same command of another checkout (its keys spelt anew, say)
    lands in the same file."""
    with tempfile.TemporaryDirectory() as scratch:
        arguments = shlex.split(command)[2:]  # after python train.py
        arguments += [f"paths.cache_dir={scratch}/cache", f"hydra.run.dir={scratch}/job", "logger=none"]
        done = subprocess.run([sys.executable, "train.py", *arguments], cwd=REPO, capture_output=True, text=True)
    errors = [line for line in done.stderr.splitlines() if line.startswith("Config error")]
    text = f"$ {command}\nexit {done.returncode}\n{done.stdout}{chr(10).join(errors)}\n"
    (out / f"{index:02d}.txt").write_text(blanked(text))
    print(f"{index:02d}: exit {done.returncode}: {command}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the dir the outputs go to")
    parser.add_argument("--extra", action="append", default=[], help="another command to run (repeatable)")
    arguments = parser.parse_args()
    arguments.out.mkdir(parents=True, exist_ok=True)
    for index, command in enumerate(documented_commands() + arguments.extra):
        run(command, arguments.out, index)


if __name__ == "__main__":
    main()
