"""The torch boundary: private torch APIs the package relies on, each checked on named versions.

Everything here reads or touches torch internals that have no public equivalent. Each
function says what it relies on; all of them were checked on every release of the supported
range (``versions``), on which CI runs the whole suite, and ``selfcheck`` checks each of them on
the torch a process runs (``doctor`` prints it; the gate runs it before activating on a newer
torch). A name added here needs a check in ``checks`` (a unit test says so). A torch where one of
them is missing makes the caller fall back to doing nothing (torch's own path), never to guessing.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import pickle
import sys
import threading
from typing import Any, Callable, Iterator, List, NamedTuple, Optional, Protocol, Sequence, Tuple

import torch

log = logging.getLogger(__name__)

__all__ = [
    "DTensorSpec", "TensorMeta", "redistribute_local_tensor", "compute_local_shape_and_global_offset",
    "dtensor_fast_constructor", "dtensor_handles_specially", "LocalOutput", "local_output_spec",
    "implicit_replication_enabled", "custom_op_handler", "MIXED_OPERAND_MESSAGE", "is_mixed_operand_error",
    "clear_sharding_cache", "dispatch_rule_for", "register_dispatch_rule", "shadow_register", "registration_handle",
    "is_traced", "current_compile_id",
    "aot_autograd_cache", "skipping_save", "cache_key_tagged", "device_meshes_keyed_by_groups", "device_mesh_cache_key",
    "reset_compiled_code", "is_masked_partial", "is_exactly",
]

# --------------------------------------------------------------------------- DTensor internals
# Used on the promotion path: DTensor's spec types, its local slicing rule, its redistribution
# of a local tensor, and its C++ constructor. Attributes read directly on DTensor objects
# elsewhere: ``DTensor._local_tensor`` and ``DTensor._spec`` (a DTensorSpec), both unchanged
# since torch 2.4; ``OpOverload._op`` and ``OpOverload._schema``.

from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta  # noqa: E402
from torch.distributed.tensor._redistribute import redistribute_local_tensor  # noqa: E402
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: E402

try:  # the placement of a vocabulary-sharded embedding lookup's result; private, in placement_types on 2.13-2.15
    from torch.distributed.tensor.placement_types import _MaskPartial
except ImportError:  # pragma: no cover - a torch without it has no masked partial results to settle
    _MaskPartial = ()  # type: ignore[assignment,misc]


def is_exactly(placement: Any, *classes: type) -> bool:
    """Whether ``placement`` is of one of ``classes`` exactly, not of a subclass (a strided shard, a masked partial).

    Written so that TorchDynamo traces it right on every supported release: it cannot trace ``type(p) in classes``
    (torch 2.13: the classes are compared with ``==``), and on torch 2.11 ``type(p) is Shard`` is False for a
    placement of a DTensor made inside the traced graph, while ``isinstance`` and the class's name are right.
    """
    kind = type(placement)
    for cls in classes:  # a loop, not a generator: this runs for every mesh dim of every promoted operand
        if kind is cls or (kind.__name__ == cls.__name__ and isinstance(placement, cls)):
            return True
    return False


def is_masked_partial(placement: Any) -> bool:
    """Whether ``placement`` is DTensor's ``_MaskPartial`` (an isinstance check TorchDynamo can trace,
    unlike reading its ``mask_buffer``)."""
    return isinstance(placement, _MaskPartial)


def dtensor_fast_constructor() -> Optional[Callable[..., Any]]:
    """DTensor's C++ constructor ``torch.Tensor._dtensor__new__(cls, local, spec, requires_grad=)``.

    ``DTensor(...)`` is that constructor followed by a Python ``__init__`` that does nothing but is
    wrapped for dynamo and export (most of what a construction costs); eager promotions call the C++
    part alone. None where DTensor is built differently.
    """
    constructor = getattr(torch.Tensor, "_dtensor__new__", None)
    return constructor if constructor is not None and DTensor.__new__ is constructor else None


def dtensor_handles_specially(func: Any) -> bool:
    """Ops DTensor runs its own way: random ops (under its RNG tracker) and custom-handled ops."""
    dispatcher = DTensor._op_dispatcher
    return func in dispatcher._random_ops or func in dispatcher._custom_op_handlers


class LocalOutput(NamedTuple):
    """What DTensor's sharding propagation says about one call (see :func:`local_output_spec`)."""

    runs_locally: bool
    """DTensor runs the op on the local tensors as they are: no operand needs redistributing."""
    output_spec: Any
    """The result's ``DTensorSpec``; a list of them for an op returning a list; None for an op returning nothing."""
    meta_known: bool
    """Every ``DTensorSpec`` in ``output_spec`` carries its ``tensor_meta`` (global shape, stride, dtype), without
    which no DTensor can be built from it."""


