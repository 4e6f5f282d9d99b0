"""The Keras boundary: only ``_keras/boundary/keras_modules.py`` and ``_keras/boundary/keras_private.py`` name
``keras.src`` or touch a private attribute of a Keras object, each name is exercised by the Keras self-check, and
nothing imports Keras early."""

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
BOUNDARY = PACKAGE_DIR / "_keras" / "boundary" / "keras_modules.py"
"""Keras' private modules (``keras.src``), the releases supported and the feature tests between them."""
PRIVATE_ATTRIBUTES = PACKAGE_DIR / "_keras" / "boundary" / "keras_private.py"
"""The private attributes of Keras objects (a Variable's ``_value``...), read and written through accessors."""
BOUNDARY_MODULES = (BOUNDARY, PRIVATE_ATTRIBUTES)


def _run(code: str, **env: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, **env})
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_only_the_boundary_names_keras_src():
    # Text, not imports: a docstring or a module name in a string is a keras.src name to keep up to date too.
    offenders = sorted(str(path.relative_to(PACKAGE_DIR)) for path in PACKAGE_DIR.rglob("*.py")
                       if path not in BOUNDARY_MODULES and "keras.src" in path.read_text(encoding="utf-8"))
    assert offenders == [], f"name Keras' private modules through _keras/boundary/keras_modules.py instead: {offenders}"
    assert "keras.src" in BOUNDARY.read_text(encoding="utf-8")  # the scan looks at the right file


def test_boundary_says_which_keras_releases_it_was_checked_on():
    from keras_dtensor_mixfix._keras.boundary import keras_modules

    assert "3.15.1" in keras_modules.__doc__ and "3.16.0.dev2026102704" in keras_modules.__doc__


def test_the_keras_integration_imports_no_keras_until_installed():
    # Every module of the integration imports Keras inside functions: importing them (as `import torch`
    # does through auto-activation, and keras_integration's own imports) must not import Keras.
    modules = ["keras_dtensor_mixfix._autoload", "keras_dtensor_mixfix.keras_integration",
               "keras_dtensor_mixfix.hookspecs"] + sorted(
        ".".join(("keras_dtensor_mixfix",) + path.relative_to(PACKAGE_DIR).with_suffix("").parts)
        for path in (PACKAGE_DIR / "_keras").rglob("*.py") if path.stem != "__init__")
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
        "from keras_dtensor_mixfix._keras.boundary import keras_modules as k\n"
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


# ----------------------------------------------------------------------------- private Keras attributes, elsewhere

EXEMPT = {
    "_keras/step/forked_train_step.py": (
        "the compiled train step (_compiled_train_step, _start_step, _detach_kept_losses) is a copy of Keras "
        "3.12-3.15's own torch train step, kept line for line comparable with it and traced by TorchDynamo; the "
        "names it reads are checked per release by the self-check's trainer_steps and compiled_step_state",
        frozenset({"trainer._clear_losses", "trainer._flatten_layers", "layer._losses",
                   "trainer._call_has_training_arg", "trainer._compute_loss", "trainer._loss_tracker"})),
    "_keras/gate/checks.py": (
        "the self-check of the forked train step's names probes _compute_loss's parameters on the trainer class",
        frozenset({"trainer_class._compute_loss"})),
}
"""Per module (relative to the package): why, and the exact expressions it may keep; every other private access of a
Keras object outside the boundary fails the test, and so does an exemption no longer found (it is to be removed)."""

