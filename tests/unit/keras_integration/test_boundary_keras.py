"""The Keras boundary: only ``_keras/keras_modules.py`` names ``keras.src``, and nothing imports Keras early."""

from __future__ import annotations

import ast
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import textwrap
from typing import List

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


# ----------------------------------------------------------------------------- private Keras names, read elsewhere

PRIVATE_KERAS_READS = {
    # The ratchet: how many private Keras names each module reads outside the boundary today. A new read fails
    # (add an accessor to _keras/keras_modules.py, with a per-release check in _keras/checks.py); a module that
    # reads fewer fails too, until its count here is lowered, so the count only goes down.
    "_keras/checks.py": 3,
    "_keras/compile.py": 7,
    "_keras/data.py": 1,
    "_keras/reductions.py": 1,
    "_keras/saving.py": 4,
    "_keras/slice_loading.py": 1,
    "_keras/variables.py": 27,
}
"""Per module (relative to the package), the private attribute reads :func:`private_reads` finds in it."""

_ATTRIBUTE_FUNCTIONS = ("getattr", "hasattr")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_reads(source: str) -> List[str]:
    """The private attribute reads in ``source`` that may be of a Keras object, as ``line: expression``.

    A read ``x._name`` (``_name`` not a dunder) or ``getattr(x, "_name")``/``hasattr(x, "_name")`` counts, unless
    ``x`` is a name bound by an import (a module: ours, torch's or the standard library's; their private names are
    the torch boundary's concern or our own) or ``self``/``cls`` in a method of a class of ours. ``self`` in a
    function that is not a method counts: there it is the Keras object the function is patched into.
    """
    tree = ast.parse(source)
    imported = {(alias.asname or alias.name).split(".")[0] for node in ast.walk(tree)
                if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
    sites: List[str] = []

    def visit(node: ast.AST, in_method: bool) -> None:
        if isinstance(node, ast.ClassDef):
            for child in node.body:
                visit(child, isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))
            return
        base, name = None, None
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and _is_private(node.attr):
            base, name = node.value, node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _ATTRIBUTE_FUNCTIONS
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and _is_private(node.args[1].value)):
            base, name = node.args[0], node.args[1].value
        if name is not None:
            own = isinstance(base, ast.Name) and (base.id in imported or (in_method and base.id in ("self", "cls")))
            if not own:
                sites.append(f"{node.lineno}: {ast.unparse(node)}")
        for child in ast.iter_child_nodes(node):
            nested_function = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, in_method and not nested_function)

    visit(tree, False)
    return sites


def _keras_facing_modules() -> List[pathlib.Path]:
    """Every module of the integration (``_keras/``, the boundary excepted) and each top-level module that uses it."""
    top_level = [path for path in sorted(PACKAGE_DIR.glob("*.py"))
                 if re.search(r"^from \.+_keras\b|^\s*import keras\b", path.read_text(encoding="utf-8"), re.M)]
    return [path for path in sorted((PACKAGE_DIR / "_keras").glob("*.py")) if path != BOUNDARY] + top_level


def test_private_keras_names_are_read_through_the_boundary_and_their_reads_only_go_down():
    found = {str(path.relative_to(PACKAGE_DIR)): private_reads(path.read_text(encoding="utf-8"))
             for path in _keras_facing_modules()}
    grown = {module: sites for module, sites in found.items() if len(sites) > PRIVATE_KERAS_READS.get(module, 0)}
    assert not grown, ("read these private Keras names through an accessor of _keras/keras_modules.py, with a "
                       f"per-release check in _keras/checks.py: {grown}")
    fewer = {module: (len(found.get(module, [])), count) for module, count in PRIVATE_KERAS_READS.items()
             if len(found.get(module, [])) < count}
    assert not fewer, f"fewer private Keras reads than PRIVATE_KERAS_READS says (found, recorded): lower it: {fewer}"


def test_the_private_read_finder_tells_keras_objects_from_modules_and_our_own_classes():
    source = textwrap.dedent('''
        import torch
        from . import keras_modules

        class Ours:
            def method(self):
                return self._mine, torch._C, keras_modules._private()

        def install(trainer_class):
            original = trainer_class._compute_loss

            def _compute_loss(self, x):
                return self._losses, getattr(self, "_layout", None), hasattr(self, "__dict__"), self.__class__

            return original, _compute_loss
        ''')
    assert [site.split(": ", 1)[1] for site in private_reads(source)] == [
        "trainer_class._compute_loss", "self._losses", "getattr(self, '_layout', None)"]
