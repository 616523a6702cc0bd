"""The tests' own harness (``tests/helpers/preloaded.py``): workers forked from the preloaded server behave, for
their launcher and their job, as workers started from scratch do."""

import signal
import time
from pathlib import Path

import pytest
from conftest import TINY, PreloadedRun

pytestmark = pytest.mark.slow


def parent(pid: int) -> int | None:
    """The parent of a live process; None once it is gone (a zombie is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in "ZX" else int(fields[1])


def test_forked_workers_stop_on_their_launchers_signal_and_die_with_it(home, tmp_path):
    """Two endless ddp jobs forked by the server. The first gets SIGTERM after its first epoch: torchelastic
    signals the proxies, they pass it on, and both workers stop cleanly, as a preempted job's. The second is
    SIGKILLed: its proxies die with it (their parent), and the workers, which are the server's children, die with
    the proxies."""
    endless = [*TINY, "logger=csv", "strategy=ddp", "trainer.devices=2", "trainer.max_epochs=100000"]
    for signum in (signal.SIGTERM, signal.SIGKILL):
        job_dir = tmp_path / signum.name
        launcher = PreloadedRun([*endless, f"hydra.run.dir={job_dir}"], home)
        deadline = time.monotonic() + 120
        while not (job_dir / "checkpoints" / "last.ckpt").exists():
            assert time.monotonic() < deadline and launcher.poll() is None, "no first epoch"
            time.sleep(0.1)
        heartbeats = job_dir / "workers" / "heartbeats"
        workers = [int((heartbeats / f"rank{rank}").read_text()) for rank in (0, 1)]
        server = launcher.server.process.pid
        assert [parent(pid) for pid in workers] == [server, server]  # forked by the server, not started afresh
        launcher.send_signal(signum)
        output, _ = launcher.communicate(timeout=120)
        if signum == signal.SIGTERM:
            assert launcher.returncode == 128 + signal.SIGTERM and "Stopped by SIGTERM: all 2 workers" in output
            assert output.count("Received SIGTERM") == 2, output[-3000:]  # each worker, by Lightning's handler
        else:
            assert launcher.returncode == -signal.SIGKILL
        deadline = time.monotonic() + 120  # a safety net, not a figure: a busy machine takes its time to reap
        while any(parent(pid) is not None for pid in workers):
            assert time.monotonic() < deadline, f"workers {workers} outlived their launcher"
            time.sleep(0.1)
