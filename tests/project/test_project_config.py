"""Package metadata and the test configuration in pyproject.toml."""

from __future__ import annotations

import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib") if sys.version_info >= (3, 11) else pytest.importorskip("tomli")
    return tomllib.loads(PYPROJECT.read_text())


def _keras_requirement():
    from packaging.requirements import Requirement

    return next(Requirement(dep) for dep in _pyproject()["project"]["dependencies"] if re.match(r"keras\b", dep))


def test_pyproject_the_keras_gate_ci_and_readme_agree_on_the_keras_range():
    from keras_dtensor_mixfix._keras.boundary import keras_modules

    oldest, newest = "%d.%d" % keras_modules.OLDEST_KERAS, "%d.%d" % keras_modules.NEWEST_KERAS
    # The floor only, as for torch: the run-time gate refuses a newer Keras unless opted in (pyproject's comment).
    assert str(_keras_requirement().specifier) == f">={oldest}", _keras_requirement()
    ci = (ROOT / ".ci" / "run").read_text()
    ci_oldest = re.search(r'^OLDEST_KERAS="(\d+\.\d+)\.\d+"$', ci, re.M)
    ci_newest = re.search(r"keras-nightly==(\d+\.\d+)\.", ci)
    assert ci_oldest and ci_oldest.group(1) == oldest, "CI runs the Keras tests on the oldest supported Keras"
    assert ci_newest and ci_newest.group(1) == newest, "CI runs the Keras tests on the newest supported Keras"
    checked = {".".join(version.split(".")[:2]) for version in keras_modules.CHECKED_RELEASES}
    assert {oldest, newest} <= checked
    for text in ((ROOT / "README.md").read_text(), (ROOT / "docs" / "keras.md").read_text()):
        assert f"Keras {oldest} to {newest}" in text


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
        """  # noqa: E501 - the test file's source, as written
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
    assert ci_oldest and ci_oldest.group(1) == oldest, "CI runs the release layers on the oldest supported release"
    assert ci_newest and ci_newest.group(1) == newest, "CI runs the whole suite on the newest supported release"
    readme = (ROOT / "README.md").read_text()
    assert f"torch {oldest} to {newest}" in readme


def test_every_supported_minor_release_is_run_and_the_repros_name_each():
    from keras_dtensor_mixfix._torch import versions

    every = {(versions.OLDEST_TORCH[0], minor)
             for minor in range(versions.OLDEST_TORCH[1], versions.NEWEST_TORCH[1] + 1)}
    contributing = (ROOT / "CONTRIBUTING.md").read_text()
    section = contributing[contributing.index("### The supported torch range"):contributing.index("### Keras 3.16")]
    named = {tuple(int(p) for p in m.split(".")[:2]) for m in re.findall(r"\b(2\.\d+)\.\d+\b", section)}
    assert every <= named, f"CONTRIBUTING's torch range names no environment for {sorted(every - named)}"
    ci = (ROOT / ".ci" / "run").read_text()
    # a phase run in turn, or a release layer started beside the others
    phases = re.findall(r'^(?:phase|start_layer) "(?:suite, )?torch ([^ "]+)', ci, re.M)
    variables = dict(re.findall(r'^(\w+_TORCH)="([\d.]+)"', ci, re.M))
    run = {tuple(int(p) for p in variables.get(name.strip("${}"), name).split(".")[:2]) for name in phases}
    assert every <= run, f".ci/run has no phase for torch {sorted(every - run)}"
    from keras_dtensor_mixfix._upstream import TORCH_RELEASES

    # the upstream-defect table, from which tests/patterns/test_torch_repros.py runs every repro, lists each one
    assert set(TORCH_RELEASES) == every, "the upstream-defect table's torch releases are the supported range"


def test_no_test_folder_is_named_like_a_package_the_tests_import():
    # tests/ is on sys.path (conftest.py and the shared helpers live there), so each folder in it is importable as a
    # namespace package by its name: a tests/transformers/ folder was imported as `transformers` where transformers
    # is not installed, and `pytest.importorskip("transformers")` then ran the tests instead of skipping them.
    import ast
    import sys

    tests = ROOT / "tests"
    folders = {path.name for path in tests.iterdir() if path.is_dir() and not path.name.startswith((".", "_"))}
    imported = set()
    for path in tests.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip" and node.args
                  and isinstance(node.args[0], ast.Constant)):
                imported.add(str(node.args[0].value).split(".")[0])
    known = imported | set(sys.stdlib_module_names) | {"torch", "keras", "keras_hub", "transformers", "jax", "numpy"}
    assert "transformers" in imported and "keras" in imported  # the scan sees the imports it guards against
    assert sorted(folders & known) == []


MODULE_LINE_LIMIT = 400
"""The most lines a module of the package may have: past it, one concern has become two (split it by concern)."""


def test_no_module_of_the_package_is_over_the_line_limit():
    package = ROOT / "src" / "keras_dtensor_mixfix"
    sizes = {str(path.relative_to(package)): len(path.read_text().splitlines()) for path in package.rglob("*.py")}
    assert len(sizes) > 100  # the walk found the package
    assert not {name: lines for name, lines in sizes.items() if lines > MODULE_LINE_LIMIT}
