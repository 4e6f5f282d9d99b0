"""A plain Keras program behaves identically with the package active and with it off.

The package's promise to everyone who never distributes anything: installing it changes nothing. Yet with
``KERAS_BACKEND=torch`` every ``import keras`` installs the Keras integration, which replaces Keras internals
(``Layer.__call__``, the trainer's step factories, ``convert_to_numpy``, ``take``, the reductions, one_hot,
attention, sparse cross-entropy, ``cast``, the saving functions, variables) and patches torch's dispatch. Each
program below therefore runs twice, in fresh subprocesses that differ only in ``KERAS_DTENSOR_MIXFIX`` (1: the
package active; 0: auto-activation and so the integration off), and the two runs must agree byte for byte: stdout
(the results, every float as exact hex and every array as a hash of its bytes), stderr (an extra warning is a bug
too) and the exit code.

So that the comparison cannot pass vacuously, each run also reports, through a file (stdout stays comparable),
what auto-activation did, read after the program: the active run must have the integration installed and torch
patched, the reference run neither. On a Keras release the package does not support the integration stays off
with one warning line naming the package; that run must still print the same results, and its stderr may differ
by exactly that line.
"""

from __future__ import annotations

import pytest
from _differential import run_with_package_on_and_off, text_diff

pytest.importorskip("keras", reason="Keras is not importable here (pip install keras): these tests run Keras programs")

PROLOGUE = r'''
import atexit, hashlib, json, os, sys

import numpy as np


def _report_activation():
    # After the program, so that the program itself runs exactly as a user's would.
    import keras_dtensor_mixfix
    from keras_dtensor_mixfix import _autoload

    with open(os.environ["MIXFIX_TEST_STATE_FILE"], "w") as f:
        json.dump({"keras_state": _autoload.keras_state, "patched": keras_dtensor_mixfix.is_patched()}, f)


atexit.register(_report_activation)

import keras
from keras import layers, ops

print("keras", keras.__version__, keras.backend.backend())
keras.utils.set_random_seed(1234)
rng = np.random.default_rng(0)


def show(name, value):
    """Each array's dtype, shape, the hash of its bytes and its first values as exact hex floats."""
    for i, item in enumerate(value if isinstance(value, (list, tuple)) else [value]):
        a = np.ascontiguousarray(ops.convert_to_numpy(item))
        head = [float(v).hex() for v in a.ravel()[:3]]
        print(f"{name}[{i}] {a.dtype} {a.shape} {hashlib.sha256(a.tobytes()).hexdigest()[:20]} {head}")


def hexes(values):
    return [float(v).hex() for v in values]


def show_logs(name, logs):
    print(name, {key: float(value).hex() for key, value in sorted((logs or {}).items())})


def show_history(name, history):
    for key in sorted(history.history):
        print(name, key, hexes(history.history[key]))


class EpochLog(keras.callbacks.Callback):
    """What a callback sees: the run's parameters, then each epoch's logs and learning rate."""

    def on_train_begin(self, logs=None):
        print("callback train_begin", self.params.get("epochs"), self.params.get("steps"))

    def on_epoch_end(self, epoch, logs=None):
        rate = float(ops.convert_to_numpy(self.model.optimizer.learning_rate)).hex()
        show_logs(f"callback epoch {epoch} lr={rate}", logs)

'''

EPILOGUE = '''
print("done")
'''

