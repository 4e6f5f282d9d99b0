"""The promotion engine: a mixed call goes down these stages, one module each, in this order.

1. entry.py       the dispatch rules torch calls, the torch-first policy, and ``promote_call``,
                  which sends the call down fast.py (its common case, cached), foreach.py (row by
                  row) or general.py (everything else); each path runs the stages below.
2. operands.py    find the call's plain and DTensor operands (a ``MixedCall``).
3. decide.py      ask the rule; one checked decision, mesh and peer per plain operand.
4. placements.py  how each operand is laid out (devices.py first: where its piece must sit).
5. construct.py   build each promoted DTensor, and the call that carries them.
6. run.py         run the op; then the plain ``.grad`` hook (grad.py), stats (stats.py).

Beside them: direct.py (plans that skip the re-dispatch), corrections.py (ops DTensor gets wrong after a
promotion, run as an exact reformulation), check.py (check mode), opstate.py (per-op
state), caches.py (everything remembered between calls, cleared in one place), context.py (the patch
state the engine reads).
"""
