"""W&B goes online only when the user is logged in and the server answers; otherwise offline, without waiting."""

import socket

import pytest

from project.observability.loggers import resolve_wandb_mode


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc from `wandb login`
    return monkeypatch


@pytest.fixture
def listening_port():
    """A real server socket on loopback, standing in for a reachable W&B host."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    yield server.getsockname()[1]
    server.close()


def closed_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


def test_explicit_mode_and_env_win(clean_env):
    assert resolve_wandb_mode("disabled") == "disabled"
    clean_env.setenv("WANDB_MODE", "online")
    assert resolve_wandb_mode(None) == "online"


def test_no_credentials_means_offline(clean_env, listening_port):
    clean_env.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{listening_port}")
    assert resolve_wandb_mode(None) == "offline"


def test_logged_in_and_reachable_means_online(clean_env, listening_port, tmp_path):
    clean_env.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{listening_port}")
    assert resolve_wandb_mode(None) == "offline"
    netrc = tmp_path / ".netrc"
    netrc.write_text("machine 127.0.0.1\n  login user\n  password abc123\n")  # what `wandb login` writes
    netrc.chmod(0o600)
    assert resolve_wandb_mode(None) == "online"


def test_logged_in_but_unreachable_means_offline_quickly(clean_env):
    """Quickly: its one wait is a single real connection attempt bounded by 3 s (not W&B's 90 s init timeout), read
    from the calls themselves rather than a clock, which a busy machine stretches."""
    clean_env.setenv("WANDB_API_KEY", "x" * 40)
    port = closed_port()
    clean_env.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    attempts = []
    connect = socket.create_connection

    def recorded(address, timeout, *args, **kwargs):
        attempts.append((address, timeout))
        return connect(address, timeout, *args, **kwargs)

    clean_env.setattr(socket, "create_connection", recorded)
    assert resolve_wandb_mode(None) == "offline"
    assert attempts == [(("127.0.0.1", port), 3.0)]


@pytest.mark.slow  # waits out W&B's (shortened) init timeout and retries
def test_online_start_that_fails_falls_back_to_offline(clean_env, tmp_path):
    """Forced online with a server that refuses: the run is created offline instead of failing the training."""
    from project.observability.loggers import EpochWandbLogger

    clean_env.setenv("WANDB_API_KEY", "x" * 40)
    clean_env.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{closed_port()}")
    logger = EpochWandbLogger(mode="online", init_timeout_s=5, save_dir=str(tmp_path), project="test")
    with pytest.warns(UserWarning, match="W&B could not start online"):
        run = logger.experiment
    try:
        assert run.settings.mode == "offline"
        assert list(tmp_path.glob("wandb/offline-run-*"))
    finally:
        run.finish()
