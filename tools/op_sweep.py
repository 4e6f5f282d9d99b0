#!/usr/bin/env python
"""Sweep torch's OpInfo database for ops that mix a DTensor with plain tensors.

    python tools/op_sweep.py [--ops NAME ...] [--max-samples N] [--report OP_SWEEP.md]
                             [--shard-dims all|even|first-even] [--extra all|key|none]

For every OpInfo (``torch.testing._internal.common_methods_invocations.op_db``) and up to
``--max-samples`` of its ``sample_inputs("cpu", torch.float32)`` with two or more tensor operands
(float32 / int64 / bool, none empty), and the sweep's own samples (``opsweep.extra``: the keywords
that change a loss's reduction - ``reduction``, ``weight``, ``pos_weight``, ``ignore_index`` hit by the
targets, ``label_smoothing`` - at batch 4 and batch 3, and scatter/index ops, masked reductions, norms
and contractions with the dim they reduce over of size 4), every case makes ONE tensor operand a
DTensor on a 2-rank gloo mesh (``Replicate()``, and ``Shard(d)`` on every dim of size >= 2 in turn,
uneven shards included; ``--shard-dims even`` keeps dims of even size, ``first-even`` the first of
them, for OpInfo's samples), leaves the other operands plain and runs ``op.op`` (and
``op.inplace_variant`` where there is one) under ``keras_dtensor_mixfix.patched()``. The result (outputs, and every
operand after the call, so in-place writes are checked) is compared with the all-plain computation. Each case is

* ``correct``     - same values (``assert_close``, OpInfo float32 tolerance or rtol=1.3e-6/atol=1e-5,
                    ``equal_nan=True``), same on both ranks;
* ``clear_error`` - ``MixedOperandError``, or a RuntimeError/NotImplementedError from DTensor that
                    says the op has no sharding strategy / is unsupported;
* ``wrong``       - no error but values (or structure, or the two ranks) differ;
* ``crash``       - any other exception, a worker that died or hung.

Per sample it also records whether DTensor itself supports the op (every tensor operand a
``Replicate`` DTensor, no patch) and whether torch accepted the mixed call unpatched (no promotion
needed); every case that is not correct is rerun unpatched with the other operands made Replicate
DTensors by hand ("DTensor alone"), which tells torch's faults from the patch's.

Differential "unchanged" check (``opsweep.differential``): every call torch makes without the patch
- every tensor operand a DTensor (all ``Replicate``, and each case's ``Shard(d)`` with the others
``Replicate``), the mixed calls torch accepted unpatched, and every mixed call under DTensor's
``implicit_replication()`` - is run unpatched and patched from identical inputs; the outcomes must be
identical (outputs and operands after the call bit for bit, shapes, dtypes, DTensor placements, or the
same exception). Each check is ``same`` or ``differs`` (``unstable`` when two unpatched runs differ).

Samples come from rank 0 (broadcast: some ``sample_inputs`` iterate sets, whose order differs between
processes). Random ops are skipped by name and by what they dispatch (ops tagged
``nondeterministic_seeded``). Each chunk of ops is one ``run_on_ranks`` call; a chunk that fails or
hangs (``--chunk-timeout``) is rerun op by op (``--op-timeout``) so the one op is recorded as a crash.
``--json`` saves the records, ``--from-json`` rewrites the report from them without sweeping again.
The functions are importable (``tests/engine/test_op_sweep.py`` runs a CI subset with them): they live in the
package ``tools/opsweep`` (sampling, extra, values, classify, differential, runner, report), re-exported here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional, Sequence

# The sweep's package sits beside this file; the rank workers are spawned with this sys.path, so
# they import the same modules to run its functions.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from opsweep.classify import CLASSES, attribution, classify_exception, summarize
from opsweep.common import DEFAULT_MAX_SAMPLES, describe_sample, describe_value
from opsweep.differential import DIFF_CLASSES, summarize_diffs
from opsweep.report import now_utc, pct, write_report
from opsweep.runner import run_sweep, sweep_ops
from opsweep.extra import EXTRA_MODES
from opsweep.sampling import SHARD_MODES, is_random_name, op_infos, opinfo_tolerance, select_ops

__all__ = ["CLASSES", "DEFAULT_MAX_SAMPLES", "DIFF_CLASSES", "attribution", "classify_exception", "describe_sample",
           "describe_value", "is_random_name", "main", "op_infos", "opinfo_tolerance", "run_sweep", "select_ops",
           "summarize", "summarize_diffs", "sweep_ops", "write_report"]


def _print_differential(records: Sequence[dict]) -> None:
    d = summarize_diffs(records)
    print(f"differential checks {d['checked']}: " + ", ".join(f"{c} {d['counts'][c]}" for c in DIFF_CLASSES))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", nargs="+", help="OpInfo names (name or name.variant); default: all")
    parser.add_argument("--max-samples", type=int, default=DEFAULT_MAX_SAMPLES)
    parser.add_argument("--report", default="OP_SWEEP.md")
    parser.add_argument("--chunk-size", type=int, default=50, help="ops per run_on_ranks call")
    parser.add_argument("--chunk-timeout", type=float, default=900.0, help="seconds for one chunk")
    parser.add_argument("--op-timeout", type=float, default=300.0,
                        help="seconds for one op when a chunk is rerun op by op")
    parser.add_argument("--json", help="also write every record (and the run's command, date, time) to this JSON file")
    parser.add_argument("--from-json", help="do not sweep: write the report from records saved with --json")
    parser.add_argument("--shard-dims", choices=SHARD_MODES, default="all",
                        help="dims of OpInfo's samples sharded in turn: every dim of size >= 2, uneven shards included "
                             "(default: about 3 min on 2 cores); every dim of even size (about 2 min); only the first "
                             "dim of even size (the sweep before reduced dims were swept)")
    parser.add_argument("--extra", choices=EXTRA_MODES, default="all",
                        help="the sweep's own samples (tools/opsweep/extra.py: reduction keywords, reduced/indexed "
                             "dims of size 4, batch 3): all (default), key (the CI subset's), none")
    args = parser.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as handle:
            saved = json.load(handle)
        meta = saved["meta"]
        s = write_report(saved["records"], args.report, meta["command"], meta["random_ops"], meta["max_samples"],
                         meta["elapsed"], meta["date"], note=f"report written from the saved records on {now_utc()}",
                         shard_dims=meta.get("shard_dims", "first-even"), extra=meta.get("extra", "none"))
        print(f"cases {s['cases']}: " + ", ".join(f"{c} {s['counts'][c]}" for c in CLASSES))
        _print_differential(saved["records"])
        return 0
    # Unpatched runs must be unpatched: no auto-activation here or in the rank workers (they
    # inherit the environment); sweep_ops also unpatches a process it finds patched.
    os.environ["KERAS_DTENSOR_MIXFIX"] = "0"
    command = "python tools/op_sweep.py " + " ".join(sys.argv[1:] if argv is None else argv)
    started, date = time.monotonic(), now_utc()
    names, random_ops = select_ops(args.ops)
    print(f"{len(names)} ops to sweep ({len(random_ops)} random ops skipped)", flush=True)
    records = run_sweep(names, args.max_samples, args.chunk_size, args.chunk_timeout, args.op_timeout,
                        log=lambda m: print(m, flush=True), shard_dims=args.shard_dims, extra=args.extra)
    elapsed = time.monotonic() - started
    if args.json:
        meta = {"command": command.strip(), "date": date, "elapsed": elapsed, "random_ops": random_ops,
                "max_samples": args.max_samples, "shard_dims": args.shard_dims, "extra": args.extra}
        with open(args.json, "w") as handle:
            json.dump({"meta": meta, "records": records}, handle, indent=0)
    s = write_report(records, args.report, command.strip(), random_ops, args.max_samples, elapsed, date,
                     shard_dims=args.shard_dims, extra=args.extra)
    print(f"cases {s['cases']}: " + ", ".join(f"{c} {s['counts'][c]}" for c in CLASSES))
    _print_differential(records)
    print(f"correct among DTensor-supported cases: {pct(s['supported_cases_correct'], s['supported_cases'])}; "
          f"report written to {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
