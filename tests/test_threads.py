"""How many intra-op threads a job's processes take (``threads_per_process``): their share of the cores, and no
more than the machine's other work leaves idle. The effect on a busy machine is measured in docs/launching.md."""

import os

import pytest

from project.launch import launcher


@pytest.mark.parametrize(
    "load,processes,jobs,expected",
    [
        (0.2, 1, 1, 8),  # quiet: every core
        (0.2, 2, 1, 4),  # two workers: half each
        (0.2, 2, 2, 2),  # and two jobs of a sweep at once: a quarter
        (6.4, 1, 1, 2),  # 6.4 cores busy: the 2 left idle (rounded)
        (7.6, 1, 1, 1),  # all but 0.4 busy: one thread, never none
        (30.0, 4, 1, 1),
    ],
)
def test_threads_are_a_share_of_the_idle_cores(monkeypatch, load, processes, jobs, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(launcher, "concurrent_jobs", lambda: jobs)
    assert launcher.threads_per_process(processes) == expected
