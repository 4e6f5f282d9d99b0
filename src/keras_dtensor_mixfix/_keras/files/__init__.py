"""Keras' files under a multi-process distribution: written once, from rank 0, and no rank holds a whole sharded weight.

- :mod:`.saving`: Keras' own saving and loading, rank 0 writes;
- :mod:`.slice_loading`: each rank reads only its own slice of each weight from an h5 file;
- :mod:`.rank_zero_gather`: whole values assembled on rank 0 only;
- :mod:`.callback_files`: Keras' file-writing callbacks write once, the ranks in step;
- :mod:`.other_writers`: what Orbax's and TensorBoard's callbacks, which write besides ``file_utils``, need more;
- :mod:`.sharded_checkpoint`: a model's state as a ``torch.distributed.checkpoint`` state dict;
- :mod:`.commits`: saves seen whole or not at all: files staged beside their targets, committed by renames;
- :mod:`.array_proxy`: a NumPy array whose values are produced only when used;
- :mod:`.memory`: the memory a save, a load or a build freed, given back to the system.
"""
