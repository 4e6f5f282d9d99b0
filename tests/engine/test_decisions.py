"""Decision(placements=...): checked when made (types) and when used (mesh and tensor); single process."""

from __future__ import annotations

import types

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import keras_dtensor_mixfix as mf
from keras_dtensor_mixfix import Decision
from keras_dtensor_mixfix._rules.decisions import Operand, check_decision


def _mesh(ndim: int):
    """What check_decision reads of a DeviceMesh (a real one needs a process group)."""
    ids = torch.arange(2 ** ndim).reshape((2,) * ndim)
    return types.SimpleNamespace(ndim=ndim, mesh=ids, device_type="cpu", mesh_dim_names=None)


def _operand(*shape: int) -> Operand:
    return Operand((1,), torch.ones(shape), True, False)


# --------------------------------------------------------------------------- at construction


@pytest.mark.parametrize("placements, error, needle", [
    ("S", TypeError, "must be a list or tuple of torch Placement objects"),
    ("Shard(0)", TypeError, "got str: 'Shard(0)'"),
    (Shard(0), TypeError, "got Shard"),
    ([], ValueError, "is empty"),
    (["replicate"], TypeError, "item 0 is str 'replicate'"),
    ([Shard], TypeError, "the class itself; write Shard(...)"),
    ([Replicate(), 0], TypeError, "item 1 is int"),
])
def test_placements_of_the_wrong_type_are_refused_when_the_decision_is_made(placements, error, needle):
    with pytest.raises(error, match="Decision\\(placements=...\\)") as info:
        Decision("local", placements=placements)
    assert needle in str(info.value)
    assert "Shard(0)" in str(info.value)  # says what to write


def test_valid_placements_are_kept_as_a_tuple():
    given = [Shard(0), Replicate()]
    decision = Decision("replicate", placements=given)
    given.append(Partial())  # the caller's list changing later does not change the decision
    assert decision.placements == (Shard(0), Replicate())
    assert Decision("local", placements=(Shard(1),), shape=torch.Size([4, 6])).shape == (4, 6)


@pytest.mark.parametrize("shape", ["84", 8, (8, -1), (8.0, 4), (True, 4)])
def test_a_shape_that_is_not_a_sequence_of_sizes_is_refused(shape):
    with pytest.raises(TypeError, match="Decision\\(shape=...\\)"):
        Decision("local", shape=shape)


# --------------------------------------------------------------------------- at use


def test_a_decision_without_placements_is_used_as_it_is():
    decision = Decision("replicate")
    assert check_decision(decision, "aten::mul.Tensor", _operand(4, 4), _mesh(1)) is decision
    fine = Decision("local", placements=[Shard(1), Replicate()])
    assert check_decision(fine, "aten::mul.Tensor", _operand(4, 4), _mesh(2)) is fine


@pytest.mark.parametrize("kind", ["replicate", "local"])
def test_one_placement_per_mesh_dim(kind):
    with pytest.raises(mf.MixedOperandError) as info:
        check_decision(Decision(kind, placements=[Shard(0), Shard(0)]), "aten::mul.Tensor", _operand(4, 4), _mesh(1))
    message = str(info.value)
    assert message.startswith("keras_dtensor_mixfix: cannot run aten::mul.Tensor")
    assert "has 2 placement(s) for the 1-D mesh DeviceMesh('cpu', [0, 1])" in message
    assert "plain operand args[1]: plain torch.Tensor shape (4, 4)" in message
    assert f"e.g. Decision('{kind}', placements=[Shard(dim=0)])" in message
    assert "[Shard(0)] * call.mesh.ndim" in message
    assert "register_rule" not in message  # the rule exists; it is the rule that is wrong
    with pytest.raises(mf.MixedOperandError, match=r"placements=\[Shard\(dim=0\), Replicate\(\)\]"):
        check_decision(Decision(kind, placements=[Shard(0)]), "aten::mul.Tensor", _operand(4, 4), _mesh(2))


@pytest.mark.parametrize("kind", ["replicate", "local"])
def test_shard_dims_must_be_dims_of_the_tensor(kind):
    with pytest.raises(mf.MixedOperandError) as info:
        check_decision(Decision(kind, placements=[Shard(7)]), "aten::mul.Tensor", _operand(4, 4), _mesh(1))
    assert "shards dim 7 (placement 0, mesh dim 0)" in str(info.value)
    assert "Shard a dim the tensor has: Shard(0) to Shard(1)." in str(info.value)
    with pytest.raises(mf.MixedOperandError, match="shards dim -3"):
        check_decision(Decision(kind, placements=[Shard(-3)]), "aten::mul.Tensor", _operand(4, 4), _mesh(1))


def test_negative_shard_dims_are_normalized_as_distribute_tensor_does():
    checked = check_decision(Decision("local", placements=[Replicate(), Shard(-1)]), "aten::mul.Tensor",
                             _operand(4, 4), _mesh(2))
    assert checked.placements == (Replicate(), Shard(1)) and checked.kind == "local"


def test_a_local_shape_with_other_dims_than_the_operand_is_refused():
    with pytest.raises(mf.MixedOperandError, match=r"gives shape=\(8,\) \(1 dims\) for a 2-D operand"):
        check_decision(Decision("local", placements=[Shard(0)], shape=(8,)), "aten::mul.Tensor", _operand(4, 4),
                       _mesh(1))
    # Shard dims are counted on the global shape
    with pytest.raises(mf.MixedOperandError, match="global tensor has 2 dim"):
        check_decision(Decision("local", placements=[Shard(2)], shape=(8, 4)), "aten::mul.Tensor", _operand(4, 4),
                       _mesh(1))


# --------------------------------------------------------------------------- in a mixed call (2 ranks)


def bad_placements_in_a_rule():
    from torch.distributed.tensor import distribute_tensor

    from keras_dtensor_mixfix.testing import mesh

    weight = distribute_tensor(torch.ones(4, 4), mesh(), [Shard(0)])
    found = {}
    cases = {"too_many": [Shard(0), Shard(0)], "no_such_dim": [Shard(7)], "negative": [Shard(-1)]}
    with mf.patched():
        for name, placements in cases.items():
            for kind in ("replicate", "local") if name != "negative" else ("replicate",):
                rule = mf.register_rule("aten::mul.Tensor",
                                        lambda call, k=kind, p=placements: Decision(k, placements=p))
                try:
                    result = weight * torch.ones(4, 4)
                    found[name, kind] = f"ok {tuple(result.placements)} {tuple(result.shape)}"
                except Exception as exc:  # noqa: BLE001 - the type and message are the result
                    found[name, kind] = f"{type(exc).__name__}: {exc}"
                finally:
                    rule.remove()
    return found


def test_a_rule_with_wrong_placements_gets_a_clear_error_in_the_mixed_call():
    from keras_dtensor_mixfix.testing import run_on_ranks

    found = run_on_ranks(bad_placements_in_a_rule, world_size=2)[0]
    for kind in ("replicate", "local"):
        assert found["too_many", kind].startswith(
            "MixedOperandError: keras_dtensor_mixfix: cannot run aten::mul.Tensor")
        assert "has 2 placement(s) for the 1-D mesh" in found["too_many", kind]
        assert "shards dim 7" in found["no_such_dim", kind], found["no_such_dim", kind]
    assert found["negative", "replicate"].startswith("ok "), found["negative", "replicate"]  # normalized to Shard(1)
