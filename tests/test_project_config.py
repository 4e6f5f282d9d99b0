"""Package metadata and the test configuration in pyproject.toml."""

from __future__ import annotations

import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib") if sys.version_info >= (3, 11) else pytest.importorskip("tomli")
    return tomllib.loads(PYPROJECT.read_text())


def _keras_requirement():
    from packaging.requirements import Requirement

    return next(Requirement(dep) for dep in _pyproject()["project"]["dependencies"] if re.match(r"keras\b", dep))


def _tested_keras_versions():
    """The Keras releases the tests run on: the keras-nightly that .ci/run pins for its Keras 3.16 phase, and
    the Keras of this environment (the one `pip install -e .[test]` resolved, as in CI's other phases)."""
    from importlib import metadata

    from packaging.version import Version

    pinned = re.search(r"keras-nightly==(\S+)", (ROOT / ".ci" / "run").read_text())
    assert pinned, ".ci/run no longer pins keras-nightly: say here which Keras 3.16 CI tests"
    versions = [Version(pinned.group(1))]
    for distribution in ("keras", "keras-nightly"):
        try:
            versions.append(Version(metadata.version(distribution)))
        except metadata.PackageNotFoundError:
            pass
    return versions


def test_keras_requirement_admits_the_tested_releases_and_stops_before_the_next_minor():
    # The Keras integration patches Keras internals, so an untested minor release must not install with it.
    specifier = _keras_requirement().specifier
    tested = _tested_keras_versions()
    for version in tested:
        assert specifier.contains(version, prereleases=True), f"{specifier} refuses Keras {version}, which CI tests"
    newest = max(tested)
    next_minor = f"{newest.major}.{newest.minor + 1}"
    for untested in (f"{next_minor}.0.dev0", f"{next_minor}.0"):
        assert not specifier.contains(untested, prereleases=True), (
            f"{specifier} admits Keras {untested}; the newest tested is {newest}")


def test_no_placeholder_project_urls():
    # [project.urls] only once the project has real ones
    for name, url in _pyproject()["project"].get("urls", {}).items():
        assert "example.com" not in url and "your-org" not in url.lower(), (name, url)


def test_keras_deprecation_warnings_are_filtered_and_ours_are_not(pytester):
    pytester.makepyfile(test_warnings=
        """
        import warnings

        def test_emit():
            for module in ("keras.src.backend.torch.core", "keras_dtensor_mixfix._engine.check", "mylib"):
                warnings.warn_explicit("deprecated from " + module, DeprecationWarning, module + ".py", 1, module=module)
        """
    )
    result = pytester.runpytest_subprocess("-c", str(PYPROJECT), "--rootdir", str(pytester.path), "-p",
                                           "no:cacheprovider", str(pytester.path / "test_warnings.py"))
    result.assert_outcomes(passed=1, warnings=2)
    text = result.stdout.str()
    assert "deprecated from keras.src.backend.torch.core" not in text
    assert "deprecated from keras_dtensor_mixfix._engine.check" in text and "deprecated from mylib" in text


def test_pyproject_versions_ci_and_readme_agree_on_the_torch_range():
    from keras_dtensor_mixfix._torch import versions

    oldest, newest = "%d.%d" % versions.OLDEST_TORCH, "%d.%d" % versions.NEWEST_TORCH
    torch_dep = next(dep for dep in _pyproject()["project"]["dependencies"] if re.match(r"torch\b", dep))
    # The floor only: an install-time cap would make resolvers hold users back (see pyproject's comment).
    assert torch_dep.replace(" ", "") == f"torch>={oldest}", torch_dep
    ci = (ROOT / ".ci" / "run").read_text()
    ci_oldest = re.search(r'^OLDEST_TORCH="(\d+\.\d+)\.\d+"$', ci, re.M)
    ci_newest = re.search(r'^NEWEST_TORCH="(\d+\.\d+)\.\d+"$', ci, re.M)
    assert ci_oldest and ci_oldest.group(1) == oldest, "CI runs the whole suite on the oldest supported release"
    assert ci_newest and ci_newest.group(1) == newest, "CI runs the whole suite on the newest supported release"
    readme = (ROOT / "README.md").read_text()
    assert f"torch {oldest} to {newest}" in readme