DENSE_MLP = r'''
x = rng.normal(size=(64, 8)).astype("float32")
y = (x[:, 0] + x[:, 1] > 0).astype("int64") + (x[:, 2] > 1).astype("int64")  # three classes
model = keras.Sequential([
    keras.Input((8,)),
    layers.Dense(16, activation="relu"),
    layers.BatchNormalization(),
    layers.Dropout(0.25),
    layers.Dense(16, activation="gelu"),
    layers.LayerNormalization(),
    layers.Dense(3),
], name="mlp")
model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05, momentum=0.9, nesterov=True),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["sparse_categorical_accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=2)])
show("initial", model.get_weights())
history = model.fit(x, y, batch_size=16, epochs=2, validation_split=0.25, verbose=0,
                    callbacks=[EpochLog(), keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate * 0.5)])
show_history("history", history)
show("trained", model.get_weights())
show_logs("evaluate", model.evaluate(x, y, batch_size=32, verbose=0, return_dict=True))
show("predict", model.predict(x, batch_size=32, verbose=0))
print("train_on_batch", hexes(model.train_on_batch(x[:16], y[:16])))
print("test_on_batch", hexes(model.test_on_batch(x[:16], y[:16])))
show("predict_on_batch", model.predict_on_batch(x[:8]))
show("call training", model(x[:8], training=True))
weights = model.get_weights()
model.set_weights([w * 0.5 for w in weights])
show("halved", model.predict(x[:8], verbose=0))
model.set_weights(weights)
show("restored", model.predict(x[:8], verbose=0))

# functional: two named inputs, two outputs with their own losses, metrics and sample weights
a = keras.Input((8,), name="a")
b = keras.Input((4,), name="b")
h = layers.Concatenate()([layers.Dense(8, activation="tanh")(a), layers.Dense(8, activation="sigmoid")(b)])
h = layers.Dense(12, activation="swish", kernel_regularizer=keras.regularizers.L2(1e-3))(h)
functional = keras.Model({"a": a, "b": b}, {"cls": layers.Dense(3, activation="softmax", name="cls")(h),
                                            "reg": layers.Dense(1, name="reg")(h)})
functional.compile(optimizer=keras.optimizers.Adam(learning_rate=1e-2),
                   loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"}, loss_weights={"cls": 1.0, "reg": 0.5},
                   metrics={"cls": ["accuracy"], "reg": ["mae"]})
inputs = {"a": x, "b": rng.normal(size=(64, 4)).astype("float32")}
targets = {"cls": y, "reg": x[:, :1] * 2.0}
sample_weight = {"cls": np.linspace(0.5, 1.5, 64).astype("float32"), "reg": np.ones(64, "float32")}
history = functional.fit(inputs, targets, sample_weight=sample_weight, batch_size=16, epochs=2, verbose=0,
                         validation_data=(inputs, targets), callbacks=[
                             keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, restore_best_weights=True)])
show_history("functional history", history)
show_logs("functional evaluate", functional.evaluate(inputs, targets, verbose=0, return_dict=True))
show("functional predict", [value for _, value in sorted(functional.predict(inputs, verbose=0).items())])
functional.summary()

# The other inputs the trainer adapts: a PyDataset, a generator, a torch DataLoader; and class weights.
class Batches(keras.utils.PyDataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return x[index * 16:(index + 1) * 16], y[index * 16:(index + 1) * 16]


def batches(with_labels=True):
    for index in range(4):
        rows = slice(index * 16, (index + 1) * 16)
        yield (x[rows], y[rows]) if with_labels else (x[rows],)


import torch

loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y)),
                                     batch_size=16)
show_history("pydataset", model.fit(Batches(), epochs=1, verbose=0))
show_history("generator", model.fit(batches(), epochs=1, shuffle=False, verbose=0))
show_history("dataloader", model.fit(loader, epochs=1, shuffle=False, verbose=0))
show_history("class_weight", model.fit(x, y, batch_size=16, epochs=1, verbose=0, class_weight={0: 1.0, 1: 2.0, 2: 0.5}))
show_logs("evaluate dataloader", model.evaluate(loader, verbose=0, return_dict=True))
show("predict generator", model.predict(batches(with_labels=False), verbose=0))
try:  # a user's mistake inside a layer call: the same exception, the same message
    model.predict(np.zeros((4, 5), "float32"), verbose=0)
except ValueError as exc:
    print("error", type(exc).__name__, exc)
'''

