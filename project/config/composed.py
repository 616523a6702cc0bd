"""The config ``python train.py <overrides>`` hands to its ``main``, composed without running it: for tools that
check, plan or price a config (``scripts/gpu_smoke.py``, ``benchmarks/step_time.py``)."""

from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from project.config.resolvers import register_resolvers

CONF = Path(__file__).resolve().parents[2] / "conf"


def composed_train_config(overrides: list[str], output_dir: str = "/tmp/unused-job-dir") -> DictConfig:
    """The train config of ``overrides``, unresolved as ``hydra.main`` hands it over (Hydra's own node apart), with
    Hydra's runtime set as in a job whose dir is ``output_dir`` (the checks read it; nothing is written)."""
    register_resolvers()  # as train.py does
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    cfg.hydra.runtime.output_dir = output_dir
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg
