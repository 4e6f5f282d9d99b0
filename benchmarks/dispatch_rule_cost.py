"""The dispatch rule's own cost on pure-DTensor calls: this checkout's rule beside the rule at a base revision.

The rule runs on every dispatch of a hooked op with a DTensor, pure calls included; this measures only the
rule (the function torch calls first), ns per call, on one process (a 1-rank gloo group), for a binary call,
a three-argument call and a foreach call over two lists of 100 DTensors; and, for this checkout only, the
end-to-end ``a * b`` of two DTensors on equal but distinct mesh objects (``mesh["tp"]`` twice), patched and not.

    python benchmarks/dispatch_rule_cost.py --base f23695a
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import timeit
import types

import torch
import torch.distributed as dist

log = logging.getLogger("dispatch_rule_cost")

RULE_MODULE = "src/keras_dtensor_mixfix/_engine/entry.py"


def rule_at(revision: str) -> types.ModuleType:
    """The engine's entry module as it was at ``revision``, loaded beside the current one."""
    source = subprocess.run(["git", "show", f"{revision}:{RULE_MODULE}"], check=True, capture_output=True,
                            text=True).stdout
    module = types.ModuleType("keras_dtensor_mixfix._engine.entry_at_base")
    module.__package__ = "keras_dtensor_mixfix._engine"
    exec(compile(source, f"{revision}:{RULE_MODULE}", "exec"), module.__dict__)  # our own file
    return module


def ns_per_call(rule, args, number: int) -> float:
    return min(timeit.repeat(lambda: rule(None, None, None, args, {}), number=number, repeat=7)) / number * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git revision whose rule to compare with")
    options = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29655")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import keras_dtensor_mixfix._engine.entry as current

    base = rule_at(options.base)
    mesh = init_device_mesh("cpu", (1,))
    a, b = (distribute_tensor(torch.randn(4), mesh, [Shard(0)]) for _ in range(2))
    rows = [distribute_tensor(torch.randn(2), mesh, [Shard(0)]) for _ in range(100)]
    never = lambda func, args, kwargs: None  # noqa: E731 - pure calls never reach the handlers
    rules = {options.base: base.make_dispatch_rule(never), "this checkout": current.make_dispatch_rule(never, never)}
    log.info("| call | %s |", " | ".join(rules))
    log.info("|---|%s", "---|" * len(rules))
    for name, args, number in [("a * b", (a, b), 200000), ("three DTensors", (a, b, a), 200000),
                               ("foreach, 2 lists of 100", (rows, rows), 20000)]:
        figures = " | ".join(f"{ns_per_call(rule, args, number):.0f} ns" for rule in rules.values())
        log.info("| %s | %s |", name, figures)
    # Two DTensors on equal but distinct mesh objects (torch makes one per submesh lookup): the rule must let the
    # call through as cheaply as for one object, after the first call.
    two_d = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    a = distribute_tensor(torch.randn(64), two_d["tp"], [Shard(0)])
    b = distribute_tensor(torch.randn(64), two_d["tp"], [Shard(0)])
    assert a.device_mesh is not b.device_mesh and a.device_mesh == b.device_mesh
    import keras_dtensor_mixfix as mf

    def per_call(fn) -> float:
        return min(timeit.repeat(fn, number=20000, repeat=7)) / 20000 * 1e6

    same = distribute_tensor(torch.randn(64), a.device_mesh, [Shard(0)])
    log.info("")
    for what, x, y in [("one mesh object", a, same), ("two objects of one mesh", a, b)]:
        unpatched = per_call(lambda: x * y)
        with mf.patched():
            patched = per_call(lambda: x * y)
        log.info("a * b, %s, end to end: %.1f us unpatched, %.1f us patched", what, unpatched, patched)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
