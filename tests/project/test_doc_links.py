"""The documentation holds together: README.md stays short, and every link and module name in it still points somewhere.

README.md is the entry point and links into ``docs/`` and CONTRIBUTING.md for everything else, so a moved file,
a renamed heading or a renamed private module would leave a reader at a dead end without any block failing.
Links and names are read from the prose only (fenced blocks are left out: they are tested in test_readme.py).
"""

from __future__ import annotations

import pathlib
import re
from typing import Dict, Iterator, List, Tuple

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "keras_dtensor_mixfix"
DOCS = ["README.md", "CONTRIBUTING.md"] + sorted(f"docs/{page.name}" for page in (ROOT / "docs").glob("*.md"))
README_MAX_LINES = 200
PAGES = ["docs/keras.md", "docs/transformers.md", "docs/rules.md", "docs/architecture.md", "docs/performance.md",
         "docs/troubleshooting.md", "docs/testing.md", "docs/gpu.md", "CONTRIBUTING.md"]
"""What README.md's table links to: the pages the documentation is split into."""

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_PRIVATE_PATH = re.compile(r"`(_[a-z_]+(?:/[a-z_]+)*(?:/|\.py))`")  # `_torch/api.py`, `_keras/`
_PRIVATE_DOTTED = re.compile(r"`keras_dtensor_mixfix((?:\.\w+)+)")  # `keras_dtensor_mixfix._torch.api`


def _prose(path: str) -> str:
    """The file without its fenced blocks (their lines kept empty, so line numbers hold)."""
    return re.sub(r"^```.*?^```", lambda found: "\n" * found.group(0).count("\n"),
                  (ROOT / path).read_text(), flags=re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: str) -> List[str]:
    seen: Dict[str, int] = {}
    anchors = []
    for line in _prose(path).splitlines():
        if re.match(r"#{1,6} ", line):
            slug = _slug(line.lstrip("#"))
            anchors.append(slug if slug not in seen else f"{slug}-{seen[slug]}")  # GitHub numbers repeats
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _links(path: str) -> Iterator[Tuple[int, str]]:
    for number, line in enumerate(_prose(path).splitlines(), 1):
        for target in _LINK.findall(line):
            yield number, target


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def test_readme_links_every_page_and_every_page_is_linked():
    linked = {target.split("#")[0] for _, target in _links("README.md")}
    assert set(PAGES) <= linked, set(PAGES) - linked
    assert set(DOCS) - {"README.md"} <= set(PAGES), "a page in docs/ that the README's table does not list"


def test_every_relative_link_points_to_a_file_and_heading_that_exist():
    checked = 0
    for path in DOCS:
        for number, target in _links(path):
            if re.match(r"[a-z]+:", target):  # https:, mailto:: not ours to check offline
                continue
            file_part, _, anchor = target.partition("#")
            linked = (ROOT / path).parent / file_part if file_part else ROOT / path
            assert linked.exists(), f"{path}:{number}: {target} points to no file"
            if anchor:
                relative = linked.resolve().relative_to(ROOT).as_posix()
                assert anchor in _anchors(relative), f"{path}:{number}: {relative} has no heading #{anchor}"
            checked += 1
    assert checked >= 20, checked  # the README's table alone has 8


def test_private_modules_the_documentation_names_exist():
    # Private modules move freely (docs/architecture.md names as few as it can): a name left behind fails here.
    named = 0
    for path in DOCS:
        prose = _prose(path)
        for name in _PRIVATE_PATH.findall(prose):
            assert (PACKAGE / name).exists(), f"{path} names `{name}`, which is not in the package"
            named += 1
        for dotted in _PRIVATE_DOTTED.findall(prose):
            here = PACKAGE
            for part in dotted.strip(".").split("."):
                if (here / part).is_dir():
                    here = here / part
                elif (here / f"{part}.py").exists():
                    break  # a module; what follows is an attribute
                else:
                    assert not part.startswith("_"), f"{path} names keras_dtensor_mixfix{dotted}, which is not there"
                    break
            named += 1
    assert named > 0
