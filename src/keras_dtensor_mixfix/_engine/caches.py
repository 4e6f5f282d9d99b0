"""Everything the promotion path remembers between calls, in one object that one ``clear()`` resets.

Eager promotions reuse what an earlier call with the same layout already worked out (a slice, a
spec, a whole operand's layout, a local operand's reading, each op's state and fast-path entries,
the fast path's reading of the options). None of it may outlive the patch or the rules it was
worked out under: ``unpatch()`` and every rule change call ``CACHES.clear()``.

The stages bind the containers once at import (``_SLICES = CACHES.slices``) and read them as
module globals on the hot path; ``clear()`` therefore empties each container in place and never
replaces one. Only ``fast_options`` is replaced (an immutable value, swapped in one assignment, so a
reader always sees one consistent set of flags).
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

from torch.utils.weak import WeakIdKeyDictionary

from .._rules.decisions import REPLICATE

# Every cache is bounded: eager code with ever-changing shapes must not grow them forever.
CACHE_LIMIT = 4096


def remember(cache: Dict[Any, Any], key: Any, value: Any) -> None:
    """``cache[key] = value``, emptying ``cache`` first when it is full."""
    if len(cache) >= CACHE_LIMIT:
        cache.clear()
    cache[key] = value


class FastOptions:
    """What the fast paths read of the options in force, worked out once per options object.

    Options objects are immutable (``Options.updated`` makes a new one), so identity with
    ``options`` says whether these flags are still current.
    """

    __slots__ = ("options", "replicate_default", "allowed", "direct", "plain_grads")

    def __init__(self, options: Any) -> None:
        self.options = options
        if options is None:
            self.replicate_default = self.allowed = self.direct = self.plain_grads = False
            return
        default = options.default
        # The default rule is "replicate" given as a name (a callable may answer anything).
        self.replicate_default = type(default) is str and default == REPLICATE
        # Any option that adds per-operand work (e.g. a check mode) sends every call down the general path.
        self.allowed = getattr(options, "check", "off") == "off"
        # Direct plans (see direct.py) may replace the re-dispatch.
        self.direct = bool(getattr(options, "direct", True))
        self.plain_grads = bool(options.plain_grads)


NO_OPTIONS_SEEN = FastOptions(None)


class EngineCaches:
    """The promotion path's caches (see the module docstring)."""

    __slots__ = ("slices", "specs", "whole_layouts", "local_readings", "op_states", "same_ranks", "equal_meshes",
                 "fast_options")

    def __init__(self) -> None:
        # (global shape, mesh, placements) -> this rank's slice of a whole tensor (specs.local_slice).
        self.slices: Dict[Tuple[Any, ...], Any] = {}
        # (mesh, placements, shape, stride, dtype) -> DTensorSpec (specs.make_spec, eager only).
        self.specs: Dict[Tuple[Any, ...], Any] = {}
        # (elementwise, plain shape, stride, dtype, peer spec) -> WholeLayout (placements.cached_whole_layout).
        self.whole_layouts: Dict[Tuple[Any, ...], Any] = {}
        # tensor -> (mesh, placements, global shape) of its "local" reading (placements.local_layout); weak.
        self.local_readings: Any = WeakIdKeyDictionary()
        # id(op) -> OpState (opstate.op_state); each holds its fast-path entries and foreach plans.
        self.op_states: Dict[int, Any] = {}
        # (mesh, mesh) -> whether the two span the same ranks (meshes.same_ranks).
        self.same_ranks: Dict[Tuple[Any, Any], bool] = {}
        # (id(mesh), id(other)) -> (mesh, other), for two distinct mesh objects that are equal (torch makes a new
        # object per submesh lookup): the dispatch rule's identity test then lets their pure calls through
        # (entry.make_dispatch_rule). Holding the objects keeps their ids from being reused.
        self.equal_meshes: Dict[Tuple[int, int], Tuple[Any, Any]] = {}
        self.fast_options: FastOptions = NO_OPTIONS_SEEN

    def clear(self) -> None:
        """Forget everything remembered (called by ``unpatch()`` and on every rule change)."""
        self.slices.clear()
        self.specs.clear()
        self.whole_layouts.clear()
        self.local_readings.clear()
        self.op_states.clear()
        self.same_ranks.clear()
        self.equal_meshes.clear()
        self.fast_options = NO_OPTIONS_SEEN


CACHES = EngineCaches()
