"""The pure parts of the memory work: the rule the whole-weight warning proposes, and the array stand-ins."""

from __future__ import annotations

import types

import numpy as np
import pytest

from keras_dtensor_mixfix._keras.files.array_proxy import ArrayProxy
from keras_dtensor_mixfix._keras.layout_maps.whole_weights import _sharding_rule


def _distribution(shape, names=("batch", "model"), batch="batch"):
    return types.SimpleNamespace(device_mesh=types.SimpleNamespace(shape=shape, axis_names=list(names)),
                                 batch_dim_name=batch)


@pytest.mark.parametrize("mesh_shape, weight_shape, rule", [
    ((1, 2), (1024, 32000), (None, "model")),   # the larger dim the model axis divides
    ((2, 4), (4096, 1026), ("model", None)),    # 1026 is not divisible by 4
    ((1, 8), (6, 10), None),                    # nothing divides: no rule to propose
    ((4, 1), (64, 64), None),                   # only the batch axis has ranks
    ((1, 2), (512, 512), (None, "model")),      # a tie: the last dim, as keras_hub's column-wise maps
])
def test_the_proposed_rule_shards_the_largest_dim_the_model_axis_divides(mesh_shape, weight_shape, rule):
    assert _sharding_rule(_distribution(mesh_shape), weight_shape) == rule


def test_the_proposed_rule_uses_the_largest_axis_but_the_batch_one():
    distribution = _distribution((2, 2, 4), names=("batch", "seq", "model"))
    assert _sharding_rule(distribution, (8, 8)) == (None, "model")


class _Counted(ArrayProxy):
    def __init__(self, values):
        self.values, self.reads = values, 0

    @property
    def shape(self):
        return self.values.shape

    def whole_array(self):
        self.reads += 1
        return self.values


def test_an_array_proxy_reads_only_when_used_as_an_array():
    proxy = _Counted(np.arange(6.0).reshape(2, 3))
    assert proxy.shape == (2, 3) and len(proxy) == 2 and proxy.reads == 0
    np.testing.assert_array_equal(np.asarray(proxy), proxy.values)
    np.testing.assert_array_equal(proxy + 1, proxy.values + 1)
    np.testing.assert_array_equal(2 * proxy, 2 * proxy.values)
    np.testing.assert_array_equal(np.asarray(proxy, dtype="float32"), proxy.values.astype("float32"))
    assert proxy.sum() == 15.0 and proxy[1, 2] == 5.0 and proxy.reads == 6
    assert float(_Counted(np.array(2.5))) == 2.5 and int(_Counted(np.array(3))) == 3
    with pytest.raises(AttributeError):
        proxy._missing  # private names are not forwarded (copy and pickle probe them)
