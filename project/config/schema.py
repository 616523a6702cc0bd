"""The composed config checked against its schema before anything is built: every number finite, and every option
a node passes to its ``_target_`` of the type, and in the range, the constructor declares.

Why the constructors' type hints rather than a second schema (Hydra structured configs): the hints already say
what each option is, in one place, for every class the config names (ours, Lightning's, torch's), so a new option
is checked the moment it is declared. Hydra passes an override it cannot parse as a number or bool on as text
(``model.compile=no``), so without this check a string reaches a bool option, where any non-empty text is true.
Ranges and paths are declared with the ``Annotated`` aliases of ``project.options.option_types`` (``PositiveInt``,
``OpenFraction``, ``ExistingFile``...). Only plain types are judged (bool, int, float, str, ``Literal``, those
aliases, lists of them, and unions of them); an option of any other type is left to its constructor, as is null.
The key-specific checks of ``project.config.checks`` run first and keep their more precise messages; what remains
there are the rules between keys.
"""

import collections.abc
import difflib
import inspect
import math
import types
import typing
from collections.abc import Iterator
from typing import Annotated, Any, Literal, Union

from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig
from omegaconf.errors import OmegaConfBaseException

from project.config.build import LAUNCHER_KEYS
from project.job.cluster import Cluster
from project.job.job import SearchSettings
from project.options.errors import ConfigError

_EXPECTED = {bool: "true or false", int: "an integer", float: "a number", str: "text"}
# The train config's own keys (conf/train.yaml), which no ``_target_`` declares; the others (seed, mode, ckpt_path)
# have checks of their own in project.config.checks.
TRAIN_KEYS = {
    "task_name": str,
    "tags": list[str],
    "plan": bool | Literal["search"],
    "print_config": bool | Literal["full"],
    "step_checks": Literal["auto", "each_step", "a_step_late"],
}
# Sections that no ``_target_`` builds, checked against the fields of the class they become (``build_job``).
TYPED_SECTIONS = {"cluster": Cluster, "plan_search": SearchSettings}


def check_train_keys(cfg: DictConfig) -> None:
    """``ConfigError`` for a key of ``TRAIN_KEYS`` of another type: run first, as ``plan`` decides what the launch
    does (``plan=no`` would be the text "no", which is true)."""
    for key, hint in TRAIN_KEYS.items():
        value = cfg.get(key)
        if value is None and typing.get_origin(hint) is Literal:  # a choice: null would pass for none of them
            choices = " | ".join(typing.get_args(hint))
            raise ConfigError(key, "is null.", f"set it to one of {choices}.")
        if value is not None:
            _check_value(key, value, hint)


def check_types(cfg: DictConfig) -> None:
    """Raise ``ConfigError`` naming the first non-finite number, or the first option whose value is not of its
    constructor's declared type (or, for the sections without one, ``TYPED_SECTIONS``' field's)."""
    for key, value in _leaves(cfg, ""):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(key, f"is {value}, not a finite number.", f"give {key} a finite number.")
    for section, cls in TYPED_SECTIONS.items():
        node = cfg.get(section)
        if node is not None:
            for name, hint in typing.get_type_hints(cls, include_extras=True).items():
                _check_value(f"{section}.{name}", node.get(name), hint)
    # The data's nodes first: the model takes sizes from them (model.net.input_dim: ${data.num_features}), so a
    # bad size is blamed on the data key the user set.
    for key, node in sorted(_target_nodes(cfg, ""), key=lambda item: item[0] != "data"):
        _check_node(key, node)


def _children(node: Any) -> Iterator[tuple[str, Any]]:
    """``(name, value)`` of each child of a config node that resolves here (not Hydra's own settings, nor a value
    that interpolates them: those resolve only inside the running job)."""
    names = [name for name in node if name != "hydra"] if isinstance(node, DictConfig) else range(len(node))
    for name in names:
        try:
            yield str(name), node[name]
        except OmegaConfBaseException:
            continue


def _leaves(node: Any, key: str) -> Iterator[tuple[str, Any]]:
    if not isinstance(node, (DictConfig, ListConfig)):
        yield key, node
        return
    for name, child in _children(node):
        yield from _leaves(child, f"{key}.{name}" if key else name)


def _target_nodes(node: Any, key: str) -> Iterator[tuple[str, dict[str, Any]]]:
    if not isinstance(node, (DictConfig, ListConfig)):
        return
    children = dict(_children(node))
    if isinstance(children.get("_target_"), str):
        yield key, children
    for name, child in children.items():
        yield from _target_nodes(child, f"{key}.{name}" if key else name)


