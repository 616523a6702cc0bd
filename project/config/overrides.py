"""The command line's overrides parsed as Hydra parses them, before Hydra does: a malformed one is a config error in
one sentence (which override, what is wrong, the form that works), not the lexer's report. A key the config does not
have is named with the nearest one it does ("did you mean"), not with Hydra's advice to add it with ``+``."""

import difflib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from project.options.errors import ConfigError, exit_with

_OPENERS = {"[": "]", "(": ")", "{": "}"}
# The Hydra releases whose private override step explained_unknown_keys wraps (their loader has the same one).
HYDRA_RELEASES = ("1.3.",)


def _unclosed(text: str) -> str | None:
    """The first bracket or quote ``text`` opens and never closes, None if each is closed."""
    stack: list[str] = []
    quote = None
    for char in text:
        if quote is not None:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in _OPENERS:
            stack.append(char)
        elif stack and char == _OPENERS[stack[-1]]:
            stack.pop()
    return quote if quote is not None else (stack[-1] if stack else None)


def override_error(override: str, hydra_message: str) -> ConfigError:
    """The ``ConfigError`` for ``override``, which Hydra's grammar refused with ``hydra_message``."""
    key, equals, value = override.partition("=")
    if not equals and not override.startswith("~"):
        suggestion = override.replace(": ", "=", 1).replace(":", "=", 1) if ":" in override else f"{override}=<value>"
        problem = "has no '=': an override is key=value (key: value is how a YAML file writes it)."
        fix = f"write {suggestion}."
    elif (opened := _unclosed(value)) is not None:
        problem = f"opens {opened} and never closes it."
        fix = f"close it, e.g. {key}=[32,64] for a list, or quote text: {key}='a b' (and the override for the shell)."
    else:
        problem = f"is not an override Hydra can read: {hydra_message.splitlines()[0]}."
        fix = (
            "write key=value; a list as key=[a,b], text with spaces or =,:[]{}() in quotes: key='a=b' (and the "
            "whole override in quotes for the shell); see python train.py --help."
        )
    return ConfigError(f"override {override!r}", problem, fix)


def check_overrides(argv: list[str]) -> None:
    """Exit with a config error if any override in ``argv`` (the arguments after the script) is malformed."""
    from hydra._internal.utils import get_args_parser  # Hydra's own command-line parser: its flags take values
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for override in get_args_parser().parse_known_args(argv)[0].overrides:
        try:
            parser.parse_overrides([override])
        except OverrideParseException as error:
            exit_with(override_error(override, str(error)))


def unknown_key_error(key: str, value: str, cfg: DictConfig) -> ConfigError | None:
    """The ``ConfigError`` for the override ``key=value`` where ``cfg`` has no ``key``, naming the nearest key it
    has (each dotted part matched among its node's keys); None where ``key`` is there, or could be set there: an
    index of a list, a key of a node that takes new keys (not in struct mode)."""
    node: Any = cfg
    parts = key.split(".")
    for depth, part in enumerate(parts):
        where = ".".join(parts[:depth]) or "the config"
        if isinstance(node, ListConfig) and part.isdigit():
            if int(part) >= len(node):
                return ConfigError(key, f"is past the end of {where}, a list of {len(node)}.", f"set {where}.")
            node = node._get_node(int(part))
            continue
        if not isinstance(node, DictConfig):  # a value: it has no keys
            return ConfigError(key, f"goes below {where}, which is a value, not a node of keys.", f"set {where}.")
        names = [str(name) for name in node]  # not `part in node`, False for a mandatory value (???) not yet set
        if part in names:
            node = node._get_node(part)  # the node itself: its value may be an interpolation not yet resolvable
            continue
        if not OmegaConf.is_struct(node):
            return None  # it takes new keys: the override adds this one
        close = difflib.get_close_matches(part, names, n=1, cutoff=0.6)
        meant = ".".join([*parts[:depth], close[0], *parts[depth + 1 :]]) if close else None
        listed = f"its keys are {', '.join(names)}" if len(names) <= 12 else "python train.py --cfg job lists them"
        return ConfigError(
            key,
            f"is not a key of {where}" + (f": did you mean {meant}?" if meant else f" ({listed})."),
            f"write {meant}={value}." if meant else "set one of its keys (python train.py --cfg job shows them).",
        )
    return None


