"""How long a launcher's workers outlive it after SIGKILL (docs/faults.md): ``python benchmarks/worker_exit.py``.

Three times: a ddp x 2 job (the tests' tiny MLP) is killed with SIGKILL once its first epoch is saved; the workers'
``/proc`` entries are polled every 5 ms until both are gone (a zombie counts as gone).
"""

import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from conftest import TINY  # noqa: E402  (the tests' tiny model and data)
from test_faults import children, process_state  # noqa: E402  (the /proc readers the fault tests use)


def main(trials: int = 3) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for trial in range(trials):
            job_dir = Path(tmp) / str(trial)
            launcher = subprocess.Popen(
                [
                    sys.executable,
                    "train.py",
                    *TINY,
                    "logger=csv",
                    "strategy=ddp",
                    "trainer.devices=2",
                    "trainer.max_epochs=100000",
                    f"hydra.run.dir={job_dir}",
                ],
                cwd=REPO,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            while not (job_dir / "checkpoints" / "last.ckpt").exists():
                time.sleep(0.1)
            workers = children(launcher.pid)
            launcher.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            launcher.wait()
            while any(process_state(pid) is not None for pid in workers):
                time.sleep(0.005)
            gone_ms = 1000 * (time.monotonic() - killed)
            print(f"trial {trial}: {len(workers)} workers gone {gone_ms:.0f} ms after SIGKILL to the launcher")


if __name__ == "__main__":
    main()
