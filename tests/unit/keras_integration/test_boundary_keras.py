"""The Keras boundary: only ``_keras/keras_modules.py`` names ``keras.src``, and nothing imports Keras early."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

import keras_dtensor_mixfix

PACKAGE_DIR = pathlib.Path(keras_dtensor_mixfix.__file__).parent
BOUNDARY = PACKAGE_DIR / "_keras" / "keras_modules.py"


def _run(code: str, **env: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, **env})
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_only_the_boundary_names_keras_src():
    # Text, not imports: a docstring or a module name in a string is a keras.src name to keep up to date too.
    offenders = sorted(str(path.relative_to(PACKAGE_DIR)) for path in PACKAGE_DIR.rglob("*.py")
                       if path != BOUNDARY and "keras.src" in path.read_text(encoding="utf-8"))
    assert offenders == [], f"name Keras' private modules through _keras/keras_modules.py instead: {offenders}"
    assert "keras.src" in BOUNDARY.read_text(encoding="utf-8")  # the scan looks at the right file


def test_boundary_says_which_keras_releases_it_was_checked_on():
    from keras_dtensor_mixfix._keras import keras_modules

    assert "3.15.1" in keras_modules.__doc__ and "3.16.0.dev2026102704" in keras_modules.__doc__


def test_the_keras_integration_imports_no_keras_until_installed():
    # Every module of the integration imports Keras inside functions: importing them (as `import torch`
    # does through auto-activation, and keras_integration's own imports) must not import Keras.
    modules = ["keras_dtensor_mixfix._autoload", "keras_dtensor_mixfix.keras_integration",
               "keras_dtensor_mixfix.hookspecs"] + sorted(
        f"keras_dtensor_mixfix._keras.{path.stem}" for path in (PACKAGE_DIR / "_keras").glob("*.py")
        if path.stem != "__init__")
    out = _run("import importlib, sys\n"
               f"for name in {modules!r}:\n"
               "    importlib.import_module(name)\n"
               "print(sorted(m for m in sys.modules if m == 'keras' or m.startswith('keras.')))\n",
               KERAS_DTENSOR_MIXFIX="1")  # auto-activation on: `import torch` runs it
    assert out.strip() == "[]"


@pytest.mark.keras
@pytest.mark.skipif(importlib.util.find_spec("keras") is None, reason="Keras is not installed")
def test_every_boundary_name_resolves_on_the_installed_keras():
    out = _run(
        "import sys, keras\n"
        "from keras_dtensor_mixfix._keras import keras_modules as k\n"
        "names = ['core', 'backend_numpy', 'backend_nn', 'trainer_module', 'trainer_class', 'backend_package',\n"
        "         'torch_backend_package', 'distribution_module', 'data_parallel_class', 'tensor_layout_class',\n"
        "         'tree', 'layer_class', 'global_state', 'base_variable_class', 'data_adapters',\n"
        "         'data_adapter_utils', 'saving_lib', 'rng_utils', 'lib']\n"
        "missing = [n for n in names if getattr(k, n)() is None]\n"
        "print('missing', missing, k.backend_name(), k.distribution())\n"
        "print('triggers', all(any(m in sys.modules for m in names) for names in k.INSTALL_TRIGGERS))\n"
        "print('torch lib', k.TORCH_DISTRIBUTION_LIB in sys.modules, k.lib().__name__)\n",
        KERAS_BACKEND="torch", KERAS_DTENSOR_MIXFIX="1")
    assert "missing [] torch None" in out
    assert "triggers True" in out  # `import keras` loads one module of each: auto-activation installs then
    assert "torch lib True" in out  # ours on 3.15.1 (installed by auto-activation) or Keras' own (3.16)
