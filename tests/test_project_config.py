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


def test_keras_bound_says_what_was_tested():
    project = _pyproject()["project"]
    keras = next(dep for dep in project["dependencies"] if re.match(r"keras\b", dep))
    assert "<3.17" in keras  # 3.15.1 and keras-nightly 3.16.0.dev are what CI runs
    text = PYPROJECT.read_text()
    assert "3.15.1" in text and "3.16.0.dev2026102704" in text
    # No placeholder URLs: [project.urls] only once the project has real ones.
    assert "example.com" not in text and "your-org" not in text.lower()


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
