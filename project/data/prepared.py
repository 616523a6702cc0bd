"""A prepared corpus's record of itself (``meta.json``, written by ``python -m project.cli.prepare``). Kept free of
heavy imports: ``train.py``'s resolvers read it before Hydra composes anything."""

import json
from pathlib import Path

from project.options.errors import ConfigError


def prepared_meta(path: str | Path) -> dict:
    """The ``meta.json`` of a corpus prepared by ``python -m project.cli.prepare`` (``data.path``)."""
    meta = Path(path) / "meta.json"
    if not meta.is_file():
        raise ConfigError(
            "data.path",
            f"{path} has no meta.json: it is not a prepared corpus (or its preparation has not finished).",
            "run python -m project.cli.prepare <corpus> --out DIR, then data.path=DIR.",
        )
    return json.loads(meta.read_text())