def check_swept_keys(config: DictConfig) -> None:
    """Exit with a config error if a sweep's swept key (``trainer.max_epochs=3,4``, or a key of an Optuna search
    space, ``hydra.sweeper.params``) is not in ``config``, the sweep's config: Hydra applies those only as each job
    starts, after the sweep dir is made. Keys below a swept or searched group (``strategy=ddp,fsdp
    strategy.timeout=60``) are left to each job: which keys there are depends on the option; so are keys added
    with + or ++."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = config.hydra.sweeper.get("params") or {}
    lines = [str(line) for line in config.hydra.overrides.task] + [f"{key}={value}" for key, value in params.items()]
    overrides = OverridesParser.create().parse_overrides(lines)
    searched = {f"{key}={value}" for key, value in params.items()}  # a search space's keys: each is searched
    groups = set(config.hydra.runtime.choices)  # strategy, model, hydra/launcher, ...
    swept = [o for o in overrides if o.is_sweep_override() or o.input_line in searched]
    swept_groups = {o.key_or_group.replace("/", ".") for o in swept if o.key_or_group in groups}
    for override in swept:
        key = override.key_or_group
        if key in groups or override.is_add() or override.is_force_add() or override.package is not None:
            continue
        if not any(key.startswith(f"{group}.") for group in swept_groups):
            error = unknown_key_error(key, override.get_value_string(), config)
            if error is not None:
                exit_with(error)


def _explained(override: Any, cfg: DictConfig) -> ConfigError | None:
    """``unknown_key_error`` for a plain override; for a dict value (``model.optimizer={lr:0.1}``), for each of its
    keys too, which Hydra merges into the node."""
    key = override.key_or_group
    error = unknown_key_error(key, override.get_value_string(), cfg)
    value = override.value()
    if error is None and isinstance(value, dict):
        error = next(
            (e for name, item in value.items() if (e := unknown_key_error(f"{key}.{name}", str(item), cfg))), None
        )
    return error


@contextmanager
def explained_unknown_keys() -> Iterator[None]:
    """While inside, Hydra's composition names a key the config lacks with the nearest it has.

    Why a private function of Hydra's is wrapped: Hydra has no hook for an override that fails to apply (its message
    advises adding the key with +, which the constructor then refuses after start-up), and ``hydra.main`` prints its
    composition error and exits itself (``run_and_report``), before any code of ours could catch it. So its loader's
    override step (``ConfigLoaderImpl._apply_overrides_to_config``) is wrapped while ``train.py``'s ``main`` runs,
    and put back after: each override applied in turn, as Hydra does, and a missing key's error replaced by ours (the
    process exits 1 with it, as with every bad input). Only on the Hydra releases it was written against
    (``HYDRA_RELEASES``): on any other, Hydra's own message stands."""
    import hydra
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    apply = getattr(ConfigLoaderImpl, "_apply_overrides_to_config", None)
    if apply is None or not hydra.__version__.startswith(HYDRA_RELEASES):
        yield
        return

    def apply_explained(overrides: list, cfg: DictConfig) -> None:
        for override in overrides:
            # Found before the override is applied: a failed update can leave a part of it in cfg. Only a plain
            # key=value is explained: +, ++ and ~ get Hydra's own messages, which are about them.
            plain = not (override.is_add() or override.is_force_add() or override.is_delete() or override.package)
            explained = _explained(override, cfg) if plain else None
            try:
                apply([override], cfg)
            except ConfigCompositionException as error:
                if explained is None or not isinstance(error.__cause__, (ConfigAttributeError, ConfigKeyError)):
                    raise
                exit_with(explained)  # SystemExit: Hydra would add its HYDRA_FULL_ERROR hint below ours

    ConfigLoaderImpl._apply_overrides_to_config = staticmethod(apply_explained)  # type: ignore[method-assign]
    try:
        yield
    finally:
        ConfigLoaderImpl._apply_overrides_to_config = staticmethod(apply)  # type: ignore[method-assign]
