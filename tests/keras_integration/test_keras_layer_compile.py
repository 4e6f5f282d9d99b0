"""``jit_compile=True`` under a distribution compiles each distinct repeated block once
(``_keras/step/layer_compile.py``).

Which layers are interchangeable is decided from what Keras says of them (``_keras/step/block_groups.py``; tested in
one process, no ranks): identical blocks group; a block whose configuration, a sublayer's configuration, its
variables or, for a layer that cannot state a configuration, its plain attributes or functions differ does not; leaf
layers (a Dense alone) are not compiled on their own; names and initializer seeds do not count.

On real ranks, (1, 2) and (2, 2) meshes: a model of four identical tensor-parallel blocks (column- then row-split
Dense pairs) trains, evaluates and predicts with ``jit_compile=True`` to one process's values, compiling one graph
per step kind for all four blocks (nothing recompiles per block), and compiled again from the ranks' on-disk caches
(as a second launch) loads each rank's own entries, to the same values. Blocks that update a running statistic and
add a loss in a training call give one process's trained weights and losses; so does a model overriding
``compute_loss`` and compiled with a metric (the loss and the metrics run as compiled regions of their own). The
whole-step compile (``KERAS_DTENSOR_MIXFIX_COMPILE_UNIT=step``) on (1, 2) gives one process's values too
(``MIXFIX_TEST_SLOW=1``: by hand). A block that changes its own Python state in a call runs eagerly, with one
warning, and still gives one process's values; so does a block torch.compile refuses, the warning giving torch's
reason. Outside the steps (a direct call), the blocks run as Keras runs them; ``uninstall()`` gives every block
its class's ``call`` back.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from _keras_releases import OPS_TRACE_IN_ONE_GRAPH, compiles_whole
from keras_dtensor_mixfix.testing import run_on_ranks

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

BLOCKS = 4
WIDTH, HIDDEN = 8, 16


def _block_class():
    import keras

    @keras.saving.register_keras_serializable(package="mixfix_test")
    class Block(keras.layers.Layer):
        """A tensor-parallel MLP block: up (column-split) -> relu -> down (row-split), residual, layer norm."""

        def __init__(self, hidden=HIDDEN, scale=1.0, counting=False, stateful=False, **kwargs):
            super().__init__(**kwargs)
            self.hidden, self.scale, self.counting, self.stateful = hidden, scale, counting, stateful
            self.calls = 0
            self.up = keras.layers.Dense(hidden, activation="relu", name="up")
            self.down = keras.layers.Dense(WIDTH, name="down")
            self.norm = keras.layers.LayerNormalization(name="norm")
            if stateful:  # a non-trainable variable a training call updates, and a loss it adds
                self.statistics = keras.layers.Layer(name="statistics")

        def build(self, input_shape):
            self.up.build(input_shape)
            self.down.build(input_shape[:-1] + (self.hidden,))
            self.norm.build(input_shape)
            if self.stateful:
                self.running_mean = self.statistics.add_weight(shape=(self.hidden,), initializer="zeros",
                                                               trainable=False, name="running_mean")

        def call(self, x, training=None):
            if self.counting:
                self.calls += 1  # Python state: members cannot share one compiled call
            hidden = self.up(x)
            if self.stateful and training:
                self.running_mean.assign(0.9 * self.running_mean + 0.1 * keras.ops.mean(hidden, axis=0))
                self.add_loss(0.01 * keras.ops.mean(keras.ops.square(hidden)))
            if self.stateful:
                hidden = hidden - self.running_mean
            return self.norm(x + self.scale * self.down(hidden))

        def get_config(self):
            return dict(super().get_config(), hidden=self.hidden, scale=self.scale, counting=self.counting,
                        stateful=self.stateful)

    return Block


def _model(counting=False, blocks=BLOCKS, stateful=False, custom=False):
    """The blocks between an input and an output Dense; ``custom``: a model overriding ``compute_loss``."""
    import keras

    block = _block_class()
    inputs = keras.Input((WIDTH,))
    x = keras.layers.Dense(WIDTH, name="embed")(inputs)  # every block's input then needs a gradient alike
    for index in range(blocks):
        x = block(counting=counting, stateful=stateful, name=f"block_{index}")(x)
    model_class = _own_loss_model_class() if custom else keras.Model
    return model_class(inputs, keras.layers.Dense(2, name="head")(x))


def _own_loss_model_class():
    import keras

    class OwnLoss(keras.Model):
        """Keras' guide "Customizing what happens in fit()": the compiled loss plus a penalty on the predictions."""

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            loss = super().compute_loss(x, y, y_pred, sample_weight, training=training)
            return loss + 0.1 * keras.ops.mean(keras.ops.square(y_pred))

    return OwnLoss


