"""The Keras integration's layout: every declared override is installed, and each package's map names its modules.

``_keras/`` is in sub-packages by role (``_keras/__init__.py``); an import-linter contract in ``pyproject.toml``
orders them. These tests hold what the contract cannot: that an ``Override`` a module declares is in
``keras_integration.OVERRIDES`` (a declaration left out would silently never be applied), and that the module maps
in the packages' docstrings name exactly the modules there are.
"""

from __future__ import annotations

import importlib
import pathlib
import pkgutil
import re

import keras_dtensor_mixfix._keras as keras_package
from keras_dtensor_mixfix import keras_integration
from keras_dtensor_mixfix._keras.boundary.overrides import Override

PACKAGE_DIR = pathlib.Path(keras_package.__file__).parent


def _modules():
    return [importlib.import_module(info.name)
            for info in pkgutil.walk_packages(keras_package.__path__, keras_package.__name__ + ".")]


def _named_modules(docstring: str) -> set:
    return set(re.findall(r":mod:`\.([a-z_]+)`", docstring or ""))


def test_every_override_a_module_declares_is_in_the_install_tuple():
    declared = {}
    for module in _modules():
        for name, value in vars(module).items():
            if isinstance(value, Override):
                declared.setdefault(value.name, []).append(f"{module.__name__}.{name}")
    installed = {override.name for override in keras_integration.OVERRIDES}
    assert len(declared) >= 25  # the scan sees the integration's overrides
    missing = sorted(set(declared) - installed)
    assert not missing, f"declared but not in keras_integration.OVERRIDES (never applied): {missing}: {declared}"
    assert not sorted(installed - set(declared)), "OVERRIDES holds an override no _keras module declares"


def test_each_sub_package_names_its_modules_and_the_overview_names_each_sub_package():
    sub_packages = sorted(path.parent.name for path in PACKAGE_DIR.glob("*/__init__.py"))
    assert len(sub_packages) >= 5
    assert _named_modules(keras_package.__doc__) == set(sub_packages)
    assert not [path.name for path in PACKAGE_DIR.glob("*.py") if path.name != "__init__.py"], (
        "a module of the Keras integration belongs in the sub-package of its role (_keras/__init__.py)")
    for name in sub_packages:
        package = importlib.import_module(f"{keras_package.__name__}.{name}")
        modules = {path.stem for path in (PACKAGE_DIR / name).glob("*.py") if path.stem != "__init__"}
        assert _named_modules(package.__doc__) == modules, f"_keras/{name}/__init__.py's map"
