"""The torch backend's protocol with ``keras.distribution``: what Keras' own torch ``distribution_lib`` is on 3.16.

- :mod:`.backend_lib`: the torch ``distribution_lib`` Keras calls (ours, or Keras' own completed);
- :mod:`.distribution_lib`: ours, the torch backend of ``keras.distribution`` for a Keras that has none (3.12 to
  3.15);
- :mod:`.variables`: layout-aware variables (DTensor parameters);
- :mod:`.initial_pieces`: variables' initial values made in pieces (constants, position-keyed draws, rank 0's draws);
- :mod:`.initial_values`: Keras' element-wise random initializers drawn piece by piece, keyed by position;
- :mod:`.position_draws`: the position-keyed generator (NumPy's counter-based Philox) and its distributions;
- :mod:`.values`: global values out of ``convert_to_numpy``;
- :mod:`.layouts`: Keras layouts as DTensor meshes and placements, and moving a tensor to one;
- :mod:`.local_pieces`: computing on each rank's own pieces, the one way out of DTensor and back in;
- :mod:`.cuda_devices`: which CUDA device each rank computes on.
"""
