"""The entry: where a mixed call enters the engine, and which way it goes from there.

torch consults a per-op dispatch rule for DTensor (installed by the lifecycle layer, see
``_lifecycle/intercept.py``) on every dispatch of a hooked op that involves a DTensor. The rules
here look for a plain operand torch would reject and otherwise return ``NotImplemented``, so
torch runs its own path. The policy they follow, ``torch_first``: act only where torch itself
would raise the mixed-operand error (or crash, as it does on a plain one-element tensor an op
writes into); inside torch's ``implicit_replication()``, and where DTensor's own handler for the
op accepts the call, torch's path runs.

``promote_call``, the engine's one entrance, then sends the call one of three ways (the call graph:
``_engine/__init__.py``):

- fast.py: the cache hit for the common case (one DTensor, one plain operand, admitted by
  ``opstate.admit``); its first call of a shape asks placements.py, as the general path does;
- foreach.py: ``_foreach_*`` ops: a direct plan (the same admission), else row groups down general.py;
- general.py: everything else, stage by stage (operands -> decide -> devices -> placements ->
  construct -> run).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import torch

from .._torch.api import custom_op_handler, implicit_replication_enabled, is_mixed_operand_error
from .._torch.versions import has_defect, running_torch_version
from .caches import CACHES
from .fast import NOT_FAST, promote_fast
from .foreach import promote_foreach, rows_on_several_meshes
from .general import promote_general
from .meshes import as_plain_on_one_mesh, one_mesh
from .operands import needs_promotion
from .opstate import op_state

Handler = Callable[[Any, Tuple[Any, ...], Dict[str, Any]], Any]
"""What a dispatch rule calls for a mixed call: ``handler(func, args, kwargs)``."""

_OP_STATES = CACHES.op_states


def make_dispatch_rule(handle_mixed: Handler,
                       handle_meshes: Handler = lambda func, args, kwargs: NotImplemented) -> Callable[..., Any]:
    """The function torch calls for every dispatch of a hooked op on a DTensor.

    It must be cheap: it runs on every pure-DTensor call of the op too. It only looks for a
    plain tensor with more than one element (what torch would reject), or DTensors on different
    meshes (``handle_meshes``), and otherwise returns ``NotImplemented`` so torch continues down
    its own path.
    """
    from torch.distributed.tensor import DTensor  # a local of the rule's closure: read faster than a global

    Tensor = torch.Tensor
    rejected = needs_promotion  # a local of the closure: read faster than a global
    equal_meshes = CACHES.equal_meshes

    def _another_mesh(mesh: Any, other: Any) -> bool:
        """``other`` (not ``mesh`` itself) is another mesh, not a remembered second object of the same one."""
        known = equal_meshes.get((id(mesh), id(other)))
        return known is None or known[0] is not mesh or known[1] is not other

    def _is_mixed_value(value: Any) -> bool:
        # (a plain tensor is rare among keyword arguments: the predicate is called for tensors only)
        if isinstance(value, Tensor):
            return rejected(value)
        if type(value) is list or type(value) is tuple:
            for item in value:
                if isinstance(item, Tensor) and rejected(item):
                    return True
        return False

    def dtensor_dispatch_rule(cls: Any, func: Any, types: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        mesh: Any  # a DeviceMesh, or None (no DTensor met yet); a declaration only, no code
        if len(args) == 2 and not kwargs:
            # The commonest pure call (a * b), unrolled: ~30 ns less than the loop below.
            first, second = args
            if type(first) is DTensor and type(second) is DTensor:
                mesh, other = first._spec.mesh, second._spec.mesh
                if mesh is other or not _another_mesh(mesh, other):  # (two objects of one mesh)
                    return NotImplemented
                return handle_meshes(func, args, kwargs)
        # _is_mixed_value unrolled for positional arguments, with the predicate (operands.needs_promotion)
        # spelled out: a call per plain argument costs ~55 ns on every pure call with a scalar tensor (``dt * 2.0``)
        # and on every mixed one (tests/unit/engine/test_entry_rules.py holds the two spellings to one answer).
        # The first DTensor's mesh is kept, to notice (by identity: cheap) a DTensor on another one.
        mesh = None
        other_mesh = False
        for value in args:
            kind = type(value)
            if kind is DTensor:
                if mesh is None:
                    mesh = value._spec.mesh
                elif value._spec.mesh is not mesh and _another_mesh(mesh, value._spec.mesh):
                    other_mesh = True  # or an object of the same mesh not seen yet: handle_meshes tells
                continue
            if kind is list or kind is tuple:
                for item in value:
                    # ``type(item) is DTensor`` first: foreach lists of parameters are long.
                    if type(item) is DTensor:
                        if mesh is None:
                            mesh = item._spec.mesh
                        elif item._spec.mesh is not mesh and _another_mesh(mesh, item._spec.mesh):
                            other_mesh = True
                    elif isinstance(item, Tensor) and not isinstance(item, DTensor) and item.numel() != 1:
                        return handle_mixed(func, args, kwargs)
            elif isinstance(value, Tensor) and not isinstance(value, DTensor) and value.numel() != 1:
                return handle_mixed(func, args, kwargs)
        if kwargs:
            for value in kwargs.values():
                if type(value) is DTensor:
                    if mesh is None:
                        mesh = value._spec.mesh
                    elif value._spec.mesh is not mesh and _another_mesh(mesh, value._spec.mesh):
                        other_mesh = True
                elif _is_mixed_value(value):
                    return handle_mixed(func, args, kwargs)
        if other_mesh:
            return handle_meshes(func, args, kwargs)
        return NotImplemented

    return dtensor_dispatch_rule


def make_write_rule(base_rule: Callable[..., Any], handle_mixed: Handler) -> Callable[..., Any]:
    """The rule for in-place ops: also acts on a plain ONE-element ``self`` next to a DTensor.

    Torch promotes one-element plain operands it reads, but an in-place op whose ``self`` is plain
    crashes in DTensor's dispatch (a bare AssertionError, after writing a local result): that is
    the one write it cannot handle. Other written arguments (``out=``, a norm's running
    statistics) go down torch's own path, whatever it does with them.
    """
    from torch.distributed.tensor import DTensor  # a local of the rule's closure: read faster than a global

    Tensor = torch.Tensor

    def dtensor_dispatch_rule_writes(cls: Any, func: Any, types: Any, args: Tuple[Any, ...],
                                     kwargs: Dict[str, Any]) -> Any:
        if len(args) == 2 and not kwargs:
            # The commonest pure call (dt.copy_(other), dt.add_(other)), unrolled: ~30 ns less.
            first, second = args
            if type(first) is DTensor and type(second) is DTensor and first._spec.mesh is second._spec.mesh:
                return NotImplemented
        result = base_rule(cls, func, types, args, kwargs)
        if result is not NotImplemented or not args:
            return result
        target = args[0]
        if type(target) is DTensor:
            return NotImplemented
        if isinstance(target, Tensor):
            if not isinstance(target, DTensor):
                return handle_mixed(func, args, kwargs)
        elif type(target) is list or type(target) is tuple:
            for item in target:
                # ``type(item) is DTensor`` first: foreach lists of parameters are long.
                if type(item) is not DTensor and isinstance(item, Tensor) and not isinstance(item, DTensor):
                    return handle_mixed(func, args, kwargs)
        return NotImplemented

    return dtensor_dispatch_rule_writes


def torch_first(promote: Handler) -> Handler:
    """Wrap ``promote`` so that it runs only where torch's own path would raise.

    Called by the rules once they have seen a plain operand torch may reject; costs one flag
    read and one dict lookup on that path only.
    """

    def on_mixed(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if implicit_replication_enabled():
            return NotImplemented  # the user asked for torch's implicit replication: theirs
        handler = custom_op_handler(func)
        if handler is not None:
            # What torch would do next: DTensor's own handler. Only its mixed-operand refusal
            # (raised while unwrapping, before any work) is ours to act on.
            try:
                return handler(func, args, kwargs)
            except RuntimeError as exc:
                if not is_mixed_operand_error(exc):
                    raise
        return promote(func, args, kwargs)

    on_mixed.__wrapped__ = promote  # type: ignore[attr-defined]
    return on_mixed


_OTHER_MESHES_REFUSED = has_defect("clip_grad_norm_two_meshes", running_torch_version())
"""Whether this torch refuses an op on DTensors of two meshes over the same ranks (the upstream-defect table): only
then does :func:`on_other_meshes` act."""


def on_other_meshes(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """A call whose DTensor operands sit on more than one mesh (no plain operand torch would reject).

    Torch raises for it. Where every DTensor off the op's mesh spans the same ranks and holds its whole
    value on each (meshes.py), the call runs again with those values as plain tensors; otherwise, and
    inside ``implicit_replication()`` or an op DTensor has its own handler for, torch's path runs (and
    raises its own error naming both meshes).
    """
    if (not _OTHER_MESHES_REFUSED or implicit_replication_enabled() or custom_op_handler(func) is not None
            or one_mesh(args, kwargs)):
        return NotImplemented
    info = op_state(func)
    if info.traits.row_wise and rows_on_several_meshes(args, info.traits):
        # One call per mesh (the rows of a foreach op are independent); each goes round again.
        return promote_foreach(func, args, kwargs, info)
    converted = as_plain_on_one_mesh(args, kwargs)
    if converted is None:
        return NotImplemented
    new_args, new_kwargs = converted
    return func(*new_args, **new_kwargs)


def promote_call(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """Promote the plain operands of the mixed call ``func(*args, **kwargs)`` and run it (the rules' handler)."""
    info = _OP_STATES.get(id(func))
    if info is None or info.op is not func:
        info = op_state(func)
    if info.may_fast:
        result = promote_fast(info, func, args, kwargs)
        if result is not NOT_FAST:
            return result
    elif info.traits.foreach:
        return promote_foreach(func, args, kwargs, info)
    if info.traits.row_wise and rows_on_several_meshes(args, info.traits):
        # A fused optimizer over parameters on two meshes (and plain ones): one call per mesh, as for foreach.
        return promote_foreach(func, args, kwargs, info)
    return promote_general(func, args, kwargs, info.traits)
