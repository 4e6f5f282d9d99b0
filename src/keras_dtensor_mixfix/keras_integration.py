"""Make ``keras.distribution`` (ModelParallel, DataParallel) train on the torch backend.

``install()`` (run automatically when Keras is imported with the torch backend and
auto-activation is on) adds, only where the installed Keras lacks them (the pieces live in
:mod:`keras_dtensor_mixfix._keras`, one module per concern, each change declared in :data:`OVERRIDES`):

- a torch ``distribution_lib`` (:mod:`keras_dtensor_mixfix._keras.backend.distribution_lib`), also
  importable under Keras 3.16's module name for it (:mod:`._keras.backend.backend_lib`);
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
- Keras' callbacks that write files write them once, from rank 0, the ranks in step (``writes_once`` gives a
  user's callback the same);
- a large weight the layout map leaves whole on every rank is named in a warning, with a rule that shards it;
- on a Keras that wraps models in ``DistributedDataParallel`` when no distribution is set (3.16),
  a model with sharded weights is not wrapped (DDP cannot broadcast DTensors).

Supported: Keras 3.12 to 3.16.x (``_keras.gate.keras_gate``). On another Keras, ``install()`` raises
:class:`UnsupportedKerasError` and auto-activation installs nothing, logging one warning line: Keras runs
exactly as it is. A newer Keras can be opted in to (``KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_KERAS=1`` or
``install(allow_newer_keras=True)``): the Keras self-check of every Keras internal used runs first.

On a Keras with its own torch distribution (3.16), Keras' pieces are kept, saving still writes
from rank 0 only, and while the package is patched our promotion replaces Keras'
``KerasDTensorPromotionMode`` (so ``jit_compile=True`` compiles under ``ModelParallel``).

``uninstall()`` restores every attribute it replaced, and Keras' own promotion mode.
"""

from __future__ import annotations

import datetime
import logging
import threading
from typing import Any, ContextManager, List, Optional, Tuple, Union

from ._keras.backend import backend_lib, initial_values, values, variables
from ._keras.boundary import keras_modules
from ._keras.boundary.overrides import Override, in_order
from ._keras.files import callback_files, saving
from ._keras.gate import keras_gate
from ._keras.layout_maps import whole_weights
from ._keras.ops import (activations, attention_ops, casting, convolution, einsum_kernel_split, embedding_ops,
                         local_einsum, normalization, reduction_ops, repeat, reshape, tensor_ops, vocab_parallel_loss)
from ._keras.step import (compile, data, ddp, forked_train_step, layer_compile, promotion_mode, reductions,
                          tracebacks)
from ._lifecycle.recorder import PatchRecorder
from ._rules.errors import KerasIntegrationNotInstalledError, UnsupportedKerasError

log = logging.getLogger("keras_dtensor_mixfix")

__all__ = ["install", "uninstall", "is_installed", "report", "set_compile_unit", "set_collective_timeout",
           "writes_once", "sharding_independent_initial_values", "UnsupportedKerasError"]


OVERRIDES: Tuple[Override, ...] = (
    backend_lib.OURS, backend_lib.COMPLETED, variables.OVERRIDE, variables.LAYOUT_ARGUMENT, reductions.OVERRIDE,
    reductions.GRADIENTS_OF_OUR_PARAMETERS, reductions.GRADIENTS_OF_NATIVE_PARAMETERS, values.OVERRIDE,
    data.STEP_FUNCTIONS, data.BATCHES_DISTRIBUTED, data.DATA_ADAPTER, casting.OVERRIDE,
    forked_train_step.TRAIN_STEP, compile.COMPILE_ALLOWED,
    saving.OVERRIDE, callback_files.OVERRIDE, whole_weights.OVERRIDE, ddp.OVERRIDE,
    embedding_ops.OVERRIDE, reduction_ops.OVERRIDE, tensor_ops.OVERRIDE, attention_ops.OVERRIDE,
    local_einsum.OVERRIDE, einsum_kernel_split.OVERRIDE, repeat.OVERRIDE, reshape.OVERRIDE, normalization.OVERRIDE,
    convolution.OVERRIDE, activations.OVERRIDE, vocab_parallel_loss.OVERRIDE,
    tracebacks.OVERRIDE, promotion_mode.OVERRIDE,
)
"""Every change the integration may make to Keras (:class:`._keras.boundary.overrides.Override`), applied in this order
where their ``after`` allows; the report lists them in the same order."""


