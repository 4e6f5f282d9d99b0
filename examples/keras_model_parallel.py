"""Keras ModelParallel on the torch backend: one process per device, no change to model code.

    GLOO_SOCKET_IFNAME=lo torchrun --nproc-per-node 2 --master-addr 127.0.0.1 examples/keras_model_parallel.py

With keras_dtensor_mixfix installed, `import keras` (KERAS_BACKEND=torch) is all it takes: the
package adds the torch backend of keras.distribution that Keras 3.15.1 lacks.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np
import torch.distributed as dist
from keras_dtensor_mixfix.layouts import sharding_report

keras.distribution.initialize()  # process group from torchrun's environment; every rank agrees on a seed
keras.utils.set_random_seed(0)  # the same on every rank, and the same run after run
devices = keras.distribution.list_devices()  # "cpu:0", "cpu:1": one device per process
mesh = keras.distribution.DeviceMesh((1, len(devices)), ["batch", "model"], devices)

layout_map = keras.distribution.LayoutMap(mesh)  # keys: path regexes (re.fullmatch; re.search before 3.15)
layout_map[".*hidden/kernel"] = (None, "model")  # column-wise
layout_map[".*hidden/bias"] = ("model",)
layout_map[".*head/kernel"] = ("model", None)  # row-wise
keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))

model = keras.Sequential([  # unchanged model code
    keras.Input((16,)),
    keras.layers.Dense(64, activation="relu", name="hidden"),
    keras.layers.Dense(3, name="head"),
])
model.compile(optimizer=keras.optimizers.Adam(0.01), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])

rng = np.random.default_rng(0)  # the same data on every rank: each keeps its slice of every batch
x = rng.normal(size=(256, 16)).astype("float32")
y = (x[:, :3].argmax(axis=1)).astype("int64")
history = model.fit(x, y, batch_size=32, epochs=3, verbose=0)

kernel = model.get_layer("hidden").kernel
accuracy = model.evaluate(x, y, verbose=0)[1]  # every rank takes part (it is collective)
report = sharding_report(model)  # what this rank holds of each variable (optimizer slots too); no collective
if dist.get_rank() == 0:
    print(f"hidden kernel {tuple(kernel.shape)} placements {tuple(kernel.value.placements)} "
          f"(local {tuple(kernel.value.to_local().shape)})")
    print("loss per epoch:", [round(v, 4) for v in history.history["loss"]])
    print("accuracy:", round(accuracy, 3))
    print(report)
