"""Check that the built distributions hold the whole package, and that the running Python uses the wheel's copy.

    python tools/check_install.py DIST_DIR

Run in an environment where the wheel from ``DIST_DIR`` is installed (not editable). Exit status 0 when:

- the wheel holds every module and data file of ``src/keras_dtensor_mixfix`` (``py.typed`` included) and
  declares the entry points the package relies on (auto-activation, the pytest plugin, the command);
- the sdist holds the sources, ``pyproject.toml``, ``README.md`` and ``LICENSE``, so a wheel built from it is
  the same package;
- ``import keras_dtensor_mixfix`` finds the installed copy, not this checkout's ``src/``, and its installed
  files are the wheel's.

Each failure is printed with what is missing. CI runs it (``.ci/run``) before the unit layer and the quick start
run from the same environment.
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import sys
import tarfile
import zipfile
from typing import List, Set

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "keras_dtensor_mixfix"
SOURCE = ROOT / "src" / PACKAGE
ENTRY_POINTS = {("torch.backends", PACKAGE), ("pytest11", PACKAGE), ("console_scripts", "keras-dtensor-mixfix")}


def _package_files() -> Set[str]:
    """Every file of the package in the checkout, as paths relative to ``src/`` (caches left out)."""
    return {path.relative_to(SOURCE.parent).as_posix() for path in SOURCE.rglob("*")
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"}


def _check_wheel(wheel: pathlib.Path, expected: Set[str]) -> List[str]:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    problems = [f"{wheel.name} lacks {name}" for name in sorted(expected - names)]
    declared = {(ep.group, ep.name) for ep in importlib.metadata.distribution(PACKAGE).entry_points}
    problems += [f"the installed distribution declares no {group} entry point {name!r}"
                 for group, name in sorted(ENTRY_POINTS - declared)]
    return problems


def _check_sdist(sdist: pathlib.Path, expected: Set[str]) -> List[str]:
    with tarfile.open(sdist) as archive:
        # members are "<name>-<version>/<path>"
        names = {member.name.split("/", 1)[1] for member in archive.getmembers() if "/" in member.name}
    wanted = {f"src/{name}" for name in expected} | {"pyproject.toml", "README.md", "LICENSE"}
    return [f"{sdist.name} lacks {name}" for name in sorted(wanted - names)]


def _check_imported(expected: Set[str]) -> List[str]:
    import keras_dtensor_mixfix

    location = pathlib.Path(keras_dtensor_mixfix.__file__).resolve().parent
    if location == SOURCE.resolve():
        return [f"import {PACKAGE} found the checkout ({location}), not the installed wheel: run from an "
                "environment where the wheel is installed without -e"]
    installed = {path.relative_to(location.parent).as_posix() for path in location.rglob("*")
                 if path.is_file() and "__pycache__" not in path.parts}
    return [f"the installed package ({location}) lacks {name}" for name in sorted(expected - installed)]


def main(argv: List[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    dist = pathlib.Path(argv[0])
    wheels, sdists = sorted(dist.glob(f"{PACKAGE}-*.whl")), sorted(dist.glob(f"{PACKAGE}-*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        print(f"{dist}: expected one wheel and one sdist of {PACKAGE}, found {wheels + sdists}", file=sys.stderr)
        return 1
    expected = _package_files()
    problems = _check_wheel(wheels[0], expected) + _check_sdist(sdists[0], expected) + _check_imported(expected)
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print(f"{wheels[0].name} and {sdists[0].name}: {len(expected)} package files each, installed copy in use")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