class _Integration:
    """What ``install()`` applied to the running Keras, and the one lock guarding it.

    The lock is held only to read or change these fields, never while calling anything: ``install()`` and
    ``uninstall()`` mark the integration busy under it, apply or restore the overrides (and patch or unpatch) with
    it released, then publish the result under it. A second thread's ``install()`` or ``uninstall()`` waits for a busy
    one to finish; the busy thread's own nested call (a Keras import an override triggers, which auto-activation
    answers with ``install()``) returns at once.
    """

    def __init__(self) -> None:
        self.changed = threading.Condition(threading.Lock())
        self.busy_in: Optional[int] = None  # the thread applying or restoring, outside the lock
        self.recorder: Optional[PatchRecorder] = None
        self.applied: List[Override] = []
        self.report: List[str] = []
        self.patched_here = False  # install() patched the package (uninstall() unpatches it)

    def begin(self) -> bool:
        """Wait until no other thread is busy, then mark this one busy; False for the busy thread's own nested call.
        Called with ``changed`` held."""
        me = threading.get_ident()
        if self.busy_in == me:
            return False
        while self.busy_in is not None:
            self.changed.wait()
        self.busy_in = me
        return True

    def end(self) -> None:
        """This thread is no longer busy. Called with ``changed`` held."""
        self.busy_in = None
        self.changed.notify_all()


_STATE = _Integration()


def is_installed() -> bool:
    with _STATE.changed:
        return _STATE.recorder is not None


def report() -> List[str]:
    """What ``install()`` added (for ``doctor``)."""
    with _STATE.changed:
        return list(_STATE.report)


def writes_once(callback: Any) -> Any:
    """Give a Keras callback (instance or class) what Keras' own file-writing callbacks get under a multi-process
    distribution: Keras' ``file_utils`` writes (``makedirs``, ``rmtree``, ``remove``, ``copy``, a ``File``
    opened to write) happen on rank 0 only, and every rank waits after a hook that wrote until rank 0 has written.
    Returns ``callback``. Without it a callback runs on every rank, as it does without the package; to write
    with your own code from one rank, test ``torch.distributed.get_rank() == 0``."""
    return callback_files.writes_once(callback)


def sharding_independent_initial_values() -> ContextManager[None]:
    """A context manager: within it (in this thread), Keras' element-wise random initializers (``RandomNormal``,
    ``TruncatedNormal``, ``RandomUniform``, Glorot, He, Lecun: every ``VarianceScaling``) draw, without a distribution
    too, the values a distributed job draws on Keras 3.12 to 3.15.

    Under a distribution each rank draws only its own pieces of those initial values, with values that depend on
    the seed, the shape, the dtype and each element's position alone, so they are the same on every mesh and in
    any number of processes; they are not the values Keras draws without a distribution. A one-process reference
    built within this context from the same seeds starts from the same weights as the distributed job. Outside it,
    a process without a distribution draws as Keras does. On Keras 3.16, whose own variables draw every initial
    value whole on every rank, Keras' values are the distributed ones too and this context changes nothing.

    Raises:
        KerasIntegrationNotInstalledError: on Keras 3.12 to 3.15 with the integration not installed (there Keras
            would draw its own values within the context too).
    """
    if variables.OVERRIDE.needed() and not is_installed():
        raise KerasIntegrationNotInstalledError(
            "keras_dtensor_mixfix: sharding_independent_initial_values() needs the Keras integration "
            "installed, which draws the values: call keras_integration.install() first (it installs "
            "itself at `import keras` unless KERAS_DTENSOR_MIXFIX=0 is set)")
    return initial_values.sharding_independent_initial_values()


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


