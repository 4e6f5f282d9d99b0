"""A job that loses a rank and restarts from its last complete backup: torchrun's restarts, Keras' BackupAndRestore.

    GLOO_SOCKET_IFNAME=lo torchrun --standalone --nproc-per-node 2 --max-restarts 3 \
        examples/keras_restart.py /tmp/my-job-backup

(several machines: ``--rdzv-backend c10d --rdzv-endpoint HOST:29400 --rdzv-id JOB --nnodes N`` on each)

`KILL_RANK_AT_EPOCH=2` makes rank 1 die (`os._exit`, as an out-of-memory kill would) after epoch 2 of the first
attempt: torchrun stops the other rank, starts both again, and fit resumes from the backup of the last complete
epoch. Under a distribution, the package writes each backup (its weights and `training_metadata.json`) as one unit,
so a rank killed at any point, even inside a backup, leaves the previous backup or the new one.
"""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np
import torch.distributed as dist

backup_dir = sys.argv[1] if len(sys.argv) > 1 else "/tmp/keras_restart_backup"
kill_at_epoch = int(os.environ.get("KILL_RANK_AT_EPOCH", "-1"))
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # torchrun counts the restarts

keras.distribution.initialize()  # process group from torchrun's environment; collectives time out after 10 minutes
keras.utils.set_random_seed(0)
devices = keras.distribution.list_devices()
mesh = keras.distribution.DeviceMesh((1, len(devices)), ["batch", "model"], devices)
layout_map = keras.distribution.LayoutMap(mesh)
layout_map[".*hidden/kernel"] = (None, "model")
layout_map[".*head/kernel"] = ("model", None)
keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))

model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu", name="hidden"),
                          keras.layers.Dense(3, name="head")])
model.compile(optimizer=keras.optimizers.Adam(0.01), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 16)).astype("float32")
y = (x[:, :3].argmax(axis=1)).astype("int64")


class LoseARank(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if attempt == 0 and epoch == kill_at_epoch and dist.get_rank() == 1:
            os._exit(9)


epochs_run = []
history = model.fit(x, y, batch_size=32, epochs=5, verbose=0, shuffle=False,
                    callbacks=[keras.callbacks.BackupAndRestore(backup_dir), LoseARank(),
                               keras.callbacks.LambdaCallback(
                                   on_epoch_begin=lambda epoch, logs: epochs_run.append(epoch))])
if dist.get_rank() == 0:
    print(f"attempt {attempt}: ran epochs {epochs_run}")
    print(f"final loss {history.history['loss'][-1]:.4f}")
