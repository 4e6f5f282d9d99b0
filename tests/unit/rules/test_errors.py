"""The exception hierarchy: one package base, each class still the builtin it replaced; RankError's move."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

import keras_dtensor_mixfix as mf
from keras_dtensor_mixfix import testing
from keras_dtensor_mixfix._rules.decisions import as_decision, validate_rule
from keras_dtensor_mixfix._rules.ops import resolve_op
from keras_dtensor_mixfix._rules.options import Options
from keras_dtensor_mixfix.pytest_plugin import MarkerUsageError

# Every exception class the package defines, with the builtin it must stay for code written before the base.
EXCEPTIONS = [
    (mf.MixedOperandError, RuntimeError),
    (mf.ReplicationCheckError, RuntimeError),
    (mf.UnsupportedTorchError, RuntimeError),
    (mf.DeviceAssignmentError, RuntimeError),
    (mf.ReleaseLimitationError, RuntimeError),
    (mf.KerasIntegrationNotInstalledError, RuntimeError),
    (mf.InvalidArgumentError, ValueError),
    (mf.IncompleteCheckpointError, FileNotFoundError),
    (mf.UnknownOperatorError, ValueError),
    (mf.ArgumentTypeError, TypeError),
    (testing.RankError, RuntimeError),
    (testing.WorkerStartError, RuntimeError),
    (MarkerUsageError, pytest.UsageError),
]


@pytest.mark.parametrize("error, builtin", EXCEPTIONS, ids=lambda value: getattr(value, "__name__", str(value)))
def test_every_exception_derives_from_the_package_base_and_keeps_its_builtin(error, builtin):
    assert issubclass(error, mf.MixfixError) and issubclass(error, builtin)


def test_the_base_is_exported_from_the_root_and_is_a_plain_exception():
    assert "MixfixError" in mf.__all__ and mf.MixfixError.__mro__[1] is Exception
    assert not issubclass(mf.ReplicationCheckWarning, mf.MixfixError)  # a warning, never raised
    assert mf.UnsupportedTorchError.__module__ == "keras_dtensor_mixfix._rules.errors"


@pytest.mark.parametrize("bad_input, error, builtin", [
    (lambda: mf.Decision("copy"), mf.InvalidArgumentError, ValueError),
    (lambda: mf.Decision("replicate", shape=(2,)), mf.InvalidArgumentError, ValueError),
    (lambda: mf.Decision("local", placements=[]), mf.InvalidArgumentError, ValueError),
    (lambda: mf.Decision("local", placements="Shard(0)"), mf.ArgumentTypeError, TypeError),
    (lambda: mf.Decision("local", shape=(-1, 2)), mf.ArgumentTypeError, TypeError),
    (lambda: validate_rule("copy", "where"), mf.InvalidArgumentError, ValueError),
    (lambda: validate_rule(3, "where"), mf.ArgumentTypeError, TypeError),
    (lambda: as_decision("copy", "where"), mf.InvalidArgumentError, ValueError),
    (lambda: as_decision(3, "where"), mf.ArgumentTypeError, TypeError),
    (lambda: Options().updated(nope=1), mf.ArgumentTypeError, TypeError),
    (lambda: Options().updated(direct="yes"), mf.ArgumentTypeError, TypeError),
    (lambda: Options().updated(check="loud"), mf.InvalidArgumentError, ValueError),
    (lambda: resolve_op("aten::no_such_op_for_mixfix"), mf.UnknownOperatorError, ValueError),
    (lambda: resolve_op("aten::mm.nope"), mf.UnknownOperatorError, ValueError),
    (lambda: resolve_op("mm"), mf.UnknownOperatorError, ValueError),
    (lambda: resolve_op(42), mf.ArgumentTypeError, TypeError),
])
def test_bad_input_raises_a_package_error_that_is_still_the_builtin(bad_input, error, builtin):
    with pytest.raises(error) as raised:
        bad_input()
    assert isinstance(raised.value, builtin) and isinstance(raised.value, mf.MixfixError)


def test_rank_error_lives_in_testing_and_the_root_name_warns_for_one_release():
    assert "RankError" not in mf.__all__ and "RankError" not in dir(mf)
    assert "RankError" in testing.__all__
    with pytest.warns(DeprecationWarning, match=r"keras_dtensor_mixfix\.RankError is deprecated.*"
                                                r"keras_dtensor_mixfix\.testing") as caught:
        found = mf.RankError
    assert found is testing.RankError
    assert caught[0].filename == __file__  # the warning points at the user's line
    with pytest.warns(DeprecationWarning):
        from keras_dtensor_mixfix import RankError  # noqa: F401  - the from-import form warns too
    with pytest.warns(DeprecationWarning):
        mf.RankError  # every use warns, not only the first
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from keras_dtensor_mixfix.testing import RankError as new_home  # the new home is silent
    assert new_home is testing.RankError


def test_a_star_import_neither_warns_nor_brings_rank_error():
    code = ("import warnings; warnings.simplefilter('error')\n"
            "ns = {}; exec('from keras_dtensor_mixfix import *', ns)\n"
            "print('RankError' in ns, 'MixfixError' in ns)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]


def test_a_promotion_error_is_a_mixfix_error_and_a_runtime_error():
    from keras_dtensor_mixfix._rules.errors import promotion_error

    error = promotion_error("aten::mul.Tensor", "why", operand_label="args[1]", operand=torch.ones(2))
    assert isinstance(error, mf.MixedOperandError) and isinstance(error, mf.MixfixError)
    assert isinstance(error, RuntimeError) and "aten::mul.Tensor" in str(error) and "args[1]" in str(error)


# Raises of a builtin exception class that stay builtins, each with why. Everything else a module of the
# package raises must be a MixfixError (a class of ours, or a helper such as promotion_error that builds one).
BUILTIN_RAISES_KEPT = {
    ("__init__.py", "AttributeError"): "module __getattr__'s protocol: hasattr() and getattr(..., default) rely on it",
    ("_torch/probe.py", "AssertionError"): "a self-check that fails: caught by selfcheck and reported as its result",
    ("_torch/checks_dtensor.py", "AssertionError"): "a self-check that fails: caught by selfcheck and reported as "
                                                   "its result",
    ("_torch/checks_dispatch.py", "AssertionError"): "a self-check that fails: caught by selfcheck and reported as "
                                                    "its result",
    ("_torch/selfcheck.py", "RuntimeError"): "no gloo: caught at once and reported as every check's result",
    **{("_keras/gate/checks.py", name): "a Keras self-check that fails: caught by selfcheck and reported as its result"
       for name in ("AttributeError", "TypeError", "ValueError")},
    ("_keras/boundary/keras_modules.py", "ImportError"): "a Keras release without a module the integration patches: "
                                                "the same failure as Python's own import of it, and caught as one",
    ("_engine/decide.py", "AssertionError"): "an internal invariant (an unreachable branch), never a user's error",
    ("_engine/placements.py", "AssertionError"): "an internal invariant: a cached whole layout is asked for only "
                                                 "beside an eager local piece, whose mesh coordinate is a number",
    ("_keras/files/array_proxy.py", "AttributeError"): "ArrayProxy.__getattr__'s protocol: a private name it does not "
                                                 "have (copy, pickle and hasattr() probe them)",
}


def _builtin_raises():
    import ast
    import builtins
    import pathlib

    package = pathlib.Path(mf.__file__).resolve().parent
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            callee = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            name = callee.id if isinstance(callee, ast.Name) else None
            if isinstance(callee, ast.Attribute) and isinstance(callee.value, ast.Name):
                name = f"{callee.value.id}.{callee.attr}"  # pytest.UsageError and the like
            builtin = getattr(builtins, name or "", None)
            if (isinstance(builtin, type) and issubclass(builtin, BaseException)) or name == "pytest.UsageError":
                yield path.relative_to(package).as_posix(), name, node.lineno


def test_every_error_the_package_raises_is_a_mixfix_error_unless_listed_with_a_reason():
    found = list(_builtin_raises())
    unlisted = [f"{path}:{line} raises {name}" for path, name, line in found if (path, name) not in BUILTIN_RAISES_KEPT]
    assert not unlisted, f"raise a MixfixError subclass (keeping the builtin as a second base): {unlisted}"
    stale = set(BUILTIN_RAISES_KEPT) - {(path, name) for path, name, _ in found}
    assert not stale, f"BUILTIN_RAISES_KEPT lists raises that are gone: remove them: {sorted(stale)}"


def test_what_type_checkers_see_is_every_public_name():
    """``__init__``'s TYPE_CHECKING block imports every lazily exported name and public submodule, so that static
    type checkers and IDEs see the same API as ``__all__``."""
    import ast

    tree = ast.parse(open(mf.__file__, encoding="utf-8").read())
    block = next(node for node in tree.body if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test))
    seen = {alias.asname or alias.name for node in ast.walk(block) if isinstance(node, ast.ImportFrom)
            for alias in node.names}
    assert set(mf.__all__) - {"__version__"} - seen == set()
    assert set(mf._SUBMODULES) - seen == set()