def set_collective_timeout(timeout: Union[float, datetime.timedelta, None]) -> None:
    """How long a collective of the process group ``keras.distribution.initialize()`` creates (Keras 3.12 to 3.15:
    the package's ``distribution_lib``) waits for every rank before it raises, for groups created from now on.

    Args:
        timeout: seconds, or a ``datetime.timedelta``; None: back to ``KERAS_DTENSOR_MIXFIX_COLLECTIVE_TIMEOUT``'s
            value (seconds), else the default, 600 s (NCCL's own default; gloo's is 30 minutes). A rank that stops
            taking part without exiting (it caught an error and waits) then ends the job within it.

    Raises:
        InvalidArgumentError: ``timeout`` is not a positive number of seconds, a ``timedelta`` or None.
    """
    from ._keras.backend import distribution_lib  # imported where Keras asks for it: torch.distributed comes with it

    distribution_lib.set_collective_timeout(timeout)


def install(allow_newer_keras: Optional[bool] = None) -> bool:
    """Install into the imported Keras; returns False (and does nothing) unless its backend is torch.

    Raises :class:`UnsupportedKerasError`, leaving Keras as it is, on a Keras outside the supported
    releases; ``allow_newer_keras`` (default: ``KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_KERAS``) lets a newer
    one in if the Keras self-check passes. Safe to call from several threads: one installs, the others wait for it.
    """
    from ._lifecycle.patching import is_patched, patch

    backend = keras_modules.backend_name()
    if backend != "torch":
        log.debug("keras_dtensor_mixfix: Keras backend is %s, not torch: nothing to install", backend)
        return False
    with _STATE.changed:
        if not _STATE.begin():
            return True  # this thread's own install() is applying the overrides
        if _STATE.recorder is not None:
            _STATE.end()
            return True
    patches = PatchRecorder()
    applied: List[Override] = []
    try:
        reason = keras_gate.refusal(allow_newer_keras)  # may run the self-check (a subprocess)
        if reason is not None:
            raise UnsupportedKerasError(reason)
        added: List[str] = []
        ordered = in_order(OVERRIDES)
        needed = [override.needed() for override in ordered]  # on Keras as it is, before any is applied
        for override, wanted in zip(ordered, needed):
            if not wanted:
                if override.kept is not None:
                    added.append(override.kept)
                continue
            with patches.on_behalf_of(override.name):
                line = override.apply(patches)
            applied.append(override)
            added.append(line or override.description)
        patched_here = not is_patched()
        if patched_here:
            patch()  # promotion is the safety net for plain tensors that still meet DTensors
    except BaseException:
        patches.restore()
        _forget(applied)
        with _STATE.changed:
            _STATE.end()
        raise
    with _STATE.changed:
        _STATE.recorder, _STATE.applied = patches, applied
        _STATE.report, _STATE.patched_here = added, patched_here
        _STATE.end()
    log.info("keras_dtensor_mixfix: Keras distribution support installed (%s)", "; ".join(added))
    return True


def uninstall() -> None:
    """Restore every attribute ``install()`` replaced, unpatch the package if ``install()`` patched it, then let each
    applied override forget what it kept per model or distribution (Keras 3.16: its own promotion mode back where
    Keras would have it)."""
    from ._lifecycle.patching import unpatch

    with _STATE.changed:
        if not _STATE.begin():
            return  # this thread's own install() or uninstall() is running
        recorder, applied, patched_here = _STATE.recorder, _STATE.applied, _STATE.patched_here
        if recorder is None:
            _STATE.end()
            return
        _STATE.recorder, _STATE.applied, _STATE.report = None, [], []
        _STATE.patched_here = False
    try:
        recorder.restore()
        if patched_here:  # undo only the patch install() made
            unpatch()
        _forget(applied)
    finally:
        with _STATE.changed:
            _STATE.end()


def _forget(applied: List[Override]) -> None:
    for override in reversed(applied):
        if override.undo is not None:
            override.undo()


def _replaced_attributes() -> List[Tuple[str, Any, str]]:
    """``(override name, owner, attribute)`` for every attribute the installed integration replaced (none if not
    installed), oldest first."""
    with _STATE.changed:
        recorder = _STATE.recorder
    if recorder is None:
        return []
    return [(record.by, record.owner, record.name) for record in recorder.records()]