def _compiled(jit_compile, counting=False, stateful=False, custom=False):
    """:func:`_model`, compiled with Adam and MSE (and an MAE metric for ``custom``)."""
    import keras

    model = _model(counting, stateful=stateful, custom=custom)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"] if custom else None,
                  jit_compile=jit_compile)
    return model


def _scalars(logs):
    """A step's or ``evaluate``'s loss, and its metrics when compiled with some, as a list of floats."""
    return np.asarray(logs, dtype=float).ravel().tolist()


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(8, WIDTH)).astype("float32"), rng.normal(size=(8, 2)).astype("float32")


# --------------------------------------------------------------------------- which layers group (one process)


def test_identical_blocks_group_and_leaf_layers_do_not():
    import keras

    from keras_dtensor_mixfix._keras.step import block_groups

    model = _model()
    groups = block_groups.repeated_groups(model)
    assert [[layer.name for layer in group] for group in groups] == [[f"block_{i}" for i in range(BLOCKS)]]
    inputs = keras.Input((WIDTH,))  # Dense layers of one shape, but leaves
    dense = keras.Model(inputs, keras.layers.Dense(WIDTH)(keras.layers.Dense(WIDTH)(inputs)))
    assert block_groups.repeated_groups(dense) == []


def test_blocks_group_by_what_keras_says_of_them():
    """Class, configuration (names and initializers aside), variables and layouts: what Keras' saving relies on."""
    import keras

    from keras_dtensor_mixfix._keras.step import block_groups

    block = _block_class()

    def built(**kwargs):
        layer = block(**kwargs)
        layer.build((None, WIDTH))
        return layer

    first = built()
    assert block_groups.difference(first, built()) is None  # other names, other initializer seeds
    seeded = built()
    seeded.up.kernel_initializer = keras.initializers.GlorotUniform(seed=3)  # used by build only
    assert block_groups.difference(first, seeded) is None
    assert "configuration 'scale' differs" in block_groups.difference(first, built(scale=2.0))
    assert "'hidden'" in block_groups.difference(first, built(hidden=HIDDEN * 2))
    with_activation = built()
    with_activation.up.activation = keras.activations.gelu  # a sublayer's configuration
    assert "Dense 'up': configuration 'activation' differs" in block_groups.difference(first, with_activation)
    frozen = built()
    frozen.up.trainable = False
    assert "Dense 'up': configuration 'trainable' differs" in block_groups.difference(first, frozen)
    wider = block()
    wider.build((None, 2 * WIDTH))  # one configuration, built for other inputs: other variable shapes
    assert "variable block" in block_groups.difference(first, wider) and "up/kernel" in block_groups.difference(
        first, wider)


    class Unsaid(block):  # a layer that cannot state its configuration (as keras_hub's internal sublayers)
        def get_config(self):
            raise NotImplementedError("no configuration")

    def unsaid(**kwargs):
        layer = Unsaid(**kwargs)
        layer.build((None, WIDTH))
        return layer

    # described by what get_config would hold: its plain attributes and the functions it holds
    assert block_groups.difference(unsaid(), unsaid()) is None
    assert "Unsaid 'unsaid" in block_groups.difference(unsaid(), unsaid(scale=2.0))
    assert "'scale' differs" in block_groups.difference(unsaid(), unsaid(scale=2.0))
    calls_gelu = unsaid()
    calls_gelu.activation = keras.activations.gelu
    other = unsaid()
    other.activation = keras.activations.relu
    assert "'activation' differs" in block_groups.difference(calls_gelu, other)


