"""Make ``keras.distribution`` (ModelParallel, DataParallel) train on the torch backend.

``install()`` (run automatically when Keras is imported with the torch backend and
auto-activation is on) adds, only where the installed Keras lacks them (the pieces live in
:mod:`keras_dtensor_mixfix._keras`, one module per concern):

- a torch ``distribution_lib`` (:mod:`keras_dtensor_mixfix._keras.distribution_lib`), also
  importable under Keras 3.16's module name for it (:mod:`._keras.backend_lib`);
- layout-aware variables: a variable with a layout holds an ``nn.Parameter`` wrapping a DTensor;
  ``assign``/``set_weights``/loading keep the layout;
- global values out: ``convert_to_numpy`` (so ``get_weights``, saving, History, ``predict``)
  gathers DTensors; printing a variable never gathers;
- input batches distributed along the batch axis before each train/test/predict step,
  with logs and predictions returned as plain global tensors;
- non-tf.data inputs accepted in multi-process runs (each process iterates the global batch
  and keeps its slice; with ``distribution.auto_shard_dataset = False`` each process feeds its own shard);
- ``jit_compile=True`` under a distribution compiles each distinct repeated block once, shared by every block
  like it, the rest of the step eager (a model with no repeated block: the whole step; :func:`set_compile_unit`),
  with Keras' own backend (inductor) and static shapes;
- saving writes files from rank 0 only, which alone assembles each whole weight from the pieces the other ranks
  send; loading reads each rank's own slice of each weight from the h5 file;
- a large weight the layout map leaves whole on every rank is named in a warning, with a rule that shards it;
- on a Keras that wraps models in ``DistributedDataParallel`` when no distribution is set (3.16),
  a model with sharded weights is not wrapped (DDP cannot broadcast DTensors).

Supported: Keras 3.12 to 3.16.x (``_keras.keras_gate``). On another Keras, ``install()`` raises
:class:`UnsupportedKerasError` and auto-activation installs nothing, logging one warning line: Keras runs
exactly as it is. A newer Keras can be opted in to (``KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_KERAS=1`` or
``install(allow_newer_keras=True)``): the Keras self-check of every Keras internal used runs first.

On a Keras with its own torch distribution (3.16), Keras' pieces are kept, saving still writes
from rank 0 only, and while the package is patched our promotion replaces Keras'
``KerasDTensorPromotionMode`` (so ``jit_compile=True`` compiles under ``ModelParallel``).

``uninstall()`` restores every attribute it replaced, and Keras' own promotion mode.
"""

from __future__ import annotations

import logging
import threading
from typing import List, Optional

from ._keras import (activations, attention_ops, embedding_ops, reduction_ops, tensor_ops, backend_lib, compile, convolution, data, ddp, einsum_kernel_split, keras_gate,
                     keras_modules, layer_compile, local_einsum, normalization, promotion_mode, reductions, repeat, reshape, saving,
                     tracebacks, values, variables, vocab_parallel_loss, whole_weights)
from ._lifecycle.recorder import PatchRecorder
from ._rules.errors import UnsupportedKerasError

log = logging.getLogger("keras_dtensor_mixfix")

__all__ = ["install", "uninstall", "is_installed", "report", "set_compile_unit", "UnsupportedKerasError"]


_lock = threading.RLock()
_installed: Optional[PatchRecorder] = None
_report: List[str] = []
_patched_here = False
_mode_replaced = False


def is_installed() -> bool:
    return _installed is not None


def report() -> List[str]:
    """What ``install()`` added (for ``doctor``)."""
    return list(_report)


def set_compile_unit(unit: Optional[str]) -> None:
    """What ``jit_compile=True`` compiles under a distribution, for models compiled from now on in this process.

    Args:
        unit: ``"layer"`` (the default): each distinct repeated block of the model (an LLM's decoder blocks) is
            compiled once and shared by every block like it, the rest of the step runs eagerly; a model with no
            repeated block compiles its whole step. ``"step"``: the whole step is compiled (one graph per step
            kind, every block traced and compiled again). None: back to ``KERAS_DTENSOR_MIXFIX_COMPILE_UNIT``'s
            value (default ``layer``).

    Raises:
        InvalidArgumentError: ``unit`` is none of those.
    """
    layer_compile.set_compile_unit(unit)


