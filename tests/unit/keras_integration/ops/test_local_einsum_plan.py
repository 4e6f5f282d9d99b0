"""Which einsums run on local pieces, with what result and gradient placements (no process group)."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

from keras_dtensor_mixfix._keras.ops.local_einsum import gradient_placements, line_up, parse, plan

R, P = Replicate(), Partial("sum")


@pytest.mark.parametrize("subscripts, count, expected", [
    ("btd,dnh->btnh", 2, (["btd", "dnh"], "btnh")),
    ("ij,jk", 2, (["ij", "jk"], "ik")),            # implicit output: labels seen once, sorted
    (" ab , bc -> ac ", 2, (["ab", "bc"], "ac")),
    ("...d,df->...f", 2, None),                     # ellipsis: left to DTensor
    ("ii->i", 1, None),                             # repeated label (diagonal)
    ("ab,bc->ac", 1, None),                         # operand count mismatch
])
def test_parse(subscripts, count, expected):
    assert parse(subscripts, count) == expected


CASES = [
    # (inputs, output, shapes, placements per operand) -> result placements
    (["btd", "dnh"], "btnh", [(8, 4, 6), (6, 2, 3)], [(R,), (Shard(1),)], (Shard(2),)),        # column-sharded
    (["btnh", "nhd"], "btd", [(8, 4, 2, 3), (2, 3, 6)], [(Shard(2),), (Shard(0),)], (P,)),      # row-sharded
    (["bqnh", "bknh"], "bnqk", [(8, 4, 2, 3)] * 2, [(Shard(2),), (Shard(2),)], (Shard(1),)),    # attention
    (["bd", "df"], "bf", [(8, 6), (6, 4)], [(P,), (R,)], (P,)),                                   # linear in a partial
    (["bd", "df"], "bf", [(8, 6), (6, 4)], [(R, Shard(0)), (Shard(1), R)], (Shard(1), Shard(0))),  # 2-D mesh
    (["bd", "df"], "bf", [(8, 6), (6, 4)], [(R,), (R,)], (R,)),
]


@pytest.mark.parametrize("inputs, output, shapes, placements, expected", CASES)
def test_plan_lines_up(inputs, output, shapes, placements, expected):
    assert plan(inputs, output, shapes, placements) == expected


@pytest.mark.parametrize("inputs, output, shapes, placements", [
    (["bd", "df"], "bf", [(8, 6), (6, 4)], [(Shard(1),), (R,)]),              # contracted label sharded on one side
    (["bd", "df"], "bf", [(8, 6), (6, 4)], [(Shard(0),), (Shard(1),)]),        # two different labels on one mesh dim
    (["bd", "df"], "bf", [(8, 6), (6, 4)], [(P,), (P,)]),                      # product of two partial sums
    (["bd", "df"], "bf", [(8, 6), (6, 4)], [(Partial("max"),), (R,)]),          # not a sum
    (["bd", "df"], "bf", [(8, 6), (6, 4)], [(Shard(0), Shard(0)), (R, R)]),     # one label on two mesh dims
    (["bd", "bf"], "bdf", [(1, 6), (8, 4)], [(Shard(0),), (Shard(0),)]),       # sharded label broadcast from size 1
    (["bd", "df"], "bf", [(8, 6), (6, 4)], [(P,), (Shard(1),)]),               # partial meets a shard
])
def test_plan_refuses_what_needs_communication(inputs, output, shapes, placements):
    assert plan(inputs, output, shapes, placements) is None


def test_plan_refuses_placements_it_does_not_know():
    from torch.distributed.tensor.placement_types import _StridedShard as Strided  # private, on 2.13-2.15

    assert plan(["bd", "df"], "bf", [(8, 6), (6, 4)], [(Strided(0, split_factor=2),), (R,)]) is None


@pytest.mark.parametrize("operand, result, expected", [
    ((R,), (Shard(2),), (P,)),          # whole operand, split work: each rank's gradient is a partial sum
    ((R,), (P,), (P,)),
    ((R,), (R,), (R,)),
    ((Shard(1),), (Shard(2),), (Shard(1),)),
    ((P,), (P,), (R,)),                 # linear in a partial sum: the gradient is whole
    ((R, Shard(0)), (Shard(1), Shard(0)), (P, Shard(0))),
])
def test_gradient_placements(operand, result, expected):
    assert gradient_placements(operand, result) == expected


LINE_UP = [
    # (inputs, output, placements per operand) -> placements to line up to (None: nothing to line up)
    # keras_hub on (batch, model): activations' rows over "batch", the kernel's input dim over "batch" too
    (["btd", "ndh"], "btnh", [(Shard(0), R), (Shard(1), Shard(0))], [(Shard(0), R), (R, Shard(0))]),
    # the kernel first: the operand whose split label the output keeps is the one that keeps its split
    (["ndh", "btd"], "btnh", [(Shard(1), R), (Shard(0), R)], [(R, R), (Shard(0), R)]),
    # an operand with the kept label but whole there takes its own slice of it
    (["bd", "bd", "df"], "bf", [(Shard(0),), (R,), (Shard(0),)], [(Shard(0),), (Shard(0),), (R,)]),
    (["bd", "df"], "bf", [(Shard(0),), (R,)], None),            # already lined up
    (["bd", "df"], "bf", [(Shard(1),), (Shard(0),)], None),     # one label per mesh dim: nothing to do
    (["bd", "df"], "bf", [(Shard(1),), (Shard(1),)], [(R,), (Shard(1),)]),  # f survives, d is gathered
    (["bd", "df"], "bf", [(P,), (Shard(0),)], None),            # partial sums: left to DTensor
]


@pytest.mark.parametrize("inputs, output, placements, expected", LINE_UP)
def test_line_up_keeps_the_split_the_output_keeps(inputs, output, placements, expected):
    assert line_up(inputs, output, placements) == expected


def test_line_up_refuses_when_no_split_label_survives():
    # both split along contracted labels on one mesh dim: no split to keep
    assert line_up(["bcd", "cde"], "be", [(Shard(1),), (Shard(1),)]) is None  # c and d, both contracted


def test_lined_up_operands_plan_to_local_pieces():
    inputs, output, shapes = ["btd", "ndh"], "btnh", [(4, 3, 8), (2, 8, 4)]
    lined = line_up(inputs, output, [(Shard(0), R), (Shard(1), Shard(0))])
    assert plan(inputs, output, shapes, lined) == (Shard(0), Shard(2))
    # the gathered kernel's gradient is a partial sum over the batch pieces, reduced back to its split
    assert gradient_placements(lined[1], (Shard(0), Shard(2))) == (P, Shard(0))