def local_output_spec(func: Any, args: Any, kwargs: Any) -> Optional[LocalOutput]:
    """What DTensor's own sharding propagation decides for ``func(*args, **kwargs)``, a call of DTensors.

    Relies on ``DTensor._op_dispatcher.unwrap_to_op_info``, ``sharding_propagator.propagate``,
    ``DeviceMesh._is_current_rank_part_of_mesh`` and the ``OutputSharding`` fields ``needs_redistribute`` and
    ``output_spec``.

    Args:
        func: the op overload.
        args: its positional arguments (no plain tensor among them: a mixed call raises).
        kwargs: its keyword arguments.

    Returns:
        None when this rank is not part of the call's mesh (DTensor then skips the op); otherwise a
        :class:`LocalOutput`.

    Raises:
        RuntimeError: torch's own, e.g. the mixed-operand error, or no sharding strategy for the op.
    """
    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(func, args, kwargs)
    if not op_info.compute_mesh._is_current_rank_part_of_mesh():
        return None
    dispatcher.sharding_propagator.propagate(op_info)
    sharding = op_info.output_sharding
    if sharding is None:  # propagate() sets it: a torch where it did not has no plan to read
        return None
    spec = sharding.output_spec
    specs: Sequence[Any] = spec if type(spec) in (list, tuple) else (spec,)
    meta_known = all(s.tensor_meta is not None for s in specs if isinstance(s, DTensorSpec))
    return LocalOutput(not sharding.needs_redistribute, spec, meta_known)


# --------------------------------------------------------------------------- operator registry


# --------------------------------------------------------------------------- DTensor dispatch

_implicit_replication: Optional[Callable[[], bool]] = getattr(torch._C, "_get_dtensor_allow_implicit_replication", None)


def implicit_replication_enabled() -> bool:
    """True inside torch's ``implicit_replication()`` (a C++ thread-local flag since 2.9).

    Under it torch promotes plain operands itself, and that is the behaviour the user asked for.
    """
    return _implicit_replication is not None and _implicit_replication()


def custom_op_handler(func: Any) -> Optional[Callable[..., Any]]:
    """DTensor's own Python handler for ``func`` (``OpDispatcher._custom_op_handlers``), if any.

    Torch consults these before sharding propagation (e.g. the AMP unscale op, whose handler
    all-reduces ``found_inf``); libraries may add their own at run time, so it is read per call.
    """
    handlers = getattr(getattr(DTensor, "_op_dispatcher", None), "_custom_op_handlers", None)
    return None if handlers is None else handlers.get(func)


MIXED_OPERAND_MESSAGE = "got mixed torch.Tensor and DTensor"


