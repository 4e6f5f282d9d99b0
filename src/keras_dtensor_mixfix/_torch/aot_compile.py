"""The torch boundary for compiling a function without TorchDynamo: AOTAutograd traces it, inductor compiles it.

AOTAutograd's ``aot_function`` runs the function's Python once, on fake tensors, and records the aten ops it reaches
(a DTensor's ops as its local ops and collectives), with the backward it derives; inductor then compiles each graph
its partitioner makes, with the pieces inductor's own ``torch.compile`` backend hands AOTAutograd: its decomposition
table, its partitioner (which runs its joint-graph passes first) and its graph compiler. Relied on, and checked on the
running torch by ``checks_compile.check_aot_inductor``: ``functorch.compile.aot_function`` (the keywords
``fw_compiler``, ``bw_compiler``, ``partition_fn``, ``decompositions``, ``keep_inference_input_mutations``), and the
private ``torch._inductor.compile_fx.compile_fx_inner`` (keyword ``is_backward``), ``torch._inductor.compile_fx
.partition_fn`` and ``torch._inductor.decomposition.select_decomp_table``; and ``torch.utils._pytree``'s
``tree_flatten`` and ``tree_unflatten`` (:func:`flatten`), whose structures compare equal for equal structures.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional, Tuple

__all__ = ["aot_inductor_function", "flatten", "unflatten", "mesh_by_groups"]


def mesh_by_groups(mesh: Any) -> Optional[Tuple[Any, ...]]:
    """A mesh as a compiled graph holds it: device type, ranks, dim names and each dim's process group name (what
    its collectives name); None where this rank has no group in the mesh. Public DeviceMesh API only; inductor's
    cache key of a mesh (``api.device_meshes_keyed_by_groups``) and the block tracer's signature both read it."""
    try:
        groups = tuple(mesh.get_group(dim).group_name for dim in range(mesh.ndim))
    except RuntimeError:
        return None
    return (mesh.device_type, mesh.mesh.tolist(), mesh.mesh_dim_names, groups)


def flatten(value: Any) -> Tuple[List[Any], Any]:
    """``value``'s leaves and its structure (hashable, comparable), as AOTAutograd flattens arguments
    (``torch.utils._pytree.tree_flatten``)."""
    from torch.utils import _pytree as pytree

    return pytree.tree_flatten(value)


def unflatten(leaves: List[Any], structure: Any) -> Any:
    """:func:`flatten`'s inverse."""
    from torch.utils import _pytree as pytree

    return pytree.tree_unflatten(leaves, structure)


def aot_inductor_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (positional tensor arguments; a pytree of tensors out) traced at its first call and compiled by inductor.

    The function returned does not check its inputs: every later call must have the first call's signature (the
    tensors' types, shapes, strides, dtypes, devices, subclass layouts and whether they require grad, and grad mode),
    which the caller keys."""
    from functorch.compile import aot_function
    from torch._inductor.compile_fx import compile_fx_inner, partition_fn
    from torch._inductor.decomposition import select_decomp_table

    return aot_function(fn, fw_compiler=compile_fx_inner,
                        bw_compiler=functools.partial(compile_fx_inner, is_backward=True),
                        partition_fn=partition_fn, decompositions=select_decomp_table(),
                        keep_inference_input_mutations=True)
