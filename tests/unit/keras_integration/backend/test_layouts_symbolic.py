"""``layouts.is_symbolic``: the tensors a layout is not applied to (meta, and fake ones of a trace, as the torch
boundary's ``is_traced`` tells them), and the ones it is."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from keras_dtensor_mixfix._keras.backend.layouts import is_symbolic


def test_meta_and_fake_tensors_are_symbolic_plain_tensors_and_parameters_are_not():
    with FakeTensorMode():
        fake = torch.empty(3)
    assert is_symbolic(fake)
    assert is_symbolic(torch.empty(3, device="meta"))
    assert not is_symbolic(torch.empty(3))
    assert not is_symbolic(torch.nn.Parameter(torch.ones(2)))