def is_mixed_operand_error(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's own "mixed torch.Tensor and DTensor" refusal."""
    return isinstance(exc, RuntimeError) and MIXED_OPERAND_MESSAGE in str(exc)


def clear_sharding_cache() -> None:
    """Forget DTensor's C++ sharding-propagation cache (it may hold decisions made for promoted calls)."""
    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:
        clear()


# --------------------------------------------------------------------------- dispatch-rule registry


def _rule_holder(qualname: str) -> Any:
    """The holder of ``torch_dispatch`` rules for one op overload (``torch._library.simple_registry``): it keeps ONE
    rule per (op, class), raises on a second registration, and is the same object for a name every time it is asked
    (it exists before the op does)."""
    registry = _rule_registry[0]
    if registry is None:  # imported once: patch() asks for ~2200 holders, several times each
        from torch._library import simple_registry

        registry = _rule_registry[0] = simple_registry.singleton
    return registry.find(qualname).torch_dispatch_rules


_rule_registry: List[Any] = [None]


def dispatch_rule_for(qualname: str, cls: type) -> Optional[Callable[..., Any]]:
    """The ``torch_dispatch`` rule registered for ``cls`` on the op ``qualname`` (``aten::mul.Tensor``), or None."""
    return _rule_holder(qualname).find(cls)


def register_dispatch_rule(qualname: str, cls: type, rule: Callable[..., Any]) -> Any:
    """Register ``rule`` for ``cls`` on the op ``qualname`` with torch's own ``register``, past any stand-in that
    :func:`shadow_register` put on the op's holder.

    Returns:
        the registration's handle (``destroy()`` removes it).

    Raises:
        RuntimeError: a rule for (op, ``cls``) is registered already (torch keeps one).
    """
    holder = _rule_holder(qualname)
    return type(holder).register(holder, cls, rule)


class AttributeSetter(Protocol):
    """What :func:`shadow_register` replaces an attribute through (the package's patch recorder)."""

    def set(self, owner: Any, name: str, value: Any, *, label: Optional[str] = None) -> None: ...


def shadow_register(recorder: AttributeSetter, qualname: str, replacement: Callable[[type, Callable[..., Any]], Any],
                    label: str) -> None:
    """Make ``torch.library.register_torch_dispatch(qualname, cls, func)`` call ``replacement(cls, func)``.

    ``replacement`` becomes an instance attribute ``register`` of the op's rule holder, set through ``recorder``:
    it shadows torch's method for this op only, and the recorder's restore deletes it. ``replacement`` registers
    with :func:`register_dispatch_rule`, which goes past it.

    Args:
        recorder: sets the attribute and records it (``PatchRecorder``).
        qualname: the op (``aten::mul.Tensor``).
        replacement: called as torch's ``register`` is (a class and a rule); returns a handle.
        label: names the replacement in the recorder's warnings.
    """
    recorder.set(_rule_holder(qualname), "register", replacement, label=label)


def registration_handle(on_destroy: Callable[[], None]) -> Any:
    """A handle of the kind ``torch.library`` returns (``destroy()`` undoes the registration)."""
    from torch._library.utils import RegistrationHandle

    return RegistrationHandle(on_destroy)


# --------------------------------------------------------------------------- torch.compile


def is_traced(tensor: torch.Tensor) -> bool:
    """True for the fake/functional tensors that exist only while torch.compile traces."""
    if type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter:
        return False
    from torch._subclasses.fake_tensor import is_fake
    from torch._subclasses.functional_tensor import FunctionalTensor

    return is_fake(tensor) or isinstance(tensor, FunctionalTensor)


def current_compile_id() -> Any:
    """The id of the torch.compile compilation running in this thread (None outside one)."""
    try:
        from torch._guards import CompileContext

        return CompileContext.current_compile_id()
    except Exception:  # noqa: BLE001 - no compile context API: treat as "not compiling"
        return None


_AOT_AUTOGRAD_CACHE_MODULE = "torch._functorch._aot_autograd.autograd_cache"


def aot_autograd_cache_imported() -> bool:
    """Whether torch.compile's AOTAutograd cache module is imported (importing it imports TorchDynamo and inductor)."""
    return _AOT_AUTOGRAD_CACHE_MODULE in sys.modules


def aot_autograd_cache() -> Optional[Any]:
    """torch.compile's on-disk graph cache class, ``AOTAutogradCache``, whose ``save`` is a staticmethod.

    None where it is missing or built differently (then there is no such cache to keep graphs out of).
    """
    try:
        AOTAutogradCache = importlib.import_module(_AOT_AUTOGRAD_CACHE_MODULE).AOTAutogradCache
    except Exception:  # noqa: BLE001 - no such cache in this torch: nothing to keep graphs out of
        return None
    return AOTAutogradCache if isinstance(AOTAutogradCache.__dict__.get("save"), staticmethod) else None


def skipping_save(original: Any, skip: Callable[[], bool]) -> Any:
    """A replacement for ``AOTAutogradCache.save`` (the staticmethod ``original``) that does not save
    while ``skip()`` is true, and otherwise calls it as torch would: ``save(key, entry, remote)``."""
    function = original.__func__ if isinstance(original, staticmethod) else original

    def save(key: str, entry: Any, remote: bool) -> None:
        if skip():
            log.debug("torch.compile: not caching graph %s, traced with a mixed-operand promotion", key)
            return None
        return function(key, entry, remote)

    save.__wrapped__ = function  # type: ignore[attr-defined]
    return staticmethod(save)


def cache_key_tagged(tag: str) -> Any:
    """A context in which torch.compile's on-disk cache keys (AOTAutograd's and inductor's FX graph cache, whose
    hash details read ``torch.compiler.config.cache_key_tag``) carry ``tag`` after any tag the user set; patched for
    the duration, process-wide while it lasts."""
    import torch.compiler.config as compiler_config

    base = compiler_config.cache_key_tag
    # patch(): added to the module by torch's install_config_module, unseen by type checkers
    return compiler_config.patch(cache_key_tag=f"{base}|{tag}" if base else tag)  # type: ignore[attr-defined]


@contextlib.contextmanager
def device_meshes_keyed_by_groups() -> Iterator[None]:
    """A context in which inductor's FX graph cache key (and AOTAutograd's, whose pickler derives from it) pickles a
    ``DeviceMesh`` graph input by what it stands for: its device type, ranks, dim names and the name of this rank's
    process group along each dim (:func:`device_mesh_cache_key`).

    Without it the key pickles the mesh's ``__dict__``, which holds ``hash()`` of the mesh cached in ``_hash``: it
    differs from process to process, so a graph that takes a mesh never hits the on-disk cache launch to launch
    (``repros/torch_fx_graph_cache_device_mesh_hash.py``). Relies on ``FxGraphCachePickler.__init__`` making
    ``self.dispatch_table`` (torch 2.11 to 2.15); the pickler's class is patched for the duration, process-wide,
    nested or concurrent uses sharing one patch."""
    from torch._inductor.codecache import FxGraphCachePickler

    with _mesh_keys.lock:
        if not _mesh_keys.users:
            original = FxGraphCachePickler.__dict__["__init__"]

            @functools.wraps(original)
            def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
                original(self, *args, **kwargs)
                self.dispatch_table[_device_mesh_class()] = _reduce_device_mesh

            FxGraphCachePickler.__init__ = __init__  # type: ignore[method-assign]  # patched for the duration
            _mesh_keys.original, _mesh_keys.wrapper = original, __init__
        _mesh_keys.users += 1
    try:
        yield
    finally:
        with _mesh_keys.lock:
            _mesh_keys.users -= 1
            if not _mesh_keys.users:
                if FxGraphCachePickler.__dict__["__init__"] is _mesh_keys.wrapper:
                    FxGraphCachePickler.__init__ = _mesh_keys.original  # type: ignore[method-assign]  # restored
                else:  # replaced on top of ours meanwhile: left as it is (undoing ours would undo theirs)
                    log.warning("FxGraphCachePickler.__init__ was replaced while keras_dtensor_mixfix had patched it; "
                                "left as it is")
                _mesh_keys.original = _mesh_keys.wrapper = None


class _MeshKeysPatch:
    """The one patch of ``FxGraphCachePickler.__init__`` that every :func:`device_meshes_keyed_by_groups` shares."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.original: Any = None
        self.wrapper: Any = None


_mesh_keys = _MeshKeysPatch()


def _device_mesh_class() -> type:
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh


def device_mesh_cache_key(*parts: Any) -> Tuple[Any, ...]:
    """What a ``DeviceMesh`` pickles to inside :func:`device_meshes_keyed_by_groups` (a module-level function, so the
    pickle names it by reference)."""
    return parts


def _reduce_device_mesh(mesh: Any) -> Any:
    from .aot_compile import mesh_by_groups

    parts = mesh_by_groups(mesh)
    if parts is None:  # this rank has no group in the mesh: torch's own pickling (a key that varies)
        return mesh.__reduce_ex__(pickle.DEFAULT_PROTOCOL)
    return device_mesh_cache_key, parts


def dynamo_error_classes() -> Tuple[type, ...]:
    """The exceptions torch.compile raises when it cannot trace or compile a function (TorchDynamo's own, and a
    backend's failure, which it wraps), as opposed to an error of the code being run."""
    from torch._dynamo import exc

    return (exc.TorchDynamoException,)


def reset_compiled_code() -> None:
    """Drop torch.compile's in-memory compiled code, so every compiled function recompiles on its next call."""
    torch._dynamo.reset()
