"""Layout maps read off a model, and what a layout map leaves sharded or whole.

- :mod:`.derived_layouts`: a ``LayoutMap`` derived from a built model's layers
  (``keras_dtensor_mixfix.layouts.derive_layouts``, ``layout_map_for``);
- :mod:`.layer_reading`: what the derivation reads off the layers (kernel axes, the layer walk, hidden width);
- :mod:`.sharding_report`: what is sharded (``keras_dtensor_mixfix.layouts.sharding_report``), and layout map keys
  that match no variable;
- :mod:`.whole_weights`: a warning naming a large weight the layout map leaves whole on every rank.
"""
