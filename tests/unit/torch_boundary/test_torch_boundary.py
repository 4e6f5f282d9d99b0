"""The torch boundary holds: outside ``_torch/``, no module of the package names a torch-private name.

Each module of ``src/keras_dtensor_mixfix`` is parsed with ``ast`` (nothing is imported) and these
count as naming something private of torch:

- an ``import`` / ``from ... import`` of a torch module path with a ``_``-prefixed part
  (``torch._ops``, ``torch.distributed.tensor._utils``), or of a ``_``-prefixed name from a torch
  module (``from torch import _C``);
- an attribute chain that starts at a name bound to torch (``torch``, ``import torch.distributed as
  dist``, ``from torch.distributed.tensor import DTensor``) and has a ``_``-prefixed part
  (``torch._C.ListType``, ``DTensor._op_dispatcher``), in code or in a string annotation;
- an attribute that torch's objects keep private, on any object (``func._schema``,
  ``op._overloadname``, ``dtensor._local_tensor``), read directly or with ``getattr(x, "...")``.

The one documented exception (see the ``_torch`` package docstring): the promotion engine,
``_engine/``, reads ``DTensor._local_tensor`` and ``DTensor._spec`` directly, because it does so
several times per promoted op and a function call around each read is a measurable share of that.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Dict, Iterator, List, Set, Tuple

import pytest

import keras_dtensor_mixfix

PACKAGE = pathlib.Path(keras_dtensor_mixfix.__file__).resolve().parent
BOUNDARY = "_torch"

PRIVATE_TORCH_ATTRIBUTES = frozenset({
    "_local_tensor", "_spec",  # DTensor
    "_schema", "_overloadname", "_op", "_qualified_op_name",  # OpOverload / OpOverloadPacket
    "_is_view_op",  # FunctionSchema
    "_op_dispatcher", "_dtensor__new__",  # DTensor's dispatcher, its C++ constructor
})
"""``_``-prefixed attributes of torch objects the package reads; flagged on any object, since ``ast`` cannot
tell a torch object from one of ours (none of ours uses these names)."""

HOT_PATH_EXCEPTION = {"_engine": frozenset({"_local_tensor", "_spec"})}
"""The one documented exception: ``_engine/`` (the promotion's hot path) reads DTensor's local tensor and spec
directly; a call per read through ``_torch/`` would cost a share of each promoted op."""



def _is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _chain(node: ast.AST) -> List[str]:
    """``["torch", "_C", "ListType"]`` for ``torch._C.ListType``; empty when it does not end at a name."""
    parts: List[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return parts[::-1]
    return []


def _torch_module(name: str) -> bool:
    return name == "torch" or name.startswith("torch.")


class _Finder(ast.NodeVisitor):
    """Collects ``(line, name)`` for every torch-private name a module names."""

    def __init__(self) -> None:
        self.found: List[Tuple[int, int, str]] = []
        self.torch_names: Set[str] = set()  # names bound to torch modules or objects in this module

    def _flag(self, node: ast.AST, name: str) -> None:
        self.found.append((getattr(node, "lineno", 0), getattr(node, "col_offset", 0), name))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if _torch_module(alias.name):
                if any(_is_private(part) for part in alias.name.split(".")):
                    self._flag(node, alias.name)
                self.torch_names.add(alias.asname or alias.name.split(".")[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level == 0 and _torch_module(module):
            if any(_is_private(part) for part in module.split(".")):
                self._flag(node, module)
            for alias in node.names:
                if _is_private(alias.name):
                    self._flag(node, f"{module}.{alias.name}")
                self.torch_names.add(alias.asname or alias.name)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain = _chain(node)
        if chain and chain[0] in self.torch_names and any(_is_private(part) for part in chain[1:]):
            self._flag(node, ".".join(chain))
            return  # the whole chain is one finding; its inner links are not more
        if node.attr in PRIVATE_TORCH_ATTRIBUTES:
            self._flag(node, f".{node.attr}")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        # getattr(x, "_schema") and getattr(torch._C, ...) read the same private names
        if (isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "setattr")
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str) and _is_private(node.args[1].value)):
            attribute = node.args[1].value
            chain = _chain(node.args[0])
            if attribute in PRIVATE_TORCH_ATTRIBUTES:
                self._flag(node, f".{attribute}")
            elif chain and chain[0] in self.torch_names:
                self._flag(node, ".".join(chain + [attribute]))
        self.generic_visit(node)

    def visit_arg(self, node: ast.arg) -> None:
        self._annotation(node.annotation)
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._annotation(node.returns)
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._annotation(node.annotation)
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        # Union[str, "torch._ops.OpOverload"]: a string type inside a subscript
        for item in ast.walk(node.slice):
            self._annotation(item)
        self.generic_visit(node)

    def _annotation(self, node: object) -> None:
        """A string annotation (``"torch._ops.OpOverload"``) is code too: parse it and check its chains."""
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            return
        try:
            parsed = ast.parse(node.value, mode="eval")
        except SyntaxError:
            return
        for inner in ast.walk(parsed):
            if isinstance(inner, ast.Attribute):
                chain = _chain(inner)
                if chain and chain[0] == "torch" and any(_is_private(part) for part in chain[1:]):
                    self._flag(node, ".".join(chain))


def private_torch_names(source: str) -> List[Tuple[int, str]]:
    """``(line, name)`` for each torch-private name ``source`` names, in source order."""
    finder = _Finder()
    tree = ast.parse(source)
    # bind the torch names first, wherever the import sits (imports inside functions are common here)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            finder.visit(node)
    finder.found.clear()
    finder.visit(tree)
    result: List[Tuple[int, str]] = []
    for line, _, name in sorted(set(finder.found)):
        # getattr(torch._C, "_x") is found whole and as its argument torch._C: keep the longer one
        if not any(line == other_line and other.startswith(name + ".")
                   for other_line, _, other in finder.found):
            result.append((line, name))
    return result


def _modules() -> Iterator[pathlib.Path]:
    return iter(sorted(PACKAGE.rglob("*.py")))


def _relative(path: pathlib.Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _offences() -> Dict[str, List[Tuple[int, str]]]:
    offences: Dict[str, List[Tuple[int, str]]] = {}
    for path in _modules():
        relative = _relative(path)
        top = relative.split("/")[0]
        if top == BOUNDARY:
            continue
        excepted = {f".{attribute}" for attribute in HOT_PATH_EXCEPTION.get(top, ())}
        found = [(line, name) for line, name in private_torch_names(path.read_text()) if name not in excepted]
        if found:
            offences[relative] = found
    return offences


def test_no_module_outside_the_torch_boundary_names_a_private_torch_name():
    offences = _offences()
    unexpected = {path: [f"line {line}: {name}" for line, name in found] for path, found in offences.items() if found}
    assert not unexpected, (
        "torch-private names outside _torch/ (read them through a _torch/ module; see the _torch package "
        f"docstring): {unexpected}")


@pytest.mark.parametrize("source, expected", [
    ("import torch._dynamo", ["torch._dynamo"]),
    ("import torch.distributed.tensor._utils as u", ["torch.distributed.tensor._utils"]),
    ("from torch._ops import OpOverload", ["torch._ops"]),
    ("from torch.distributed.tensor._redistribute import redistribute_local_tensor",
     ["torch.distributed.tensor._redistribute"]),
    ("from torch import _C", ["torch._C"]),
    ("from torch.distributed.tensor.placement_types import _MaskPartial",
     ["torch.distributed.tensor.placement_types._MaskPartial"]),
    ("import torch\nx = torch._C.ListType", ["torch._C.ListType"]),
    ("import torch\nf = getattr(torch._C, '_dispatch_get_all_op_names', None)",
     ["torch._C._dispatch_get_all_op_names"]),
    ("import torch.distributed as dist\ndist._private_thing()", ["dist._private_thing"]),
    ("from torch.distributed.tensor import DTensor\nDTensor._op_dispatcher.x", ["DTensor._op_dispatcher.x"]),
    ("def f(op):\n    return op._schema.name", ["._schema"]),
    ("def f(op):\n    return getattr(op, '_overloadname')", ["._overloadname"]),
    ("import torch\ndef f(op: 'torch._ops.OpOverload') -> None: ...", ["torch._ops.OpOverload"]),
    ("from typing import Union\nOpLike = Union[str, 'torch._ops.OpOverload']", ["torch._ops.OpOverload"]),
    # public names, dunders, our own private names and prose are not torch-private names
    ("import torch\nv = torch.__version__\ny = torch.ops.aten.mm.default\nz = torch.distributed.tensor.DTensor", []),
    ("class A:\n    def f(self):\n        return self._lock, self._entries", []),
    ("msg = 'reads torch._library.simple_registry'", []),
    ("from .._torch.operators import OpOverload", []),
])
def test_the_scanner_flags_what_it_should(source, expected):
    assert [name for _, name in private_torch_names(source)] == expected


def test_the_hot_path_exception_is_the_engine_reading_local_tensor_and_spec_only():
    source = "def f(d):\n    return d._local_tensor, d._spec, d._schema"
    assert [name for _, name in private_torch_names(source)] == ["._local_tensor", "._spec", "._schema"]
    assert HOT_PATH_EXCEPTION == {"_engine": frozenset({"_local_tensor", "_spec"})}


def test_every_name_of_the_new_boundary_modules_is_exercised_by_a_self_check():
    import inspect

    from keras_dtensor_mixfix._torch import aot_compile, checks, dtensor_attributes, operators, processes

    sources = "\n".join(inspect.getsource(check.run) for check in checks.CHECKS.values())
    for module in (operators, dtensor_attributes, processes, aot_compile):
        missing = [name for name in module.__all__ if name not in sources]
        assert not missing, f"{module.__name__} names no self-check exercises: {missing}"