CONV = r'''
images = rng.normal(size=(32, 12, 12, 3)).astype("float32")
series = rng.normal(size=(32, 16, 2)).astype("float32")
onehot = keras.utils.to_categorical(rng.integers(0, 4, size=(32,)), 4)
image_in = keras.Input((12, 12, 3), name="image")
series_in = keras.Input((16, 2), name="series")
h = layers.Conv2D(6, 3, padding="same", activation="relu")(image_in)
h = layers.BatchNormalization()(h)
h = layers.MaxPooling2D()(h)
h = layers.DepthwiseConv2D(3, padding="same")(h)
h = layers.SeparableConv2D(8, 3, strides=2, padding="same", activation="elu")(h)
h = layers.Conv2DTranspose(4, 2, strides=2)(h)
h = layers.AveragePooling2D(pool_size=2)(h)
h = layers.UpSampling2D(2)(layers.ZeroPadding2D(1)(h))
image_features = layers.Concatenate()([layers.GlobalMaxPooling2D()(h), layers.GlobalAveragePooling2D()(h)])
s = layers.Conv1D(6, 3, padding="causal", activation="relu")(series_in)
s = layers.MaxPooling1D(2)(s)
s = layers.Conv1D(6, 3, dilation_rate=2, padding="same")(s)
s = layers.SpatialDropout1D(0.2)(s)
s = layers.Flatten()(layers.AveragePooling1D(2)(s))
h = layers.Dropout(0.3)(layers.Concatenate()([image_features, s]))
model = keras.Model([image_in, series_in], layers.Dense(4, activation="softmax")(h), name="conv")
model.compile(optimizer=keras.optimizers.RMSprop(learning_rate=1e-2, momentum=0.5, centered=True),
              loss="categorical_crossentropy",
              metrics=["categorical_accuracy", keras.metrics.AUC(num_thresholds=20), keras.metrics.Precision(),
                       keras.metrics.TopKCategoricalAccuracy(k=2)])
history = model.fit([images, series], onehot, batch_size=8, epochs=2, verbose=0,
                    validation_data=([images[:16], series[:16]], onehot[:16]),
                    callbacks=[EpochLog(), keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0,
                                                                             min_delta=10.0)])
show_history("history", history)
show("trained", model.get_weights())
show_logs("evaluate", model.evaluate([images, series], onehot, verbose=0, return_dict=True))
show("predict", model.predict([images, series], batch_size=16, verbose=0))
print("train_on_batch", hexes(model.train_on_batch([images[:8], series[:8]], onehot[:8])))
show("after train_on_batch", model.get_weights())
'''

