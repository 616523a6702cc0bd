"""The command line's overrides parsed as Hydra parses them, before Hydra does: a malformed one is a config error in
one sentence (which override, what is wrong, the form that works), not the lexer's report."""

from project.options.errors import ConfigError, exit_with

_OPENERS = {"[": "]", "(": ")", "{": "}"}


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
