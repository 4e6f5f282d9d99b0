"""``jit_compile=True`` under a distribution.

Keras' ``torch.compile`` of a step that holds DTensors keeps Keras' own backend (torch's default,
inductor) and asks for static shapes: with automatic dynamic shapes, the recompile that follows a
new batch size fails to retrace DTensor specs. On Keras 3.12 to 3.15 that applies under any distribution;
on Keras 3.16, which refuses ``jit_compile`` under non-``DataParallel`` distributions because of its
dispatch mode, it applies where our promotion replaced that mode (:mod:`.promotion_mode`), and
``DataParallel`` compiles as Keras does.

On Keras 3.12 to 3.15 the train step compiled is the fork of Keras' own in :mod:`.forked_train_step`.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Dict, List

from ..._lifecycle.recorder import PatchRecorder
from ..boundary import keras_modules, keras_private
from ..boundary.overrides import Override
from ..boundary.patches import replaced_for_the_call
from . import ddp, layer_compile, promotion_mode


def _compile_allowed_while_replaced(patches: PatchRecorder) -> None:
    trainer_class = keras_modules.trainer_class()
    original_use = getattr(trainer_class, keras_private.TRAINER_USE_TORCH_COMPILE)

    @functools.wraps(original_use)
    def _use_torch_compile(self: Any) -> bool:
        if promotion_mode.replaced():  # the mode Keras refuses to compile under is off
            return not self.run_eagerly and bool(self.jit_compile)
        return original_use(self)

    patches.set(trainer_class, keras_private.TRAINER_USE_TORCH_COMPILE, _use_torch_compile)


COMPILE_ALLOWED = Override(
    name="compile allowed", attributes=(keras_private.TRAINER_USE_TORCH_COMPILE,),
    description="jit_compile: each distinct repeated block compiled once, or the whole step (also under "
                "ModelParallel while our promotion replaces Keras' mode)",
    apply=_compile_allowed_while_replaced, needed=keras_modules.native_promotion_mode)
"""Keras 3.16, which refuses ``jit_compile`` under its own promotion mode: allowed where ours replaced it."""


def static_shapes(trainer: Any) -> bool:
    """Whether ``trainer``'s step functions are to be compiled with static shapes (under a distribution)."""
    if not trainer.jit_compile or trainer.run_eagerly:
        return False
    if keras_modules.native_promotion_mode():
        return promotion_mode.replaced()
    return keras_modules.distribution() is not None


def make_with_static_shapes(original_make: Callable[..., Any], trainer: Any, force: bool) -> bool:
    """``original_make(trainer, force=force)`` for a step compiled under a distribution; returns whether its layers
    are compiled instead (:mod:`.layer_compile`: the step then stays eager).

    Either way Keras' ``torch.compile`` is asked for static shapes (Keras passes no options: the backend stays
    Keras' own); compiling per layer, the step's own ``torch.compile`` returns the step as it is.
    """
    import torch

    per_layer = layer_compile.prepare(trainer)
    # torch.compile is global: replaced through a recorder for the one call, restored exactly after it (or left, with
    # a warning, if someone replaced it on top meanwhile)
    with replaced_for_the_call() as patches:
        patches.set(torch, "compile", _not_compiled if per_layer else functools.partial(torch.compile, dynamic=False))
        original_make(trainer, force=force)
    return per_layer


def _not_compiled(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
    return function


def compiles_sharded_weights(trainer: Any) -> bool:
    """Whether ``trainer``'s steps are compiled with sharded weights: under a distribution, or with DTensor weights
    (a model built under one, used after ``set_distribution(None)``)."""
    if not trainer.jit_compile or trainer.run_eagerly:
        return False
    return keras_modules.distribution() is not None or ddp.holds_dtensor_parameters(trainer)


def keyed_by_rank(step: Callable[[Any], Any], trainer: Any) -> Callable[[Any], Any]:
    """``step`` (compiled with sharded weights), run with torch.compile's on-disk cache keys tagged by this rank's
    place in its meshes (:func:`rank_cache_key_tag`) while it compiles.

    The ranks of a host share AOTAutograd's and inductor's on-disk caches, and their keys do not tell the ranks'
    graphs apart: a ``DeviceMesh`` graph input is hashed as "the first opaque input", not by its process groups. On a
    (2, 2) mesh, on Keras 3.12.4, ranks 1 and 3 loaded the step ranks 0 and 2 had saved, whose collectives name
    process groups they are not in ("Could not resolve the process group registered under the name 1"), and the
    step failed on those ranks and hung on the others. Tagged, each rank loads only what a rank in its place (the
    same rank, world size, meshes and process-group names) compiled: its own entries of an earlier launch of the
    job, so a second launch loads the graphs AOTAutograd could cache instead of compiling them again (not those
    that hold a custom autograd Function, nor those the compile-cache guard kept out because they traced a
    promotion). A ``DeviceMesh`` graph input is meanwhile keyed by its devices, dim names and process groups
    (:func:`device_meshes_keyed_by_groups`), not by its per-process ``hash()``, without which no graph that takes a
    mesh would hit the cache from one launch to the next.
    """
    from ..._torch.api import cache_key_tagged, device_meshes_keyed_by_groups  # imports torch: not at import
    from ..._torch.versions import has_defect, running_torch_version

    tag: List[str] = []
    meshes_keyed = (device_meshes_keyed_by_groups if has_defect("fx_graph_cache_device_mesh_hash",
                                                                running_torch_version()) else contextlib.nullcontext)

    @functools.wraps(step)
    def tagged(data: Any) -> Any:
        if not tag:
            tag.append(rank_cache_key_tag(trainer))
        with cache_key_tagged(tag[0]), meshes_keyed():
            return step(data)

    return tagged


def rank_cache_key_tag(trainer: Any) -> str:
    """This rank, the world size, and each mesh the trainer's variables are laid out on: its devices, dim names and
    the name of this rank's process group along each dim (the names a compiled collective resolves)."""
    import torch.distributed as dist

    meshes: Dict[int, Any] = {}
    for variable in trainer.variables:
        mesh = getattr(variable.value, "device_mesh", None)
        if mesh is not None:
            meshes.setdefault(id(mesh), mesh)
    parts = ([f"rank {dist.get_rank()} of {dist.get_world_size()}"] if dist.is_available() and dist.is_initialized()
             else [])
    for mesh in meshes.values():
        groups = [mesh.get_group(dim).group_name for dim in range(mesh.ndim)]
        parts.append(f"mesh {mesh.mesh.tolist()} {mesh.mesh_dim_names} groups {groups}")
    return "keras_dtensor_mixfix: " + "; ".join(parts)