SEQUENCE = r'''
vocab, steps = 20, 10
tokens = rng.integers(1, vocab, size=(32, steps))
tokens[:, 7:] = 0  # padding, masked from the embedding on
target = (tokens[:, 0] + tokens[:, 1]) % 5
tokens_in = keras.Input((steps,), dtype="int32")
h = layers.Embedding(vocab, 8, mask_zero=True)(tokens_in)
h = layers.LSTM(8, return_sequences=True)(h)
h = layers.GRU(8, return_sequences=True, dropout=0.1)(h)
h = layers.Bidirectional(layers.SimpleRNN(4, return_sequences=True))(h)
attended = layers.MultiHeadAttention(num_heads=2, key_dim=4, dropout=0.1)(h, h, use_causal_mask=True)
h = layers.LayerNormalization()(layers.Add()([h, attended]))
h = layers.EinsumDense("btd,de->bte", output_shape=(None, 6), bias_axes="e", activation="relu")(h)
model = keras.Model(tokens_in, layers.Dense(5)(layers.GlobalAveragePooling1D()(h)), name="sequence")
model.compile(optimizer=keras.optimizers.AdamW(learning_rate=5e-3, weight_decay=0.01),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
history = model.fit(tokens, target, batch_size=8, epochs=2, validation_split=0.25, verbose=0, callbacks=[EpochLog()])
show_history("history", history)
show("trained", model.get_weights())
show_logs("evaluate", model.evaluate(tokens, target, verbose=0, return_dict=True))
show("predict", model.predict(tokens, verbose=0))
print("train_on_batch", hexes(model.train_on_batch(tokens[:8], target[:8])))
show("after train_on_batch", model.predict_on_batch(tokens[:8]))

# The backend functions the integration replaces, called directly on plain tensors.
t = ops.convert_to_tensor(rng.normal(size=(2, 3, 4)).astype("float32"))
ids = ops.convert_to_tensor(np.array([[0, 2], [1, 1]], "int32"))
show("take", [ops.take(t, ids, axis=1), ops.take(ops.reshape(t, (6, 4)), ids, axis=0), ops.take(t, ids)])
show("reductions", [ops.max(t, axis=1), ops.min(t), ops.amax(t, axis=(0, 2)), ops.amin(t, axis=-1, keepdims=True),
                    ops.all(t > -3.0), ops.any(t > 2.0, axis=0), ops.argmax(t, axis=-1), ops.argmin(t)])
show("slice_update", ops.slice_update(t, (0, 1, 1), ops.ones((1, 2, 2))))
show("one_hot", [ops.one_hot(ids, 3), ops.one_hot(ids, 4, axis=0)])
logits = ops.convert_to_tensor(rng.normal(size=(4, 5)).astype("float32"))
labels = ops.convert_to_tensor(np.array([0, 4, 2, 1]))
show("crossentropy", [ops.sparse_categorical_crossentropy(labels, logits, from_logits=True),
                      ops.sparse_categorical_crossentropy(labels, ops.softmax(logits)),
                      ops.categorical_crossentropy(ops.one_hot(labels, 5), logits, from_logits=True)])
show("cast", [ops.cast(t, "float16"), ops.cast(np.arange(3), "float32"), ops.cast(t, "int32")])
show("einsum", ops.einsum("abc,cd->abd", t, ops.ones((4, 2))))
q = ops.convert_to_tensor(rng.normal(size=(2, 5, 2, 4)).astype("float32"))
show("attention", [ops.dot_product_attention(q, q, q), ops.dot_product_attention(q, q, q, is_causal=True)])
'''

OPTIMIZERS = r'''
x = rng.normal(size=(32, 6)).astype("float32")
y = np.tanh(x @ rng.normal(size=(6, 2))).astype("float32")
schedule = lambda: keras.optimizers.schedules.CosineDecay(0.0, decay_steps=8, warmup_target=0.1, warmup_steps=3)
optimizers = [
    ("sgd_momentum", lambda: keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)),
    ("adam_amsgrad_clipnorm", lambda: keras.optimizers.Adam(learning_rate=1e-2, amsgrad=True, clipnorm=0.5)),
    ("adamw", lambda: keras.optimizers.AdamW(learning_rate=1e-2, weight_decay=0.05)),
    ("rmsprop_global_clipnorm", lambda: keras.optimizers.RMSprop(learning_rate=1e-2, global_clipnorm=1.0)),
    ("adafactor", lambda: keras.optimizers.Adafactor(learning_rate=1e-2)),
    ("lion_clipvalue", lambda: keras.optimizers.Lion(learning_rate=1e-3, clipvalue=0.1)),
    ("nadam_ema", lambda: keras.optimizers.Nadam(learning_rate=1e-2, use_ema=True, ema_overwrite_frequency=3)),
    ("adamax", lambda: keras.optimizers.Adamax(learning_rate=1e-2)),
    ("adagrad", lambda: keras.optimizers.Adagrad(learning_rate=1e-1)),
    ("adadelta", lambda: keras.optimizers.Adadelta(learning_rate=1.0)),
    ("ftrl", lambda: keras.optimizers.Ftrl(learning_rate=1e-1, l1_regularization_strength=1e-3)),
    ("adam_accumulating", lambda: keras.optimizers.Adam(learning_rate=1e-2, gradient_accumulation_steps=2)),
    ("sgd_cosine_schedule", lambda: keras.optimizers.SGD(learning_rate=schedule())),
    ("loss_scale_sgd", lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=0.05),
                                                                    initial_scale=2.0 ** 8, dynamic_growth_steps=2)),
]
for name, make in optimizers:
    keras.utils.set_random_seed(7)  # every optimizer starts from the same weights
    model = keras.Sequential([keras.Input((6,)), layers.Dense(8, activation="relu"), layers.Dense(2)])
    optimizer = make()
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae", keras.metrics.RootMeanSquaredError()])
    show_history(name, model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False))
    show(f"{name} weights", model.get_weights())
    show(f"{name} slots", list(optimizer.variables))

# Mixed precision: the layers compute in bfloat16 and cast (one of the functions the integration replaces).
keras.mixed_precision.set_global_policy("mixed_bfloat16")
keras.utils.set_random_seed(7)
model = keras.Sequential([keras.Input((6,)), layers.Dense(8, activation="relu"), layers.LayerNormalization(),
                          layers.Dense(2, dtype="float32")])
model.compile(optimizer=keras.optimizers.Adam(learning_rate=1e-2), loss="mse")
show_history("mixed_bfloat16", model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False))
show("mixed_bfloat16 weights", model.get_weights())
show("mixed_bfloat16 predict", model.predict(x[:8], verbose=0))
keras.mixed_precision.set_global_policy("float32")
'''

