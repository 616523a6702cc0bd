"""The error users see for a config that cannot work. Kept free of heavy imports, so ``train.py`` (and its
``--help``) can catch it without loading torch."""


class ConfigError(ValueError):
    """A config value that cannot work; ``str()`` is the message for the user: the key, the problem and the fix."""

    def __init__(self, key: str, problem: str, fix: str) -> None:
        super().__init__(f"{key}: {problem} Fix: {fix}")
        self.key, self.problem, self.fix = key, problem, fix

    def __reduce__(self) -> tuple:  # picklable, so that torchrun's rank 0 can send it to the other ranks
        return ConfigError, (self.key, self.problem, self.fix)
