"""``make gpu-bundle``: the wheels an offline GPU box needs beside what it already has, in one directory.

A GPU box (a cluster node, a container) typically has torch with CUDA, Lightning and the Hugging Face libraries
installed, and no network. This writes, for CPython 3.12 on x86-64 Linux (override with --python-version):

- every package the project's runtime needs (``[project].dependencies``, the ``qlora`` and ``float8`` extras'
  torchao, and pytest for ``pytest -m gpu``) and their dependencies, at the versions installed here
  (``constraints.txt``'s), except the packages the box has (``--box-has``: torch and the rest, taken as complete
  installs, their own dependencies met there): hydra-core, omegaconf, the antlr4 runtime, wandb and its
  dependencies, the Hydra launchers, torchao, pytest;
- a wheel built from the sdist where a package publishes none (the antlr4 runtime);
- the project's build backend (setuptools), so that ``make gpu-check`` installs the checkout itself, editable;
- the project's own wheel, for a box that gets the bundle without the repo.

``make gpu-check`` installs it there with ``pip install --no-index``. Run it where pip reaches the registries,
after ``make install`` (the dependency graph is read from this environment's installed metadata).
"""

import argparse
import importlib.metadata as metadata
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
# What the GPU boxes this is made for already have (an image with torch 2.11 + CUDA, Lightning and the Hugging Face
# libraries). Only these names are assumed: what else the project needs is bundled even where such an image may have
# it, since the dependencies of these at the box's versions need not be those of the versions installed here.
BOX_HAS = ["torch", "lightning", "torchmetrics", "transformers", "safetensors", "tokenizers", "rich"]
LIMIT_MIB = 64  # what can travel to the box beside the working tree


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def target_markers(python_version: str) -> dict[str, str]:
    """PEP 508 marker values of CPython ``python_version`` on x86-64 Linux."""
    return {
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "os_name": "posix",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
    }


def closure(roots: list[Requirement], markers: dict[str, str], stop: set[str] = frozenset()) -> dict[str, str]:
    """Every distribution ``roots`` need on the target (extras followed), by canonical name, with the version
    installed here; the names in ``stop`` and what only they need are left out."""
    found: dict[str, set[str]] = {}
    todo = [(requirement.name, set(requirement.extras)) for requirement in roots]
    while todo:
        name, extras = todo.pop()
        key = canonical(name)
        if key in stop or (key in found and extras <= found[key]):
            continue
        found.setdefault(key, set()).update(extras)
        for line in metadata.distribution(name).requires or []:
            requirement = Requirement(line)
            wanted = requirement.marker is None or any(
                requirement.marker.evaluate({**markers, "extra": extra}) for extra in ["", *found[key]]
            )
            if wanted:
                todo.append((requirement.name, set(requirement.extras)))
    return {key: metadata.version(key) for key in found}


def pip(*args: str, quiet_failure: bool = False) -> None:
    """``pip <args>``; with ``quiet_failure`` its error output is kept back (the caller has another way)."""
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, stderr=subprocess.PIPE if quiet_failure else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the bundle directory (emptied first)")
    parser.add_argument("--python-version", default="3.12", help="the box's CPython, major.minor")
    parser.add_argument("--box-has", nargs="*", default=BOX_HAS, help="distributions the box already has")
    args = parser.parse_args()
    markers = target_markers(args.python_version)
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    optional = pyproject["project"]["optional-dependencies"]
    # torchao (QLoRA's NF4, Float8 training), which GPU boxes lack
    extras = [*optional["qlora"], *optional["float8"]]
    roots = [Requirement(line) for line in [*pyproject["project"]["dependencies"], *extras, "pytest"]]
    on_box = {canonical(name) for name in args.box_has}
    needed = closure(roots, markers, stop=on_box)
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    platform = [
        f"--platform={tag}"
        for tag in (
            "manylinux_2_28_x86_64",
            "manylinux_2_17_x86_64",
            "manylinux2014_x86_64",
            "manylinux_2_5_x86_64",
            "manylinux1_x86_64",
        )
    ]
    target = ["--only-binary=:all:", f"--python-version={args.python_version}", "--implementation=cp", *platform]
    with tempfile.TemporaryDirectory() as sdists:
        for name, version in sorted(needed.items()):
            try:
                pip(
                    "download",
                    "-q",
                    "--no-deps",
                    *target,
                    "-d",
                    str(args.out),
                    f"{name}=={version}",
                    quiet_failure=True,
                )
            except subprocess.CalledProcessError:  # no wheel published (antlr4-python3-runtime): build it
                pip("download", "-q", "--no-deps", "--no-binary=:all:", "-d", sdists, f"{name}=={version}")
                pip("wheel", "-q", "--no-deps", "-w", str(args.out), *Path(sdists).glob("*"))
                for sdist in Path(sdists).iterdir():
                    sdist.unlink()
    pip("download", "-q", "--no-deps", *target, "-d", str(args.out), *pyproject["build-system"]["requires"])
    pip("wheel", "-q", "--no-deps", "-w", str(args.out), str(REPO))
    wheels = sorted(args.out.glob("*.whl"))
    names = [canonical(wheel.name.split("-")[0]) for wheel in wheels]
    cuda = [name for name in names if name in ("torch", "triton") or name.startswith(("nvidia-", "cuda-"))]
    if cuda:  # the box's own build must stay: a --box-has without torch would bring these in
        sys.exit(f"the bundle would hold torch or CUDA packages ({', '.join(cuda)}): name torch in --box-has")
    size = sum(wheel.stat().st_size for wheel in wheels) / 2**20
    print(
        f"{args.out}: {len(wheels)} wheels, {size:.1f} MiB (limit {LIMIT_MIB} MiB); left to the box: "
        f"{', '.join(sorted(on_box))}"
    )
    for wheel in wheels:
        print(f"  {wheel.stat().st_size / 2**20:6.2f} MiB  {wheel.name}")
    if size > LIMIT_MIB:
        sys.exit(f"the bundle is {size:.1f} MiB, over the {LIMIT_MIB} MiB that can travel")


if __name__ == "__main__":
    main()
