"""README.md and docs/*.md: their links, anchors and the code paths they name all exist.

Fast and without subprocesses: each check reads the markdown files and looks at the file system, nothing is imported.
- every relative link ``[text](path)`` or ``[text](path#anchor)`` (images included) names an existing file,
  relative to the linking file's dir; http(s) and mailto links are left alone;
- every ``#anchor``, on the same page or another, is a heading of the target page under GitHub's slug rules;
- every backticked repo path (``project/...``, ``tests/...``, ``benchmarks/...``, ``scripts/...``, ``conf/...``,
  ``docs/...``, or any ``a/b.py`` / ``a/b.yaml``) exists, and every dotted module name ``project.x.y`` (backticked, or
  after ``python -m`` anywhere, code blocks included) is a module, a package, or an attribute of a module.
"""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
IDS = [str(path.relative_to(REPO)) for path in DOC_FILES]

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
PATH_PREFIXES = ("project/", "tests/", "benchmarks/", "scripts/", "conf/", "docs/")
MODULE_AFTER_M = re.compile(r"python3?\s+-m\s+(project(?:\.\w+)+)")
DOTTED_MODULE = re.compile(r"^project(?:\.\w+)+$")


def split_fences(text: str) -> tuple[list[str], list[str]]:
    """The file's lines outside fenced code blocks, and those inside them."""
    prose, code, fenced = [], [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        (code if fenced else prose).append(line)
    return prose, code


def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lowercase, punctuation other than hyphens and underscores
    removed, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"<[^>]+>", "", text).lower()  # HTML tags
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in ``path``, duplicates numbered as GitHub numbers them (-1, -2...)."""
    prose, _ = split_fences(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    result = set()
    for line in prose:
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def links(path: Path) -> list[str]:
    """The targets of the markdown links outside code blocks and inline code."""
    prose, _ = split_fences(path.read_text(encoding="utf-8"))
    return [target for line in prose for target in LINK.findall(INLINE_CODE.sub("", line))]


def is_external(target: str) -> bool:
    return re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) is not None  # http:, https:, mailto:...


def module_exists(name: str) -> bool:
    """``project.a.b`` is project/a/b.py or a package project/a/b/; ``project.a.b.Name`` may also be an attribute of
    the module project/a/b.py, or a class (capitalised) that the package project/a/b/ exports."""
    parts = name.split(".")
    base = REPO.joinpath(*parts)
    if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
        return True
    parent = REPO.joinpath(*parts[:-1])
    if len(parts) > 2 and parent.with_suffix(".py").is_file():
        return True
    return len(parts) > 2 and (parent / "__init__.py").is_file() and parts[-1][:1].isupper()


def looks_like_path(word: str) -> bool:
    if word.startswith(PATH_PREFIXES):
        return True
    # a/b.py or a/b.yaml; not a job dir's own files (.hydra/overrides.yaml)
    return "/" in word and word.endswith((".py", ".yaml")) and not word.startswith(".")


def named_paths(path: Path) -> list[str]:
    """Repo paths named in backticks outside code blocks: each word of an inline code span that looks like one,
    with a trailing ``:line`` or ``::name`` removed; placeholders (``<...>``), globs and ``{a,b}`` are skipped."""
    prose, _ = split_fences(path.read_text(encoding="utf-8"))
    found = []
    for line in prose:
        for _, span in INLINE_CODE.findall(line):
            for word in span.split():
                word = re.sub(r"(::\w+|:\d+)$", "", word.rstrip(",;:)'\"").lstrip("('\""))
                if not looks_like_path(word) or any(mark in word for mark in "<>*?{}[]$"):
                    continue
                found.append(word)
    return found


def named_modules(path: Path) -> list[str]:
    """Dotted ``project.x.y`` names: backticked ones outside code blocks, and those after ``python -m`` anywhere."""
    text = path.read_text(encoding="utf-8")
    prose, _ = split_fences(text)
    found = MODULE_AFTER_M.findall(text)
    for line in prose:
        for _, span in INLINE_CODE.findall(line):
            found += [word for word in span.split() if DOTTED_MODULE.match(word)]
    return found


@pytest.mark.parametrize("doc", DOC_FILES, ids=IDS)
def test_links_resolve(doc: Path) -> None:
    broken = []
    for target in links(doc):
        if is_external(target):
            continue
        file_part, _, anchor = target.partition("#")
        destination = (doc.parent / file_part).resolve() if file_part else doc
        if not destination.exists():
            broken.append(f"{target}: no file {destination}")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target}: no heading #{anchor} in {destination.relative_to(REPO)}")
    assert not broken, f"{doc.relative_to(REPO)} links to what does not exist:\n" + "\n".join(broken)


@pytest.mark.parametrize("doc", DOC_FILES, ids=IDS)
def test_code_paths_exist(doc: Path) -> None:
    missing = sorted({word for word in named_paths(doc) if not (REPO / word.rstrip("/")).exists()})
    assert not missing, f"{doc.relative_to(REPO)} names paths that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("doc", DOC_FILES, ids=IDS)
def test_module_names_exist(doc: Path) -> None:
    missing = sorted({name for name in named_modules(doc) if not module_exists(name)})
    assert not missing, f"{doc.relative_to(REPO)} names modules that do not exist:\n" + "\n".join(missing)


def test_slugs_follow_github() -> None:
    assert github_slug("Tensor parallelism and 2D / 3D layouts") == "tensor-parallelism-and-2d--3d-layouts"
    assert github_slug("Will it fit? The memory plan") == "will-it-fit-the-memory-plan"
    assert github_slug("Metrics and W&B") == "metrics-and-wb"
    assert github_slug("What `make install` does") == "what-make-install-does"
    assert github_slug("Llama: today's decoder") == "llama-todays-decoder"
