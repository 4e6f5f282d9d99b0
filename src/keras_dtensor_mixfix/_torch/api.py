"""The torch boundary: private torch APIs the package relies on, each checked on named versions.

Everything here reads or touches torch internals that have no public equivalent. Each
function says what it relies on; all of them were checked on every release of the supported
range (``versions``), on which CI runs the whole suite, and ``selfcheck`` checks each of them on
the torch a process runs (``doctor`` prints it; the gate runs it before activating on a newer
torch). A name added here needs a check in ``checks`` (a unit test says so). A torch where one of
them is missing makes the caller fall back to doing nothing (torch's own path), never to guessing.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Tuple

import torch

log = logging.getLogger(__name__)

__all__ = [
    "DTensorSpec", "TensorMeta", "redistribute_local_tensor", "compute_local_shape_and_global_offset",
    "dtensor_fast_constructor", "dtensor_handles_specially", "propagate_sharding",
    "implicit_replication_enabled", "custom_op_handler", "MIXED_OPERAND_MESSAGE", "is_mixed_operand_error",
    "clear_sharding_cache", "dispatch_rule_holder", "registration_handle", "is_traced", "current_compile_id",
    "aot_autograd_cache", "skipping_save", "without_autograd_cache", "reset_compiled_code", "is_masked_partial",
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
    from torch.distributed.tensor.placement_types import _MaskPartial  # noqa: E402
except ImportError:  # pragma: no cover - a torch without it has no masked partial results to settle
    _MaskPartial = ()  # type: ignore[assignment,misc]


def is_masked_partial(placement: Any) -> bool:
    """Whether ``placement`` is DTensor's ``_MaskPartial`` (an isinstance check TorchDynamo can trace,
    unlike reading its ``mask_buffer``)."""
    return isinstance(placement, _MaskPartial)


def dtensor_fast_constructor() -> Optional[Callable[..., Any]]:
    """DTensor's C++ constructor ``torch.Tensor._dtensor__new__(cls, local, spec, requires_grad=)``.

    ``DTensor(...)`` is that constructor followed by a Python ``__init__`` that does nothing but is
    wrapped for dynamo and export (about 1.3 us of the 2 us a construction costs); eager
    promotions call the C++ part alone. None where DTensor is built differently.
    """
    constructor = getattr(torch.Tensor, "_dtensor__new__", None)
    return constructor if constructor is not None and DTensor.__new__ is constructor else None


def dtensor_handles_specially(func: Any) -> bool:
    """Ops DTensor runs its own way: random ops (under its RNG tracker) and custom-handled ops."""
    dispatcher = DTensor._op_dispatcher
    return func in dispatcher._random_ops or func in dispatcher._custom_op_handlers


def propagate_sharding(func: Any, args: Any, kwargs: Any) -> Any:
    """DTensor's own sharding propagation for a call of DTensors: its ``OutputSharding``.

    None when this rank is not part of the call's mesh (DTensor then skips the op).
    """
    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(func, args, kwargs)
    if not op_info.compute_mesh._is_current_rank_part_of_mesh():
        return None
    dispatcher.sharding_propagator.propagate(op_info)
    return op_info.output_sharding


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


def dispatch_rule_holder(qualname: str) -> Any:
    """The holder of ``torch_dispatch`` rules for one op overload (``torch._library.simple_registry``).

    It keeps ONE rule per (op, class) and raises on a second registration.
    """
    from torch._library import simple_registry

    return simple_registry.singleton.find(qualname).torch_dispatch_rules


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


def aot_autograd_cache() -> Optional[Any]:
    """torch.compile's on-disk graph cache class, ``AOTAutogradCache``, whose ``save`` is a staticmethod.

    None where it is missing or built differently (then there is no such cache to keep graphs out of).
    """
    try:
        from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
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


def without_autograd_cache() -> Any:
    """A context in which torch.compile neither loads nor saves AOTAutograd's on-disk cache entries
    (``torch._functorch.config.enable_autograd_cache``, patched for the duration; process-wide while it lasts)."""
    import torch._functorch.config as functorch_config

    return functorch_config.patch(enable_autograd_cache=False)


def dynamo_error_classes() -> Tuple[type, ...]:
    """The exceptions torch.compile raises when it cannot trace or compile a function (TorchDynamo's own, and a
    backend's failure, which it wraps), as opposed to an error of the code being run."""
    from torch._dynamo import exc

    return (exc.TorchDynamoException,)


def reset_compiled_code() -> None:
    """Drop torch.compile's in-memory compiled code, so every compiled function recompiles on its next call."""
    torch._dynamo.reset()