SAVE_LOAD = r'''
@keras.saving.register_keras_serializable(package="plain")
class Scale(layers.Layer):
    """A custom layer with its own weight and config: saved and loaded by its registered name."""

    def __init__(self, init=1.5, **kwargs):
        super().__init__(**kwargs)
        self.init = init

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer=keras.initializers.Constant(self.init))

    def call(self, inputs):
        return inputs * self.scale

    def get_config(self):
        return {**super().get_config(), "init": self.init}


def build():
    inputs = keras.Input((6,))
    h = layers.BatchNormalization()(layers.Dense(10, activation="relu")(inputs))
    return keras.Model(inputs, layers.Dense(2)(Scale(name="scale")(h)), name="saved")


x = rng.normal(size=(32, 6)).astype("float32")
y = rng.normal(size=(32, 2)).astype("float32")
model = build()
model.compile(optimizer=keras.optimizers.Adam(learning_rate=1e-2), loss="mse", metrics=["mae"])
history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, validation_split=0.25, callbacks=[
    keras.callbacks.ModelCheckpoint("best.keras", monitor="val_loss", save_best_only=True),
    keras.callbacks.ModelCheckpoint("epoch{epoch}.weights.h5", save_weights_only=True),
    keras.callbacks.CSVLogger("log.csv"),
])
show_history("history", history)
with open("log.csv") as f:
    print("csv header", f.readline().strip())  # its values are the history's, printed exactly above
before = model.predict(x, verbose=0)
show("predict", before)

model.save("model.keras")
loaded = keras.models.load_model("model.keras")
after = loaded.predict(x, verbose=0)
show("loaded predict", after)
print("loaded equal", np.array_equal(before, after), [w.path for w in loaded.weights])
show("loaded optimizer", list(loaded.optimizer.variables))
# Both continue from the same state: the loaded optimizer's slots were restored too.
print("original continues", hexes(model.train_on_batch(x[:8], y[:8])))
print("loaded continues", hexes(loaded.train_on_batch(x[:8], y[:8])))
show("original after", model.get_weights())
show("loaded after", loaded.get_weights())

model.save_weights("model.weights.h5")
fresh = build()
fresh.load_weights("model.weights.h5")
show("fresh predict", fresh.predict(x, verbose=0))
fresh.load_weights("epoch1.weights.h5")
show("epoch1 predict", fresh.predict(x, verbose=0))
show("best predict", keras.models.load_model("best.keras").predict(x, verbose=0))
clone = keras.models.clone_model(model)
clone.set_weights(model.get_weights())
show("clone call", clone(x[:4]))
from_json = keras.models.model_from_json(model.to_json())
from_json.set_weights(model.get_weights())
show("json predict", from_json.predict(x[:4], verbose=0))
keras.saving.save_model(loaded, "again.keras")
show("again predict", keras.saving.load_model("again.keras").predict(x[:4], verbose=0))
print("files", sorted(os.listdir(".")))
'''

