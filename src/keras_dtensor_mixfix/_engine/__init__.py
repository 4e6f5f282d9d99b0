"""The promotion engine: a mixed call's one entrance and the ways it goes from there (the call graph).

A path calls the modules listed under it, the general path its stages in this order; no stage calls a
later one (a later one may use an earlier one's helpers, as run.py builds results with construct.py's).

entry.py        the dispatch rules torch calls, the torch-first policy, and ``promote_call``: the one
                entrance of a mixed call. It looks up the op's state (opstate.py) and sends the call
                one of three ways:
  fast.py       the cache hit: a call the admission (``opstate.admit``) lets take a cached path, with one
                DTensor and one plain operand, replays what the stages decided for its shape (on the
                first call it asks placements.py and keeps the answer), then runs (run.py, direct.py);
  foreach.py    ``_foreach_*`` lists: their own cache hit (a direct plan, same admission), else the rows
                grouped by mesh, each group down general.py;
  general.py    every other call, stage by stage:
    operands.py    find the call's plain and DTensor operands (a ``MixedCall``); the one definition of
                   "a plain multi-element tensor" (``needs_promotion``), which the dispatch rules spell
                   out in their loops (held to it by tests/unit/engine/test_entry_rules.py);
    decide.py      ask the rule; one checked decision, mesh and peer per plain operand;
    devices.py     where each plain operand's piece must sit;
    placements.py  how each operand is laid out (its spec and slice from specs.py), cached for eager
                   operands it only reads (``layout_cacheable``);
    construct.py   build each promoted DTensor, and the call that carries them;
    run.py         run the op (corrections.py and attention_corrections.py: ops DTensor gets wrong after a
                   promotion, run as an exact reformulation; check.py: check mode); then the plain ``.grad``
                   hook (grad.py), stats (stats.py).

Beside them: meshes.py and whole.py (DTensors on several meshes, whole values), specs.py (slices and specs),
release_refusals.py (the rules of single-tensor views a release's DTensor cannot run: refused by name there).
State: context.py (the patch state the lifecycle writes), caches.py (everything remembered between calls,
cleared in one place, including each op's opstate.OpState: its admission and fast-path entries), stats.py
(the promotion counts, which outlive a cache clear and are reset by ``reset_stats``).
"""
