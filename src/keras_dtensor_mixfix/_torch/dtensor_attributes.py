"""DTensor's private attributes, for code off the promotion path (error messages, diagnostics).

``DTensor._local_tensor`` is this rank's plain tensor (what the public ``to_local()`` returns, without
going through autograd); ``DTensor._spec`` its ``DTensorSpec`` (mesh, placements, global shape and
dtype). Both unchanged since torch 2.4; ``checks.check_dtensor_attributes`` checks them on every torch.

The promotion engine (``_engine/``) reads these two attributes directly instead: a function call
per read would cost more than a promoted op's own bookkeeping. That is the one documented exception
to "torch-private names only in ``_torch/``" (see the ``_torch`` package docstring).
"""

from __future__ import annotations

from typing import Any

__all__ = ["local_tensor", "dtensor_spec"]


def local_tensor(dtensor: Any) -> Any:
    """This rank's plain tensor of ``dtensor`` (``DTensor._local_tensor``)."""
    return dtensor._local_tensor


def dtensor_spec(dtensor: Any) -> Any:
    """The ``DTensorSpec`` of ``dtensor`` (``DTensor._spec``)."""
    return dtensor._spec