UNCAUGHT_ERROR = r'''
# A user's mistake left uncaught: the traceback on stderr is what the user reads, and the exit code is 1.
model = keras.Sequential([keras.Input((8,)), layers.Dense(4), layers.Dense(2)])
print("built", [w.shape for w in model.weights])
sys.stdout.flush()
model.predict(np.zeros((4, 5), "float32"), verbose=0)
'''

PROGRAMS = {
    "dense_mlp": DENSE_MLP,
    "conv": CONV,
    "sequence": SEQUENCE,
    "optimizers": OPTIMIZERS,
    "save_load": SAVE_LOAD,
    "uncaught_error": UNCAUGHT_ERROR,
}

EXIT_CODES = {"uncaught_error": 1}
"""Programs that end in an exception; every other one exits 0 in the reference run."""

# Differences this test found, by program: where the integration is installed the program's test is a strict
# xfail (so that fixing the bug fails the test until its entry goes).
KNOWN_DIFFERENCES: dict = {}
"""program -> the bug that makes it differ (a strict xfail where the integration is installed); none today. The
uncaught error's traceback gained the wrappers' frames until Keras' filter was told to hide them
(``_keras/step/tracebacks.py``)."""


def _package_lines(stderr: str) -> list:
    """The lines of ``stderr`` naming the package (the unsupported-Keras warning is one)."""
    return [line for line in stderr.splitlines() if "keras_dtensor_mixfix" in line]


@pytest.mark.parametrize("program", list(PROGRAMS))
def test_plain_program_runs_identically_with_the_package_active_and_off(program, tmp_path, request):
    script = tmp_path / f"{program}.py"
    script.write_text(PROLOGUE + PROGRAMS[program] + EPILOGUE)
    runs = run_with_package_on_and_off(script, tmp_path, KERAS_BACKEND="torch")
    (reference, off_state), (active, on_state) = runs["0"], runs["1"]

    # The reference run is a working program (or fails where it means to), so an equal pair proves something.
    want_exit = EXIT_CODES.get(program, 0)
    assert reference.returncode == want_exit, (
        f"the program itself fails with the package off (exit {reference.returncode}):\n{reference.stderr[-3000:]}")
    assert want_exit or reference.stdout.endswith("done\n"), reference.stdout[-2000:]
    assert off_state is not None and off_state["keras_state"] != "installed" and not off_state["patched"], off_state
    assert on_state is not None, f"the active run reported nothing (exit {active.returncode}):\n{active.stderr[-3000:]}"
    active_stderr = active.stderr
    if on_state["keras_state"].startswith("off:"):
        # A Keras release the package does not support: not installed, with one warning line saying why.
        assert _package_lines(active.stderr) and not _package_lines(reference.stderr), (on_state, active.stderr)
        lines = active.stderr.splitlines(keepends=True)
        lines.remove(next(line for line in lines if "keras_dtensor_mixfix" in line))
        active_stderr = "".join(lines)
    else:
        assert on_state == {"keras_state": "installed", "patched": True}, on_state
        if program in KNOWN_DIFFERENCES:  # a bug of the integration: only where it is installed
            request.applymarker(pytest.mark.xfail(strict=True, raises=AssertionError,
                                                  reason=KNOWN_DIFFERENCES[program]))

    assert active.stdout == reference.stdout, "stdout differs:\n" + text_diff(program, reference.stdout, active.stdout)
    assert active_stderr == reference.stderr, "stderr differs:\n" + text_diff(program, reference.stderr, active_stderr)
    assert active.returncode == reference.returncode
