"""``python tests/helpers/count_calls.py <out.json> <function>... -- <train.py args>``: run ``train.py`` in this
process and write how many times each named function (``module:function``) was called, counted by a profile hook
on the function's code, whatever name it was imported under."""

import json
import runpy
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    out, rest = sys.argv[1], sys.argv[2:]
    split = rest.index("--")
    wanted, args = rest[:split], rest[split + 1 :]
    # A module-level function's code is named by its file and name: project.config.checks:check_config ->
    # (<repo>/project/config/checks.py, check_config).
    targets = {}
    for name in wanted:
        module, function = name.split(":")
        targets[(str(REPO / (module.replace(".", "/") + ".py")), function)] = name
    counts: Counter[str] = Counter({name: 0 for name in wanted})

    def profile(frame, event, arg) -> None:
        if event == "call":
            name = targets.get((frame.f_code.co_filename, frame.f_code.co_name))
            if name is not None:
                counts[name] += 1

    sys.argv = [str(REPO / "train.py"), *args]
    sys.path[0] = str(REPO)
    sys.setprofile(profile)
    try:
        runpy.run_path(str(REPO / "train.py"), run_name="__main__")
    except SystemExit as exit:
        if exit.code not in (None, 0):
            raise
    finally:
        sys.setprofile(None)
        Path(out).write_text(json.dumps(counts))


if __name__ == "__main__":
    main()
