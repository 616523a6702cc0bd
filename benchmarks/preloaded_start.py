"""What the tests save by forking ``python train.py`` from ``tests/helpers/preloaded.py``: ``python
benchmarks/preloaded_start.py``.

Three figures, each the median of 5 runs, the compared ones in alternating pairs (so that a noisy machine weighs on
both sides alike): the import of ``project.launch.launcher`` (what train.py imports: torch, Lightning, Hydra) in a
fresh interpreter; a fork of
an interpreter that has imported it, ending with the interpreter's teardown of its modules and without it (as
``tests/helpers/preloaded.py`` ends its children); and the tests' tiny MLP on 2 tensor-parallel ranks, from scratch and
forked from the preloaded server (the launcher and its workers).
"""

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from conftest import TINY, isolated_env, run_preloaded  # noqa: E402  (the tests' tiny MLP and their server)

PAIRS = 5


def seconds(action) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def import_launch() -> None:
    subprocess.run([sys.executable, "-c", "import project.launch.launcher"], cwd=REPO, check=True)


def forked_exit(teardown: bool) -> None:
    """A child of this (preloaded) process that exits at once: through the interpreter's teardown, or past it."""
    pid = os.fork()
    if pid == 0:
        if teardown:
            sys.exit(0)
        os._exit(0)
    os.waitpid(pid, 0)


def medians(first, second) -> tuple[float, float]:
    times = [(seconds(first), seconds(second)) for _ in range(PAIRS)]
    return statistics.median(a for a, _ in times), statistics.median(b for _, b in times)


def main() -> None:
    sys.path.insert(0, str(REPO))
    import project.launch.launcher  # noqa: F401  (this process is the preloaded one the forks below start from)

    imported = statistics.median(seconds(import_launch) for _ in range(PAIRS))
    print(f"import project.launch.launcher, fresh interpreter: {imported:.2f} s")
    with_teardown, without = medians(lambda: forked_exit(True), lambda: forked_exit(False))
    print(
        f"exit of a forked child, with torch and Lightning loaded: {with_teardown:.2f} s with the teardown of "
        f"its modules, {without:.2f} s without"
    )
    with tempfile.TemporaryDirectory() as tmp:
        home, runs = Path(tmp) / "home", iter(range(2 * PAIRS + 1))
        home.mkdir()
        args = [*TINY, "data.batch_size=64", "strategy=tensor_parallel", "trainer.devices=2", "logger=csv"]

        def scratch() -> None:
            subprocess.run(
                [sys.executable, "train.py", *args, f"hydra.run.dir={tmp}/{next(runs)}"],
                cwd=REPO,
                env=isolated_env(home),
                check=True,
                capture_output=True,
            )

        def forked() -> None:
            assert run_preloaded([*args, f"hydra.run.dir={tmp}/{next(runs)}"], home, 300).returncode == 0

        forked()  # starts the server
        from_scratch, from_server = medians(scratch, forked)
    print(f"tiny MLP, tensor_parallel on 2 ranks: {from_scratch:.1f} s from scratch, {from_server:.1f} s forked")


if __name__ == "__main__":
    main()