_ATTRIBUTE_FUNCTIONS = ("getattr", "hasattr", "setattr", "delattr")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_constant(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and _is_private(node.value)


def private_accesses(source: str) -> List[str]:
    """The private attribute accesses in ``source`` that may be of a Keras object, as ``line: expression``.

    ``x._name`` (``_name`` not a dunder) read, written or deleted, ``getattr``/``hasattr``/``setattr``/``delattr(x,
    "_name", ...)`` and a recorder's ``patches.set(x, "_name", ...)`` count, unless ``x`` is a name bound by an import
    (a module: ours, torch's or the standard library's; their private names are the torch boundary's concern or our
    own) or ``self``/``cls`` in a method of a class of ours. ``self`` in a function that is not a method counts:
    there it is the Keras object the function is patched into.
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
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            base, name = node.value, node.attr
        elif isinstance(node, ast.Call) and len(node.args) >= 2 and _private_constant(node.args[1]) and (
                (isinstance(node.func, ast.Name) and node.func.id in _ATTRIBUTE_FUNCTIONS)
                or (isinstance(node.func, ast.Attribute) and node.func.attr == "set")):
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
    return [path for path in sorted((PACKAGE_DIR / "_keras").rglob("*.py")) if path not in BOUNDARY_MODULES] + top_level


def test_private_keras_attributes_are_reached_through_the_boundary_only():
    found = {str(path.relative_to(PACKAGE_DIR)): private_accesses(path.read_text(encoding="utf-8"))
             for path in _keras_facing_modules()}
    assert len(found) > 30 and "_keras/backend/variables.py" in found  # the scan looks at the integration
    unexempted = {module: [site for site in sites if site.split(": ", 1)[1] not in EXEMPT.get(module, ("", ()))[1]]
                  for module, sites in found.items()}
    unexempted = {module: sites for module, sites in unexempted.items() if sites}
    assert not unexempted, ("reach these private attributes of Keras objects through an accessor or name of "
                            "_keras/boundary/keras_private.py, exercised by a check of _keras/gate/checks.py: "
                            f"{unexempted}")
    stale = {module: sorted(expressions - {site.split(": ", 1)[1] for site in found.get(module, [])})
             for module, (_, expressions) in EXEMPT.items()}
    stale = {module: expressions for module, expressions in stale.items() if expressions}
    assert not stale, f"exempted accesses no longer found: remove them from EXEMPT: {stale}"


def test_every_name_of_the_private_attribute_boundary_is_exercised_by_a_self_check():
    import inspect

    from keras_dtensor_mixfix._keras.boundary import keras_private
    from keras_dtensor_mixfix._keras.gate import checks

    sources = "\n".join(inspect.getsource(module) for module in {inspect.getmodule(check.run)
                                                                for check in checks.CHECKS.values()})
    tree = ast.parse(PRIVATE_ATTRIBUTES.read_text(encoding="utf-8"))
    defined = sorted([node.name for node in tree.body if isinstance(node, ast.FunctionDef)]
                     + [target.id for node in tree.body if isinstance(node, ast.Assign) for target in node.targets
                        if isinstance(target, ast.Name) and target.id != "__all__"])
    assert sorted(keras_private.__all__) == defined  # __all__ names every accessor and name the module defines
    missing = [name for name in keras_private.__all__ if f"keras_private.{name}" not in sources]
    assert not missing, f"{keras_private.__name__} names no self-check exercises: {missing}"


def test_the_private_access_finder_tells_keras_objects_from_modules_and_our_own_classes():
    source = textwrap.dedent('''
        import torch
        from . import keras_modules

        class Ours:
            def method(self):
                self._own = 1
                return self._mine, torch._C, keras_modules._private()

        def install(patches, trainer_class):
            original = trainer_class._compute_loss

            def _compute_loss(self, x):
                self._layout = None
                setattr(self, "_shape", ())
                return self._losses, getattr(self, "_layout", None), hasattr(self, "__dict__"), self.__class__

            patches.set(trainer_class, "_compute_loss", _compute_loss)
            patches.set(trainer_class, "fit", _compute_loss)
            return original, _compute_loss
        ''')
    assert [site.split(": ", 1)[1] for site in private_accesses(source)] == [
        "trainer_class._compute_loss", "self._layout", "setattr(self, '_shape', ())", "self._losses",
        "getattr(self, '_layout', None)", "patches.set(trainer_class, '_compute_loss', _compute_loss)"]
