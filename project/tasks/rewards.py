"""GRPO's reward functions (``model.grpo.reward_functions``): the user's own code, named as ``file.py:name`` (a file,
relative to the launch dir) or ``package.module.name`` (importable), called as TRL calls a reward function:
``function(prompts=[...], completions=[...], completion_ids=[...], **columns)`` with one entry per completion, the
prompt's line's other columns by name (each a list, one entry per completion), returning one score per completion:
a number, or None where the function does not apply (the completion is then left out of that function's mean, and of
its group's statistics if no function scored it). Prompts and completions are text for prompts given as text, and
messages (a list of ``{"role", "content"}``) for prompts given as messages, the completion one assistant message.

TRL also passes ``trainer_state``, ``log_extra`` and ``log_metric``, which are its Trainer's: not given here; a
function taking ``**kwargs`` (as TRL's examples do) runs under both.
"""

import difflib
import importlib
import importlib.util
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from project.options.errors import ConfigError

KEY = "model.grpo.reward_functions"


@dataclass(frozen=True)
class RewardFunction:
    """A reward function and its name in metrics (``rewards/<name>/mean``, TRL's: the function's ``__name__``)."""

    name: str
    function: Callable[..., Sequence[Any]]
    spec: str  # as the config gives it

    def scores(self, prompts: list, completions: list, completion_ids: list[list[int]], columns: dict) -> list[float]:
        """One float per completion (None -> NaN); ``RewardFailed`` naming the function for anything else."""
        try:
            given = self.function(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as error:
            raise RewardFailed(self, f"raised {type(error).__name__}: {error}") from error
        given = list(given) if isinstance(given, (list, tuple, torch.Tensor)) else given
        if not isinstance(given, list) or len(given) != len(completions):
            count = len(given) if isinstance(given, list) else f"a {type(given).__name__}"
            raise RewardFailed(self, f"returned {count} scores for {len(completions)} completions: one each is due")
        scores = []
        for index, score in enumerate(given):
            if isinstance(score, torch.Tensor) and score.numel() == 1:
                score = score.item()
            if score is None:
                scores.append(math.nan)
            elif isinstance(score, (int, float)) and not isinstance(score, bool):
                scores.append(float(score))
            else:
                raise RewardFailed(self, f"returned {score!r} for completion {index}: a number or None is due")
        return scores


class RewardFailed(RuntimeError):
    """A reward function broke its contract while training (before launch the same is a ``ConfigError``)."""

    def __init__(self, function: RewardFunction, problem: str) -> None:
        super().__init__(f"{KEY}: {function.spec} {problem}.")
        self.function, self.problem = function, problem


def load_reward_function(spec: str) -> RewardFunction:
    """The function ``spec`` names (module docstring); ``ConfigError`` naming it if it is not there or not callable."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(KEY, f"lists {spec!r}, which names no function.", "list file.py:name or module.name.")
    if ":" in spec:
        location, _, name = spec.rpartition(":")
        module = _module_from_file(spec, Path(location))
    else:
        location, _, name = spec.rpartition(".")
        if not location:
            raise ConfigError(
                KEY, f"lists {spec!r}, neither file.py:name nor module.name.", "name the file or the module too."
            )
        try:
            module = importlib.import_module(location)
        except Exception as error:
            raise ConfigError(
                KEY,
                f"lists {spec}, but module {location} does not import ({type(error).__name__}: {error}).",
                "check the module path (python -c 'import <module>'), or give file.py:name.",
            ) from None
    if not hasattr(module, name):
        close = difflib.get_close_matches(name, [key for key in vars(module) if not key.startswith("_")], n=1)
        raise ConfigError(
            KEY,
            f"lists {spec}, but {location} has no {name}.",
            f"did you mean {location}{':' if ':' in spec else '.'}{close[0]}?"
            if close
            else "name a function it defines.",
        )
    function = getattr(module, name)
    if not callable(function):
        raise ConfigError(
            KEY, f"lists {spec}, which is a {type(function).__name__}, not a function.", "name a function."
        )
    return RewardFunction(getattr(function, "__name__", name), function, spec)


def _module_from_file(spec: str, path: Path) -> Any:
    """The module of a ``.py`` file, imported once per process under a name of its own."""
    path = path.expanduser().resolve()
    if not path.is_file():
        raise ConfigError(
            KEY, f"lists {spec}, but {path} is not a file.", "give the .py file's path from the launch dir."
        )
    module_name = f"_reward_functions_{abs(hash(str(path)))}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    loader = importlib.util.spec_from_file_location(module_name, path)
    assert loader is not None and loader.loader is not None, "a .py file has a loader"
    module = importlib.util.module_from_spec(loader)
    try:
        loader.loader.exec_module(module)
    except Exception as error:
        raise ConfigError(
            KEY, f"lists {spec}, but {path} fails when imported ({type(error).__name__}: {error}).", "fix the file."
        ) from None
    sys.modules[module_name] = module
    return module
