"""Reading a DTensor's value as NumPy or Python numbers, as with a plain tensor, where that takes no collective.

torch refuses ``.numpy()`` and ``.tolist()`` (and so ``np.asarray``) on every DTensor: ".numpy() is not supported for
tensor subclasses". While patched, a DTensor whose every rank holds the whole value (each mesh dim ``Replicate``, or
of one rank) gives that value from this rank's local tensor: no communication, so a line that only rank 0 runs (a
log) cannot hang; a loss or metric a Keras step returns is such a value. A DTensor whose value is spread over the
ranks (split, or a partial sum) still raises, with the call every rank must make (``full_tensor()``, a collective).
Nothing else changes: these calls raised before on every DTensor. ``unpatch()`` gives torch's methods back.
"""

from __future__ import annotations

from typing import Any, Optional

from .._rules.errors import SpreadValueError
from .recorder import PatchRecorder


def whole_local_value(tensor: Any, call: str) -> Any:
    """The local tensor of ``tensor`` when it holds the whole value on this rank; else a :class:`SpreadValueError`
    (a ``RuntimeError``) naming ``call``, the layout, the mesh and what to do."""
    placements = tuple(tensor.placements)
    mesh = tensor.device_mesh
    spread = [(dim, p) for dim, p in enumerate(placements) if not p.is_replicate() and mesh.size(dim) > 1]
    if not spread:
        return tensor.to_local()
    kind = "a partial sum" if any(p.is_partial() for _, p in spread) else "split"
    raise SpreadValueError(
        f"{call} of a DTensor of shape {tuple(tensor.shape)} laid out as {placements} on {mesh}: its value is {kind} "
        f"over the ranks, so reading it takes a collective that every rank must run. Call `.full_tensor()` on every "
        f"rank (not inside a rank-0-only branch), then `{call}` on its result. (A DTensor replicated on every mesh "
        "dim gives its value here with no collective.)")


class ValuesOut:
    """Installs ``DTensor.numpy`` and ``DTensor.tolist`` for whole values while patched."""

    def __init__(self) -> None:
        self._patches = PatchRecorder()

    def install(self) -> None:
        """Set the two methods on ``DTensor`` (once)."""
        import torch
        from torch.distributed.tensor import DTensor

        if len(self._patches):
            return

        def dtensor_numpy(self: Any, *, force: bool = False) -> Any:
            return whole_local_value(self, "numpy()").numpy(force=force)

        def dtensor_tolist(self: Any) -> Any:
            return whole_local_value(self, "tolist()").tolist()

        dtensor_numpy.__doc__ = torch.Tensor.numpy.__doc__
        dtensor_tolist.__doc__ = torch.Tensor.tolist.__doc__
        self._patches.set(DTensor, "numpy", dtensor_numpy, label="DTensor.numpy")
        self._patches.set(DTensor, "tolist", dtensor_tolist, label="DTensor.tolist")

    def uninstall(self) -> None:
        """Give torch's methods back exactly."""
        self._patches.restore()


_values_out: Optional[ValuesOut] = None


def values_out() -> ValuesOut:
    """The one installer (made on first use: it imports torch)."""
    global _values_out
    if _values_out is None:
        _values_out = ValuesOut()
    return _values_out