def install(allow_newer_keras: Optional[bool] = None) -> bool:
    """Install into the imported Keras; returns False (and does nothing) unless its backend is torch.

    Raises :class:`UnsupportedKerasError`, leaving Keras as it is, on a Keras outside the supported
    releases; ``allow_newer_keras`` (default: ``KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_KERAS``) lets a newer
    one in if the Keras self-check passes.
    """
    global _installed, _patched_here, _mode_replaced
    with _lock:
        if _installed is not None:
            return True
        backend = keras_modules.backend_name()
        if backend != "torch":
            log.debug("keras_dtensor_mixfix: Keras backend is %s, not torch: nothing to install", backend)
            return False
    reason = keras_gate.refusal(allow_newer_keras)  # may run the self-check (a subprocess): not under the lock
    if reason is not None:
        raise UnsupportedKerasError(reason)
    with _lock:
        if _installed is not None:
            return True
        patches = PatchRecorder()
        added: List[str] = []
        try:
            native_lib = keras_modules.native_distribution_lib()
            backend_lib.install(patches, added)
            if keras_modules.native_layout_variables():
                added.append("variables: Keras' own layout-aware variables kept")
            else:
                variables.install(patches)
                added.append("variables: layouts become DTensor parameters")
            reductions.install(patches)
            added.append("sharded steps: gradients take their parameters' layouts; layer outputs and their "
                         "gradients are never left partial sums")
            if native_lib:
                added.append("convert_to_numpy: Keras' own kept")
            else:
                values.install(patches)
                added.append("convert_to_numpy: gathers DTensors to global values")
            distribute_batches = not keras_modules.native_data_distribution()
            data.install(patches, distribute_batches)
            compile.install(patches)
            added.append("jit_compile: each distinct repeated block compiled once, or the whole step")
            added.append("trainer: batches distributed on the batch axis; logs and predictions made global"
                         if distribute_batches else "trainer: Keras' own data distribution kept")
            saving.install(patches)
            added.append("saving: rank 0 alone assembles and writes whole weights; loading reads each rank's slices")
            whole_weights.install(patches)
            added.append("layouts: a large weight the layout map leaves whole is named in a warning")
            if ddp.install(patches):
                added.append("trainer: models with sharded weights are not wrapped in DistributedDataParallel")
            embedding_ops.install(patches)
            reduction_ops.install(patches)
            tensor_ops.install(patches)
            attention_ops.install(patches)
            local_einsum.install(patches)
            einsum_kernel_split.install(patches)  # wraps local_einsum's einsum: installed after it
            added.append("ops: einsum runs on local pieces where shardings line up (or are lined up), take gathers "
                         "a table split where its ids are and settles masked partials, slice_update replicates "
                         "sharded inputs, attention runs on local rows and heads")
            if repeat.install(patches):
                added.append("ops: repeat of a DTensor by a whole number expands it (as Keras 3.15 does)")
            normalization.install(patches)
            added.append("ops: rms_normalization of a DTensor split along the normalized axis runs on whole rows")
            convolution.install(patches)
            added.append("ops: a convolution of a DTensor split along channels or positions runs on whole ones")
            activations.install(patches)
            added.append("ops: softplus, elu, selu and celu of a DTensor take their gradient contiguous (the layout "
                         "DTensor declares for theirs)")
            reshape.install(patches)
            added.append("ops: reshape of a DTensor whose split DTensor cannot keep in the new shape gathers the "
                         "reshaped dimensions first")
            vocab_parallel_loss.install(patches)
            added.append("loss: sparse categorical cross-entropy over class-split logits never gathers them")
            tracebacks.install(patches)
            added.append("tracebacks: Keras' filter hides the integration's frames as it hides its own")
            if keras_modules.native_promotion_mode():
                promotion_mode.install(patches)
                _mode_replaced = True
                added.append("promotion: ours replaces Keras' KerasDTensorPromotionMode while patched")
        except BaseException:
            patches.restore()
            if _mode_replaced:
                _mode_replaced = False
                promotion_mode.uninstall()
            raise
        _installed = patches
        _report[:] = added
        from ._lifecycle.patching import is_patched, patch

        if not is_patched():
            patch()  # promotion is the safety net for plain tensors that still meet DTensors
            _patched_here = True
        log.info("keras_dtensor_mixfix: Keras distribution support installed (%s)", "; ".join(added))
        return True


def uninstall() -> None:
    global _installed, _patched_here, _mode_replaced
    with _lock:
        if _installed is None:
            return
        _installed.restore()
        layer_compile.uninstall()
        _installed = None
        _report.clear()
        if _patched_here:  # undo only the patch install() made
            from ._lifecycle.patching import unpatch

            _patched_here = False
            unpatch()
        if _mode_replaced:  # Keras' own activate is back: its mode where Keras would have it
            _mode_replaced = False
            promotion_mode.uninstall()
