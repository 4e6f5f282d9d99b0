"""The plain-grad hook (``_engine/grad.py``) is ours on a user's tensor: attached once while patched, taken off,
with its mark, by ``unpatch()``."""

from __future__ import annotations

import gc

import torch

import keras_dtensor_mixfix as mf
from keras_dtensor_mixfix._engine import grad
from keras_dtensor_mixfix._rules.decisions import REPLICATE

OP = "aten::mul.Tensor"


def _hooks(tensor: torch.Tensor) -> int:
    return len(tensor._backward_hooks or {})


def test_unpatch_takes_the_hook_and_its_mark_off():
    mf.patch()
    tensor = torch.ones(3, requires_grad=True)
    grad.ensure_plain_grad(tensor, REPLICATE, (), OP)
    grad.ensure_plain_grad(tensor, REPLICATE, (), OP)  # once per tensor
    assert isinstance(getattr(tensor, grad._ATTR), grad.PlainGradHook) and _hooks(tensor) == 1
    mf.unpatch()
    assert not hasattr(tensor, grad._ATTR) and _hooks(tensor) == 0
    (tensor * 2).sum().backward()  # the tensor is as it was: a plain grad, no hook of ours left to run
    assert torch.equal(tensor.grad, torch.full((3,), 2.0))


def test_a_later_patch_hooks_the_tensor_afresh():
    mf.patch()
    tensor = torch.ones(3, requires_grad=True)
    grad.ensure_plain_grad(tensor, REPLICATE, (), OP)
    mf.unpatch()
    mf.patch()
    grad.ensure_plain_grad(tensor, "local", (), OP)  # no "already promoted as replicate" from the earlier patch
    assert getattr(tensor, grad._ATTR).kind == "local" and _hooks(tensor) == 1
    mf.unpatch()
    assert not hasattr(tensor, grad._ATTR) and _hooks(tensor) == 0


def test_hooked_tensors_are_not_kept_alive():
    mf.patch()
    tensor = torch.ones(3, requires_grad=True)
    grad.ensure_plain_grad(tensor, REPLICATE, (), OP)
    del tensor
    gc.collect()
    assert grad.remove_plain_grad_hooks() == 0  # the dead tensor's entry went with it
    mf.unpatch()


def test_a_hook_of_someone_else_stays():
    mf.patch()
    tensor = torch.ones(3, requires_grad=True)
    seen = []
    tensor.register_hook(lambda g: seen.append(g) or g)
    grad.ensure_plain_grad(tensor, REPLICATE, (), OP)
    mf.unpatch()
    assert _hooks(tensor) == 1
    (tensor * 2).sum().backward()
    assert len(seen) == 1
