"""The ranges of the options a user sets, declared in the constructors' type hints and checked before launch by
``project.config.schema``: ``batch_size: PositiveInt`` is the whole rule for ``data.batch_size``.

Each alias is ``Annotated[<type>, <constraint>]``: Python reads it as the plain type, and the schema reads the
constraint. Free of heavy imports: models and data modules, the lowest layers, use these.
"""

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated


@dataclass(frozen=True)
class Range:
    """Numbers from ``low`` to ``high``, each end included unless it is open."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def holds(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self, integer: bool) -> str:
        """What a value must be, as the error says it: "a positive integer", "a number from 0 to 1 (1 excluded)"."""
        noun = "an integer" if integer else "a number"

        def number(end: float) -> str:
            return str(int(end)) if integer else f"{end:g}"

        if self.high == math.inf:
            if (self.low, self.low_open) == (0, True) or (integer and (self.low, self.low_open) == (1, False)):
                return f"a positive {noun.split()[1]}"
            return f"{noun} {'above' if self.low_open else 'of at least'} {number(self.low)}"
        excluded = [end for end, is_open in ((self.low, self.low_open), (self.high, self.high_open)) if is_open]
        note = f" ({' and '.join(number(end) for end in excluded)} excluded)" if excluded else ""
        return f"{noun} from {number(self.low)} to {number(self.high)}{note}"


@dataclass(frozen=True)
class ExistingPath:
    """A path to an existing ``kind``: "file" or "dir"."""

    kind: str

    def holds(self, value: str) -> bool:
        return Path(value).is_file() if self.kind == "file" else Path(value).is_dir()

    def describe(self, integer: bool) -> str:
        return f"an existing {'directory' if self.kind == 'dir' else 'file'}"


PositiveInt = Annotated[int, Range(low=1)]
NonNegativeInt = Annotated[int, Range(low=0)]
Seed = Annotated[int, Range(low=0, high=2**32 - 1)]  # what NumPy and Lightning's seed_everything take
PositiveFloat = Annotated[float, Range(low=0, low_open=True)]
NonNegativeFloat = Annotated[float, Range(low=0)]
Probability = Annotated[float, Range(low=0, high=1, high_open=True)]  # dropout: 1 would drop everything
Fraction = Annotated[float, Range(low=0, high=1)]
OpenFraction = Annotated[float, Range(low=0, high=1, low_open=True, high_open=True)]  # a split: neither side empty
ExistingFile = Annotated[str, ExistingPath("file")]
ExistingDir = Annotated[str, ExistingPath("dir")]
