"""What the self-check's checks share: the ``Check`` record and the ``Probe`` they run against.

The probe holds a world-of-one mesh, a DTensor on it, a plain tensor, and a probe operator of its own
(``keras_dtensor_mixfix_selfcheck::probe``), which the package's patch never hooks: checks send their
mixed calls there, never through the patch. ``close()`` removes the operator and every registration
made on it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Tuple

PROBE_NAMESPACE = "keras_dtensor_mixfix_selfcheck"
PROBE_QUALNAME = f"{PROBE_NAMESPACE}::probe"


@dataclasses.dataclass(frozen=True)
class Check:
    """One check: ``run(probe)`` returns what it saw, or raises when torch does not behave as ``api`` relies on."""

    name: str
    relies_on: str
    run: Callable[["Probe"], str]


class Probe:
    """What the checks share: a world-of-one mesh, a DTensor, a plain tensor and the probe operator."""

    def __init__(self) -> None:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        self.mesh = init_device_mesh("cpu", (1,))
        self.dtensor = distribute_tensor(torch.arange(16.0).reshape(4, 4), self.mesh, [Shard(0)])
        self.plain = torch.full((4, 4), 2.0)
        self.library: Any = None

    def probe_op(self) -> Any:
        """``probe(a, b) = a + b`` with a backward that calls ``probe`` again (a mixed call inside backward)."""
        import torch

        if self.library is None:
            library = torch.library.Library(PROBE_NAMESPACE, "DEF")
            library.define("probe(Tensor a, Tensor b) -> Tensor")
            library.impl("probe", lambda a, b: a + b, "CompositeExplicitAutograd")

            def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
                ctx.other = inputs[1]

            def backward(ctx: Any, grad: Any) -> Tuple[Any, None]:
                return torch.ops.keras_dtensor_mixfix_selfcheck.probe(grad, torch.zeros_like(ctx.other)), None

            torch.library.register_autograd(PROBE_QUALNAME, backward, setup_context=setup_context, lib=library)
            self.library = library
        return torch.ops.keras_dtensor_mixfix_selfcheck.probe.default

    def close(self) -> None:
        if self.library is not None:
            self.library._destroy()  # the op's definition and every registration made through this library
            self.library = None


def require(condition: Any, what: str) -> None:
    if not condition:
        raise AssertionError(what)


def api_module() -> Any:
    """``api``, imported when a check first asks for it: a torch where its imports fail gets a failed
    ``api_imports`` check, not a self-check that cannot start."""
    from . import api

    return api