# --------------------------------------------------------------------------- compiled on ranks


def _distribution(mesh_shape):
    import keras

    from keras_dtensor_mixfix._keras.boundary import keras_modules

    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh(mesh_shape, ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*up/kernel"] = (None, "model")
    layout_map[".*up/bias"] = ("model",)
    layout_map[".*down/kernel"] = ("model", None)
    distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    if keras_modules.native_data_distribution():
        # Keras 3.16 takes NumPy inputs on several processes only so, and each process then feeds its own shard:
        # the same rows on every process here, so means and predictions are one process's
        distribution.auto_shard_dataset = False
    return distribution


def compiled_run(mesh_shape, unit, counting=False, refused=False, stateful=False, again=False, custom=False,
                 tracer=None):
    """On this rank: losses, evaluation, predictions and trained weights of 3 steps with ``jit_compile=True``
    under ``unit``; the graphs TorchDynamo made; the warnings; and a direct call's value (outside any step).
    ``refused``: torch.compile refuses the blocks (as TorchDynamo refuses code it cannot trace); ``"optimizer"``: it
    refuses the optimizer's update. ``stateful``: each block updates statistics and adds a loss in a training call.
    ``custom``: the model overrides ``compute_loss`` and is compiled with a metric. ``again``: then the same job
    compiled again from nothing in memory (``torch._dynamo.reset()``), as a second launch compiles, with the ranks'
    on-disk cache entries of the first (under ``"again"``: its values and cache hits). ``tracer``: the block tracer
    (``KERAS_DTENSOR_MIXFIX_BLOCK_TRACER``); with ``"aot"``, each group's signatures traced are under ``"traces"``."""
    import os

    import keras
    import torch
    from torch._dynamo.utils import counters

    from keras_dtensor_mixfix import keras_integration
    from keras_dtensor_mixfix._keras.step import layer_compile

    assert keras_integration.install()
    torch._dynamo.reset()
    counters.clear()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("keras_dtensor_mixfix").addHandler(handler)
    layer_compile.set_compile_unit(unit)
    group_init, method_init = layer_compile._Group.__init__, layer_compile._CompiledMethod.__init__

    def refusing(*args, **kwargs):
        raise torch._dynamo.exc.Unsupported("a refusal made by the test")

    if refused == "optimizer":
        def init_method(region, owner, name, label):
            method_init(region, owner, name, label)
            if name == "apply":
                region.compiled = refusing

        layer_compile._CompiledMethod.__init__ = init_method
    elif refused:
        def init(group, members):
            group_init(group, members)
            group.compiled = refusing

        layer_compile._Group.__init__ = init
    if tracer is not None:
        os.environ["KERAS_DTENSOR_MIXFIX_BLOCK_TRACER"] = tracer
    try:
        keras.distribution.set_distribution(_distribution(mesh_shape))
        keras.utils.set_random_seed(0)
        model = _compiled(True, counting, stateful, custom)
        x, y = _data()
        initial = model.get_weights()
        losses = [_scalars(model.train_on_batch(x, y)) for _ in range(3)]
        evaluated = _scalars(model.evaluate(x, y, verbose=0))
        predicted = model.predict(x, verbose=0)
        graphs = counters["stats"]["unique_graphs"]
        direct = keras.ops.convert_to_numpy(model(x))  # outside a step: Keras' own calls, nothing compiled
        result = {"initial": initial, "losses": losses, "evaluated": evaluated, "predicted": predicted,
                  "trained": model.get_weights(), "graphs": graphs,
                  "graphs_after_direct": counters["stats"]["unique_graphs"], "direct": direct,
                  "warnings": [r.getMessage() for r in records if r.levelno >= logging.WARNING],
                  "replaced_calls": sum("call" in vars(layer) for layer in model.layers),
                  "optimizer_compiled": "apply" in vars(model.optimizer),
                  "trainer_regions": sorted(set(layer_compile.TRAINER_REGIONS) & set(vars(model)))}
        result["traces"] = _traces(model)
        result["autograd_cache"] = dict(counters["aot_autograd"])
        result["graph_cache"] = _graph_cache_counts(counters)
        if again:
            torch._dynamo.reset()
            counters.clear()
            second = _compiled(True, counting, stateful, custom)
            second.set_weights(initial)
            result["again"] = {"losses": [_scalars(second.train_on_batch(x, y)) for _ in range(3)],
                               "evaluated": _scalars(second.evaluate(x, y, verbose=0)),
                               "predicted": second.predict(x, verbose=0), "trained": second.get_weights(),
                               "direct": keras.ops.convert_to_numpy(second(x)),
                               "autograd_cache": dict(counters["aot_autograd"]), "traces": _traces(second),
                               "graph_cache": _graph_cache_counts(counters)}
    finally:
        os.environ.pop("KERAS_DTENSOR_MIXFIX_BLOCK_TRACER", None)
        layer_compile._Group.__init__, layer_compile._CompiledMethod.__init__ = group_init, method_init
        layer_compile.set_compile_unit(None)
        logging.getLogger("keras_dtensor_mixfix").removeHandler(handler)
        keras.distribution.set_distribution(None)
        keras_integration.uninstall()
        keras.backend.clear_session()
    result["replaced_calls_after_uninstall"] = sum("call" in vars(layer) for layer in model.layers)
    result["optimizer_compiled_after_uninstall"] = "apply" in vars(model.optimizer)
    result["trainer_regions_after_uninstall"] = sorted(set(layer_compile.TRAINER_REGIONS) & set(vars(model)))
    return result


def _traces(model):
    """Each group's signatures traced by its block tracer (``None`` for a group traced by TorchDynamo)."""
    from keras_dtensor_mixfix._keras.step import layer_compile

    prepared = layer_compile._prepared.get(model)
    return [getattr(group.compiled, "traces", None) for group in (prepared.groups if prepared else [])]


def _graph_cache_counts(counters):
    """Inductor's FX graph cache: hits, misses, bypasses."""
    return {key: n for key, n in counters["inductor"].items() if key.startswith("fxgraph_cache")}


def _one_process(initial, counting=False, stateful=False, custom=False):
    import keras

    model = _compiled(False, counting, stateful, custom)
    model.set_weights(initial)
    x, y = _data()
    losses = [_scalars(model.train_on_batch(x, y)) for _ in range(3)]
    out = {"losses": losses, "evaluated": _scalars(model.evaluate(x, y, verbose=0)),
           "predicted": model.predict(x, verbose=0), "trained": model.get_weights(),
           "direct": keras.ops.convert_to_numpy(model(x))}
    keras.backend.clear_session()
    return out


# float32 (eps 1.2e-7), summed in another order on 2 or 4 ranks than in one process: each op's result may differ in
# its last bits, and 3 training steps, 4 blocks and LayerNorm's division by a small std compound those differences
# to ~1e-6 (seen: 1.19e-6) on values near zero, where a relative bound gives no room. ATOL, ~80 eps on values of
# order 1, bounds that with margin; what a wrong computation gives (a missing or doubled term, a wrong scale) is
# orders of magnitude larger.
RTOL, ATOL = 1e-5, 1e-5


def _assert_equal(got, want):
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=RTOL)
    np.testing.assert_allclose(got["evaluated"], want["evaluated"], rtol=RTOL)
    np.testing.assert_allclose(got["predicted"], want["predicted"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got["direct"], want["direct"], rtol=RTOL, atol=ATOL)
    for trained, reference in zip(got["trained"], want["trained"]):
        np.testing.assert_allclose(trained, reference, rtol=RTOL, atol=ATOL)


# On Keras 3.15 and later only: before 3.15 TorchDynamo breaks the graph at every Keras op (so a block is no one
# graph), and ranks compiling each small graph on 2 cores cost minutes; the Keras 3.16 environment runs both meshes
@pytest.mark.skipif(not OPS_TRACE_IN_ONE_GRAPH,
                    reason="Keras before 3.15 compiles op by op, so blocks cannot compile as one graph each (what "
                           "this test counts) and 4 ranks take minutes; this test runs on Keras 3.16")
@pytest.mark.parametrize("world_size, mesh_shape", [(2, (1, 2)), (4, (2, 2))], ids=["1x2", "2x2"])
def test_blocks_compile_once_and_equal_one_process(world_size, mesh_shape):
    """Also a second compile of the job from the ranks' on-disk caches (the rank workers' own directory), as a
    second launch compiles: every rank loads its own AOTAutograd entries (on (2, 2) ranks 1 and 3 once loaded ranks
    0 and 2's, whose collectives name groups they are not in) and gives the same values."""
    from keras_dtensor_mixfix._keras.boundary import keras_modules

    per_layer = run_on_ranks(compiled_run, mesh_shape, "layer", again=True, world_size=world_size, timeout=600)
    reference = _one_process(per_layer[0]["initial"])
    for rank, out in enumerate(per_layer):
        _assert_equal(out, reference)
        _assert_equal(out["again"], reference)
        # what the first compile put in the cache or found there (an earlier test in these rank workers may have
        # saved a graph this one loads): the second compile loads every one of them
        first = out["autograd_cache"]
        cached = first.get("autograd_cache_saved", 0) + first.get("autograd_cache_hit", 0)
        assert out["again"]["autograd_cache"].get("autograd_cache_hit", 0) == cached, (rank, first,
                                                                                      out["again"]["autograd_cache"])
        # Keras 3.12 to 3.15: every graph of the step is cached (the blocks' too: the partial-sum boundary is DTensor's
        # own traceable functions, no autograd Function) and inductor finds each compiled graph on disk (a DeviceMesh
        # input is keyed by its groups, not its per-process hash). Keras 3.16 (seen on 3.16.0.dev): graphs that
        # traced a promotion are left out by the compile-cache guard, so only the equality above holds there
        if not keras_modules.native_promotion_mode():
            assert out["again"]["autograd_cache"].get("autograd_cache_hit", 0) == per_layer[0]["graphs"], (rank, first)
            assert "autograd_cache_bypass" not in first, (rank, first)
            assert out["again"]["graph_cache"].get("fxgraph_cache_hit", 0) >= per_layer[0]["graphs"], (
                rank, out["again"]["graph_cache"])
            assert "fxgraph_cache_miss" not in out["again"]["graph_cache"], (rank, out["again"]["graph_cache"])
        assert not out["warnings"], (rank, out["warnings"])
    assert per_layer[0]["graphs_after_direct"] == per_layer[0]["graphs"]
    # one block graph for training, one for evaluate and predict (no gradient): not one per block; one for the
    # optimizer's update; the loss and the metrics, each once for training and once for evaluate
    assert per_layer[0]["graphs"] == 7, per_layer[0]["graphs"]
    assert per_layer[0]["replaced_calls"] == BLOCKS and per_layer[0]["replaced_calls_after_uninstall"] == 0
    assert per_layer[0]["optimizer_compiled"] and not per_layer[0]["optimizer_compiled_after_uninstall"]
    assert per_layer[0]["trainer_regions"] == ["compute_loss", "compute_metrics"]
    assert per_layer[0]["trainer_regions_after_uninstall"] == []


@pytest.mark.skipif(not OPS_TRACE_IN_ONE_GRAPH,
                    reason="compiling on 2 ranks takes minutes on Keras before 3.15 (its other regions compile op by "
                           "op); this test runs on Keras 3.15 and 3.16")
def test_blocks_traced_without_dynamo_equal_one_process_and_a_second_launch_compiles_nothing():
    """``KERAS_DTENSOR_MIXFIX_BLOCK_TRACER=aot``: the four blocks' group traces one signature for training and one for
    evaluate and predict (no gradient), values equal one process; the job compiled again from nothing in memory,
    as a second launch, traces again but compiles no graph of the blocks (inductor finds each on disk)."""
    from keras_dtensor_mixfix.testing import shutdown_workers

    shutdown_workers()  # fresh rank workers: see the next test
    per_rank = run_on_ranks(compiled_run, (1, 2), "layer", again=True, tracer="aot", world_size=2, timeout=600)
    reference = _one_process(per_rank[0]["initial"])
    for rank, out in enumerate(per_rank):
        _assert_equal(out, reference)
        _assert_equal(out["again"], reference)
        assert out["traces"] == [2] and out["again"]["traces"] == [2], (rank, out["traces"])
        assert "fxgraph_cache_miss" not in out["again"]["graph_cache"], (rank, out["again"]["graph_cache"])
        assert not out["warnings"], (rank, out["warnings"])


def traced_signatures(initial=None):
    """On this rank, under the block tracer: the losses of steps that change the input signature (a batch of 4 after
    batches of 8, then 8 again) and then the blocks' configuration (every block's ``scale``), and the signatures
    traced after each step. Given ``initial`` weights: one process, eager, from them (the losses alone)."""
    import os

    import keras

    from keras_dtensor_mixfix import keras_integration
    from keras_dtensor_mixfix._keras.step import layer_compile

    distributed = initial is None
    if distributed:
        assert keras_integration.install()
    os.environ["KERAS_DTENSOR_MIXFIX_BLOCK_TRACER"] = "aot"
    try:
        if distributed:
            keras.distribution.set_distribution(_distribution((1, 2)))
        keras.utils.set_random_seed(0)
        model = _compiled(distributed)
        if not distributed:
            model.set_weights(initial)
        start = model.get_weights()
        x, y = _data()
        losses, traces = [], []

        def step(rows):
            losses.append(_scalars(model.train_on_batch(x[:rows], y[:rows])))
            if distributed:
                traces.append(layer_compile._prepared[model].groups[0].compiled.traces)

        step(8)
        step(8)
        step(4)
        step(8)
        for layer in model.layers:
            if hasattr(layer, "scale"):
                layer.scale = 2.0
        step(8)
        step(8)
        return {"initial": start, "losses": losses, "traces": traces}
    finally:
        os.environ.pop("KERAS_DTENSOR_MIXFIX_BLOCK_TRACER", None)
        if distributed:
            keras.distribution.set_distribution(None)
            keras_integration.uninstall()
        keras.backend.clear_session()


@pytest.mark.skipif(not OPS_TRACE_IN_ONE_GRAPH,
                    reason="compiling on 2 ranks takes minutes on Keras before 3.15 (its other regions compile op by "
                           "op); this test runs on Keras 3.15 and 3.16")
def test_the_block_tracer_traces_each_new_signature_once_and_a_changed_configuration_again():
    """A new batch size traces one more signature, a size seen before none; every block's ``scale`` changed traces
    again, and the losses follow the new configuration as one process's do (no graph of the old one served)."""
    from keras_dtensor_mixfix.testing import shutdown_workers

    # fresh rank workers: on Keras 3.16, after an earlier distribution in the same workers, a batch may arrive on
    # that distribution's mesh (other process groups: another signature, rightly traced again)
    shutdown_workers()
    per_rank = run_on_ranks(traced_signatures, world_size=2, timeout=600)
    reference = traced_signatures(per_rank[0]["initial"])
    for rank, out in enumerate(per_rank):
        np.testing.assert_allclose(out["losses"], reference["losses"], rtol=RTOL)
        assert out["traces"] == [1, 1, 2, 2, 3, 3], (rank, out["traces"])


@pytest.mark.skipif(not OPS_TRACE_IN_ONE_GRAPH,
                    reason="Keras before 3.15 compiles op by op, so blocks cannot compile as one graph each (what "
                           "this test counts); this test runs on Keras 3.15 and 3.16")
def test_blocks_that_update_statistics_and_add_losses_equal_one_process():
    """What a member's call updates (a running mean, as a normalization keeps) reaches the member's own variables, and
    the losses it adds are the member's: trained weights (statistics included) and losses equal one process."""
    per_rank = run_on_ranks(compiled_run, (1, 2), "layer", False, False, True, world_size=2, timeout=600)
    reference = _one_process(per_rank[0]["initial"], stateful=True)
    for rank, out in enumerate(per_rank):
        _assert_equal(out, reference)
        assert not out["warnings"], (rank, out["warnings"])
    # (no count of graphs here: on Keras 3.16, after another test's distribution in the same rank workers, the block
    # recompiles once for an input on another, equal DeviceMesh object; the first test above counts them)


# The whole-step unit (KERAS_DTENSOR_MIXFIX_COMPILE_UNIT=step, an opt-in) compiles the train, test and predict steps
# whole: about 100 s more per Keras environment on 2 cores, so it runs by hand (CONTRIBUTING.md, "Tests")
@pytest.mark.slow(reason="compiles whole steps (about 100 s on 2 cores)")
def test_the_whole_step_unit_equals_one_process():
    whole_step = run_on_ranks(compiled_run, (1, 2), "step", world_size=2, timeout=600)
    reference = _one_process(whole_step[0]["initial"])
    for out in whole_step:
        _assert_equal(out, reference)
    assert whole_step[0]["graphs"] >= 3, whole_step[0]["graphs"]  # train, test and predict steps


@compiles_whole
def test_an_overridden_compute_loss_and_a_metric_compile_as_regions_and_equal_one_process():
    """Keras' guide "Customizing what happens in fit()": a model overriding ``compute_loss``, compiled with a metric.
    The loss and metrics regions trace the override and the metric's update (no warning: nothing fell back to
    eager); losses, the metric, evaluation and trained weights equal one process, whose loss has the penalty too."""
    per_rank = run_on_ranks(compiled_run, (1, 2), "layer", custom=True, world_size=2, timeout=600)
    reference = _one_process(per_rank[0]["initial"], custom=True)
    for rank, out in enumerate(per_rank):
        _assert_equal(out, reference)
        assert len(out["losses"][0]) == 2, out["losses"]  # the loss and the metric
        assert not out["warnings"], (rank, out["warnings"])
        assert out["trainer_regions"] == ["compute_loss", "compute_metrics"]


# The three tests below run the per-block compile with a block or the update refused (the same code on every Keras).
# Before Keras 3.15 TorchDynamo breaks the graph at every Keras op, and compiling op by op costs minutes on 2 cores:
# they run on 3.15 and later (CI: the keras_hub environment, Keras 3.15.1)
@compiles_whole
def test_a_block_with_python_state_runs_eagerly_and_says_so():
    per_rank = run_on_ranks(compiled_run, (1, 2), "layer", True, world_size=2, timeout=600)
    reference = _one_process(per_rank[0]["initial"], counting=True)
    for out in per_rank:
        _assert_equal(out, reference)
        assert len(out["warnings"]) == 1 and "runs block_0 (and 3 more like it) eagerly" in out["warnings"][0]
        assert "'calls'" in out["warnings"][0] or "calls" in out["warnings"][0], out["warnings"]


@compiles_whole
def test_a_block_torch_cannot_compile_runs_eagerly_and_says_why():
    per_rank = run_on_ranks(compiled_run, (1, 2), "layer", False, True, world_size=2, timeout=600)
    reference = _one_process(per_rank[0]["initial"])
    for out in per_rank:
        _assert_equal(out, reference)
        assert len(out["warnings"]) == 1, out["warnings"]
        assert "runs block_0 (and 3 more like it) eagerly: torch.compile failed: Unsupported" in out["warnings"][0]
        assert "a refusal made by the test" in out["warnings"][0]


@compiles_whole
def test_an_optimizer_update_torch_cannot_compile_runs_eagerly_and_says_why():
    per_rank = run_on_ranks(compiled_run, (1, 2), "layer", False, "optimizer", world_size=2, timeout=600)
    reference = _one_process(per_rank[0]["initial"])
    for out in per_rank:
        _assert_equal(out, reference)
        assert len(out["warnings"]) == 1, out["warnings"]
        assert "runs the optimizer adam's update eagerly: torch.compile failed: Unsupported" in out["warnings"][0]
