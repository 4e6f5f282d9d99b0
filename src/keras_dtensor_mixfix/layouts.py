"""Layout maps for models that ship none: tensor parallelism read off the model's own layers.

keras_hub ships ``get_layout_map`` for a few backbones. :func:`layout_map_for` derives one for any built Keras
model whose weights are embeddings, ``Dense``/``EinsumDense`` projections, expert banks and norms (every keras_hub
CausalLM), so that sharding a model takes no map written by hand::

    import keras
    import keras_hub
    from keras_dtensor_mixfix.layouts import layout_map_for

    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], keras.distribution.list_devices())
    layout_map = layout_map_for(keras_hub.models.Gemma3Backbone, mesh, config=config)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map,
                                                                         batch_dim_name="batch"))
    backbone = keras_hub.models.Gemma3Backbone(**config)

The map is plain Keras (it works on JAX too). The rules are in ``docs/keras.md`` ("Layout maps derived from the
model"); :func:`derive_layouts` also says which weights it left whole and why.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ._keras.layout_maps import derived_layouts as _derivation
from ._keras.layout_maps import sharding_report as _report
from ._keras.layout_maps.derived_layouts import _FIRST_OTHER_AXIS, DerivedLayouts
from ._keras.layout_maps.sharding_report import ShardingReport, VariableSharding

__all__ = ["DerivedLayouts", "ShardingReport", "VariableSharding", "derive_layouts", "layout_map_for",
           "sharding_report"]


def derive_layouts(model: Any, mesh: Any, *, config: Optional[Mapping[str, Any]] = None,
                   model_axis: Optional[str] = None, data_axis: Any = _FIRST_OTHER_AXIS) -> DerivedLayouts:
    """Derive tensor-parallel layouts for ``model``'s weights on ``mesh``.

    Args:
        model: a built Keras model or layer (a keras_hub ``CausalLM`` or its backbone), or a model class (a
            keras_hub task class stands for its backbone's) to build from ``config``: its variables are never
            initialized (shapes only), so no memory is taken for its weights.
        mesh: the ``keras.distribution.DeviceMesh`` the map is for.
        config: the keyword arguments of the model class (only with a class).
        model_axis: the mesh axis the projections, the vocabulary and the experts are split over; by default
            ``"model"``, or the mesh's last axis.
        data_axis: the mesh axis the hidden dimension of each split weight is split over as well (weights held
            once across the data-parallel replicas, as keras_hub's maps do); by default the mesh's first axis other
            than ``model_axis``; None keeps weights whole along it.

    Returns:
        A :class:`DerivedLayouts`: the ``LayoutMap``, each split variable's axes, and each variable left whole
        with the reason.

    Raises:
        InvalidArgumentError: an axis the mesh does not have, a class without ``config``, an unbuilt model, or a
            model without an embedding layer (there is no hidden width to read).
    """
    return _derivation.derive_layouts(model, mesh, config=config, model_axis=model_axis, data_axis=data_axis)


def layout_map_for(model: Any, mesh: Any, *, config: Optional[Mapping[str, Any]] = None,
                   model_axis: Optional[str] = None, data_axis: Any = _FIRST_OTHER_AXIS) -> Any:
    """A ``keras.distribution.LayoutMap`` for ``model`` on ``mesh``: :func:`derive_layouts`'s ``layout_map``.

    Weights that cannot be split evenly (key/value heads, a vocabulary or experts that do not divide the model
    axis) are left whole with one warning each; the map is valid on every mesh.
    """
    return derive_layouts(model, mesh, config=config, model_axis=model_axis, data_axis=data_axis).layout_map


def sharding_report(model: Any) -> ShardingReport:
    """What ``model`` holds on this rank: every variable (its optimizer's too, once built) with the mesh axes it is
    split over, its global and local shape and this rank's bytes, and the totals beside one process's.

    It reads this rank's values only (no collective): any rank may call it alone, e.g. rank 0 before trusting a
    run. ``print(sharding_report(model))`` shows a table; the fields are in :class:`ShardingReport`. Works for any
    Keras model, with or without a distribution (then nothing is split).
    """
    return _report.sharding_report(model)