def _declared_types(target: str) -> dict[str, Any]:
    """The type hints of ``target``'s parameters ({} for a target that cannot be imported: the build step reports
    it). For a class, its constructor's and, while a constructor passes ``**kwargs`` on, its bases' constructors'
    too; a constructor whose hints name what cannot be imported (a library's ``TYPE_CHECKING`` names) adds none."""
    try:
        built = get_object(target)
    except Exception:
        return {}
    functions = (
        [cls.__dict__["__init__"] for cls in built.__mro__ if "__init__" in cls.__dict__]
        if inspect.isclass(built)
        else [built]
    )
    declared: dict[str, Any] = {}
    for function in functions:
        try:
            parameters = inspect.signature(function).parameters
            hints = typing.get_type_hints(function, include_extras=True)  # with Annotated's constraints
        except Exception:
            break
        for name, hint in hints.items():
            if name in parameters and name not in declared:
                declared[name] = hint
        if not any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values()):
            break
    return declared


def _own_parameters(target: str) -> list[str] | None:
    """The keyword arguments ``target`` (a class: its constructor) takes, or None where it takes any
    (``**kwargs``) or cannot be inspected."""
    try:
        built = get_object(target)
        parameters = inspect.signature(built.__init__ if inspect.isclass(built) else built).parameters
    except Exception:
        return None
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values()):
        return None
    return [name for name in parameters if name != "self"]


def _check_node(key: str, node: dict) -> None:
    accepted = _own_parameters(node["_target_"])
    not_passed = LAUNCHER_KEYS if key == "strategy" else ()  # the launcher's, taken out before the strategy is built
    unknown = [
        name
        for name in node
        if not name.startswith("_") and accepted is not None and name not in accepted and name not in not_passed
    ]
    if unknown:  # a misspelt key, added with + as Hydra advises: refused now, not by the constructor after start-up
        close = difflib.get_close_matches(unknown[0], accepted or [], n=1)
        raise ConfigError(
            f"{key}.{unknown[0]}",
            f"is not an option of {node['_target_']}.",
            f"did you mean {key}.{close[0]}? Remove the + and set that key."
            if close
            else f"remove it; its options are {', '.join(accepted or [])}.",
        )
    declared = _declared_types(node["_target_"])
    for name, value in node.items():
        if name.startswith("_") or name not in declared:
            continue
        if value is None and typing.get_origin(declared[name]) is not Annotated:  # a range's hint says it below
            if node["_target_"].startswith("project.") and not _admits_none(declared[name]):
                # Our constructors declare null where they take it: any other null would fail inside the run
                raise ConfigError(
                    f"{key}.{name}",
                    f"is null, which {node['_target_']} does not take.",
                    f"give {key}.{name} a value, or drop the override that sets it to null.",
                )
            continue  # null, where a hint allows it or is too loose to say
        _check_value(f"{key}.{name}", value, declared[name])


def _admits_none(hint: Any) -> bool:
    """Whether a parameter of type ``hint`` may be None (Any, an Optional or a union with None, Literal[None])."""
    if hint is Any or hint is None or hint is type(None):
        return True
    origin = typing.get_origin(hint)
    if origin is Annotated:
        return _admits_none(typing.get_args(hint)[0])
    if origin in (Union, types.UnionType):
        return any(_admits_none(arg) for arg in typing.get_args(hint))
    return origin is Literal and None in typing.get_args(hint)


def _check_value(key: str, value: Any, hint: Any) -> None:
    expected = _mismatch(value, hint)
    if expected is not None:
        raise ConfigError(
            key,
            f"must be {expected}, got {value!r}.",
            f"set {key} to {expected} (python train.py --cfg job shows the whole config).",
        )


def _mismatch(value: Any, hint: Any) -> str | None:
    """What ``value`` should have been, or None if it is of type ``hint`` (or ``hint`` is not a plain type)."""
    origin = typing.get_origin(hint)
    if origin is Annotated:  # a type and its constraints (project.options.option_types)
        base, *constraints = typing.get_args(hint)
        constraint = next((c for c in constraints if hasattr(c, "holds")), None)
        if constraint is None:
            return _mismatch(value, base)
        fits = _mismatch(value, base) is None and constraint.holds(value)
        return None if fits else constraint.describe(integer=base is int)
    if origin in (list, collections.abc.Sequence):
        if not isinstance(value, (list, ListConfig)):
            return "a list"
        (item_hint,) = typing.get_args(hint) or (Any,)
        expected = next((e for e in (_mismatch(item, item_hint) for item in value) if e is not None), None)
        return None if expected is None else f"a list, each item {expected}"
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value in allowed:
            return None
        return "one of " + ", ".join(repr(choice) for choice in allowed) if len(allowed) > 1 else repr(allowed[0])
    if origin in (Union, types.UnionType):
        if value is None and type(None) in typing.get_args(hint):
            return None
        options = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        expectations = [_mismatch(value, option) for option in options]
        if any(expected is None for expected in expectations):
            return None
        return " or ".join(dict.fromkeys(expected for expected in expectations if expected))
    if hint not in _EXPECTED:
        return None
    fits = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }[hint]
    return None if fits else _EXPECTED[hint]
