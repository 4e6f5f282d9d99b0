"""A sharded Keras train step on torch, beside one process and beside JAX, and where its time goes.

    python benchmarks/keras_model_step.py                  # both models, every variant (~4 min)
    python benchmarks/keras_model_step.py --models mlp --no-breakdown
    python benchmarks/keras_model_step.py --models gemma --mesh 2x2   # 4 ranks, batch split over 2
    python benchmarks/keras_model_step.py --size compute --models gemma,llama3   # issue 21's P10 size
    python benchmarks/keras_model_step.py --size compute --models llama3,llama3-tp --variants one-cores,eager,jax

Models (random, fixed data, Keras' default ``jit_compile`` unless a row says otherwise):

- ``gemma`` and ``llama3``: keras_hub ``GemmaCausalLM`` / ``Llama3CausalLM``, Adam, sharded by the
  backbone's own ``get_layout_map`` (needs keras_hub: ``pip install --no-deps keras-hub==0.32.0
  tokenizers sentencepiece`` and ``pip install regex kagglehub``), at ``--size``

  - ``tiny`` (default): vocabulary 1000, 2 layers, hidden 64, 4 heads of 16 (Llama3: 2 key/value
    heads), ``intermediate_dim`` 128, 8 sequences of 32 tokens: the step is dispatch-bound;
  - ``compute``: vocabulary 8000, 4 layers, hidden 512, 8 heads of 64 (8 key/value heads),
    ``intermediate_dim`` 2048 (Gemma's gated feed-forward halves it: two 1024-wide kernels),
    8 sequences of 128 tokens: the step is compute-bound (issue 21, P10);
- ``llama3-tp``: Llama3 under keras_hub's map with the two rules of ``TENSOR_PARALLEL_RULES``: the
  query/key/value kernels split by heads, the untied output projection by vocabulary (docs/keras.md,
  "Speed");
- ``mlp``: 2 blocks of Dense 256→1024 (relu, column-sharded) → Dense 1024→256 (row-sharded) →
  LayerNorm, AdamW, batch 64, as one flat ``Sequential`` (no repeated block: ``jit_compile`` compiles the whole step);
- ``blocks``: the same layers as 2 instances of one residual block layer (LayerNorm → Dense 256→1024 → Dense
  1024→256, added to its input): ``jit_compile`` compiles the block once.

Variants, each in fresh processes: torch in one process (eager, ``jit_compile=True``); torch on N
gloo ranks under ``ModelParallel`` on a ("batch", "model") mesh with this package (eager,
``jit_compile=True`` as the package compiles it by default, each distinct repeated block once, and the optimizer's
update, the loss and the metrics each as a region, ``jit``; the same with the update left eager, ``jit-eager-update``,
or the loss and the metrics, ``jit-eager-loss`` (neither run by default); and the whole
step compiled, ``jit-step``; ``--mesh``, default 1x2: N = 2); JAX on N virtual CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=N``, the same mesh and layout map; skipped when
jax is not installed); and warm starts, ``jit-warm`` and ``jax-warm``: the ``jit`` and ``jax`` rows launched twice
on one on-disk compile cache (inductor's and AOTAutograd's, ``TORCHINDUCTOR_CACHE_DIR``; JAX's persistent compilation
cache, ``JAX_COMPILATION_CACHE_DIR``), the second launch timed. Every torch process runs one intra-op thread, except
the row "1 process, eager, 2 threads": one process using the cores the N ranks use (``torch.set_num_threads(N)``),
the reference of P10.
Figures: the first step (tracing and compiling included) and the median of steps 3–11; on N ranks a
step ends when the slower rank ends. The breakdown profiles 5 more eager steps on rank 0 with
cProfile (its shares, scaled to the unprofiled step time) and counts one step's collectives, their
bytes and the wall time spent in them (issue to completion, waiting for the other ranks included)
with a dispatch mode; the ranks also time one all-reduce of 64 bytes, the least a collective costs them.

Targets printed (issue 31): P11, tiny Gemma, eager on 2 ranks ÷ one process eager ≤ 1.5; P10, compute size,
the 2-rank step ÷ one process on the same cores ≤ 1.15 and ÷ JAX ≤ 1.0; P12, compute size, the first
compiled step on the ranks ÷ JAX's first step ≤ 3; P8, tiny Gemma, ÷ JAX ≤ 2; P9, compiled ÷
eager on the ranks ≤ 0.4.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

os.environ.setdefault("KERAS_BACKEND", "torch")
os.environ["KERAS_DTENSOR_MIXFIX"] = "0"  # the benchmark installs what it measures explicitly

STEPS = int(os.environ.get("MIXFIX_BENCH_STEPS", "12"))
"""Steps per variant (``--steps``); the first two are left out of the median."""
MESH = tuple(int(n) for n in os.environ.get("MIXFIX_BENCH_MESH", "1x2").split("x"))
"""The ("batch", "model") mesh of the distributed variants (``--mesh`` sets it for every worker)."""
RANKS = MESH[0] * MESH[1]
SIZE = os.environ.get("MIXFIX_BENCH_SIZE", "tiny")
SIZES = {
    "tiny": dict(config=dict(vocabulary_size=1000, num_layers=2, num_query_heads=4, num_key_value_heads=4,
                             hidden_dim=64, intermediate_dim=128, head_dim=16), batch=8, length=32),
    "compute": dict(config=dict(vocabulary_size=8000, num_layers=4, num_query_heads=8, num_key_value_heads=8,
                                hidden_dim=512, intermediate_dim=2048, head_dim=64), batch=8, length=128),
}
HUB_MODELS = {  # name: (backbone, causal LM, config changes); Llama3 takes no head_dim (hidden / heads)
    "gemma": ("GemmaBackbone", "GemmaCausalLM", {}),
    "llama3": ("Llama3Backbone", "Llama3CausalLM", {"head_dim": None}),
    "llama3-tp": ("Llama3Backbone", "Llama3CausalLM", {"head_dim": None}),
}
TENSOR_PARALLEL_RULES = {  # llama3-tp: keras_hub's Llama map with these rules replacing or added to its own
    # the query/key/value kernels (hidden, heads, head_dim) split by heads, as tensor parallelism splits them
    # (keras_hub's map splits their hidden, input dim: each step re-splits them, docs/keras.md)
    "transformer_layer.*self_attention.*(query|key|value).kernel": ("batch", "model", None),
    # the untied output projection (hidden, vocabulary) split by vocabulary (keras_hub's map leaves it whole)
    "token_embedding/reverse_embeddings": ("batch", "model"),
}
P8_TARGET, P9_TARGET = 2.0, 0.4  # issue 31 (issue 21 had 4 and 0.6): tiny Gemma compiled ÷ JAX; jit_compile ÷ eager
P10_JAX_TARGET, P10_ONE_PROCESS_TARGET = 1.0, 1.15  # issue 31's P10 (issue 21's was 0.9 against JAX)
P11_TARGET = 1.5  # issue 31: tiny Gemma, eager on the ranks ÷ one process eager
P12_TARGET = 3.0  # issue 31: compute-size first compiled step on the ranks ÷ JAX's first step
WARM_TARGET = 1.5  # issue 45: a warm start's first compiled step on the ranks ÷ JAX's warm first step
RANKED = f"torch, {RANKS} ranks ModelParallel {MESH[0]}x{MESH[1]} + package"
JAX = f"JAX, {RANKS} virtual CPU devices {MESH[0]}x{MESH[1]}, jit"
ONE_PROCESS_SAME_CORES = f"torch, 1 process, eager, {RANKS} threads"


EAGER_REGIONS = {"layer-eager-update": ("apply",), "layer-eager-loss": ("compute_loss", "compute_metrics")}
"""The ``jit-eager-*`` rows' units: the compiled regions (methods) each leaves eager."""


def _hub_config(name: str) -> Dict[str, Any]:
    config = dict(SIZES[SIZE]["config"])
    if SIZE == "tiny" and name.startswith("llama3"):
        config["num_key_value_heads"] = 2  # grouped-query attention, as Llama3 ships
    for key, value in HUB_MODELS[name][2].items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    return config


# ----------------------------------------------------------------------------- the models


def _layout_map(name: str, mesh: Any) -> Any:
    import keras

    if name in HUB_MODELS:
        import keras_hub

        layout_map = getattr(keras_hub.models, HUB_MODELS[name][0]).get_layout_map(mesh)
        if name.endswith("-tp"):
            for key, axes in TENSOR_PARALLEL_RULES.items():
                if key in list(layout_map):  # the keys as written (`in` matches paths by regex)
                    del layout_map[key]
                layout_map[key] = axes
        return layout_map
    layout_map = keras.distribution.LayoutMap(mesh)
    if name == "blocks":
        layout_map[".*block./up/kernel"] = (None, "model")
        layout_map[".*block./up/bias"] = ("model",)
        layout_map[".*block./down/kernel"] = ("model", None)
        return layout_map
    layout_map[".*up./kernel"] = (None, "model")
    layout_map[".*up./bias"] = ("model",)
    layout_map[".*down./kernel"] = ("model", None)
    return layout_map


def build(name: str, jit: bool, distributed: bool) -> Any:
    """``(model, inputs, targets)``; under ModelParallel on the ``MESH`` mesh when ``distributed``."""
    import keras
    import numpy as np

    if distributed:
        devices = keras.distribution.list_devices()
        mesh = keras.distribution.DeviceMesh(MESH, ["batch", "model"], devices)
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(layout_map=_layout_map(name, mesh), batch_dim_name="batch"))
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    if name in HUB_MODELS:
        import keras_hub

        config = _hub_config(name)
        backbone = getattr(keras_hub.models, HUB_MODELS[name][0])(**config)
        model = getattr(keras_hub.models, HUB_MODELS[name][1])(backbone=backbone, preprocessor=None)
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=jit)
        size = SIZES[SIZE]
        ids = rng.integers(1, config["vocabulary_size"], size=(size["batch"], size["length"])).astype("int32")
        return model, {"token_ids": ids, "padding_mask": np.ones(ids.shape, bool)}, ids
    if name == "blocks":
        inputs = keras.Input((256,))
        hidden = inputs
        for index in range(2):
            hidden = _block_class()(name=f"block{index}")(hidden)
        model = keras.Model(inputs, hidden, name="blocks")
        model.compile(optimizer=keras.optimizers.AdamW(1e-3), loss="mse", jit_compile=jit)
        return model, rng.normal(size=(64, 256)).astype("float32"), rng.normal(size=(64, 256)).astype("float32")
    layers: List[Any] = [keras.Input((256,))]
    for block in range(2):
        layers += [keras.layers.Dense(1024, activation="relu", name=f"up{block}"),
                   keras.layers.Dense(256, name=f"down{block}"), keras.layers.LayerNormalization(name=f"norm{block}")]
    model = keras.Sequential(layers, name="mlp")
    model.compile(optimizer=keras.optimizers.AdamW(1e-3), loss="mse", jit_compile=jit)
    return model, rng.normal(size=(64, 256)).astype("float32"), rng.normal(size=(64, 256)).astype("float32")


@functools.lru_cache(maxsize=None)
def _block_class() -> Any:
    """The ``blocks`` model's residual block (one class, made once keras is imported)."""
    import keras

    class Block(keras.layers.Layer):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.norm = keras.layers.LayerNormalization(name="norm")
            self.up = keras.layers.Dense(1024, activation="relu", name="up")
            self.down = keras.layers.Dense(256, name="down")

        def call(self, x: Any) -> Any:
            return x + self.down(self.up(self.norm(x)))

    return Block


def _timed_steps(model: Any, x: Any, y: Any, barrier: Any) -> Dict[str, Any]:
    start = time.perf_counter()
    model.train_on_batch(x, y)
    first = time.perf_counter() - start
    times = []
    for _ in range(STEPS - 1):
        barrier()
        start = time.perf_counter()
        model.train_on_batch(x, y)
        times.append((time.perf_counter() - start) * 1e3)
    return {"first_s": first, "steps_ms": times[1:]}  # steps 3..STEPS


# ----------------------------------------------------------------------------- workers


def torch_single(name: str, jit: bool, threads: int = 1) -> Dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    model, x, y = build(name, jit, distributed=False)
    return _timed_steps(model, x, y, lambda: None)


def torch_ranks(name: str, jit: bool, breakdown: bool, unit: str = "layer") -> Dict[str, Any]:
    """On each rank: the step times; on rank 0 with ``breakdown``, where an eager step's time goes. ``unit``: what
    ``jit_compile`` compiles (``keras_integration.set_compile_unit``)."""
    import torch
    import torch.distributed as dist

    from keras_dtensor_mixfix import keras_integration, reset_stats, stats

    torch.set_num_threads(1)
    keras_integration.install()
    if unit in EAGER_REGIONS:  # each block once, some regions left eager (what they gain)
        from keras_dtensor_mixfix._keras.step import layer_compile

        compiled_call, eager = layer_compile._CompiledMethod.call, EAGER_REGIONS[unit]

        def call(region: Any, *args: Any, **kwargs: Any) -> Any:
            if region.name in eager:
                return region.original(region.owner(), *args, **kwargs)
            return compiled_call(region, *args, **kwargs)

        layer_compile._CompiledMethod.call = call  # type: ignore[method-assign]
        unit = "layer"
    keras_integration.set_compile_unit(unit)
    model, x, y = build(name, jit, distributed=True)
    result = _timed_steps(model, x, y, dist.barrier)
    result["all_reduce_ms"] = _all_reduce_latency()
    if jit:
        from keras_dtensor_mixfix._keras.step.layer_compile import repeated_groups

        result["compile_s"] = _compile_seconds()
        result["caches"] = _cache_counts()
        # what was compiled once for several layers (none: the whole step was)
        result["shared_blocks"] = [len(group) for group in repeated_groups(model)] if unit == "layer" else []
    if breakdown:
        reset_stats()
        result["profile"] = _profile_shares(model, x, y, steps=5)
        result["promotions_per_step"] = sum(n for kinds in stats().values() for n in kinds.values()) / 5
        result["comms"] = _collectives(model, x, y)
    return result


def _compile_seconds() -> Dict[str, float]:
    """Where this process's compile time went: TorchDynamo's tracing (everything but the backend), AOTAutograd
    with inductor (the backend), and of that inductor's C++ compiles (torch's own compile metrics)."""
    from torch._dynamo import utils

    seconds: Dict[str, float] = {}
    for line in utils.compile_times(repr="str", aggregate=True).splitlines():
        name, _, value = line.rpartition(", ")
        try:
            seconds[name] = float(value)
        except ValueError:
            continue
    total = seconds.get("_compile.compile_inner", 0.0)
    backend = seconds.get("OutputGraph.call_user_compiler", 0.0)
    return {"all": total, "TorchDynamo tracing": total - backend, "AOTAutograd + inductor": backend,
            "of which C++ compiles": seconds.get("compile_file", 0.0)}


def _cache_counts() -> Dict[str, int]:
    """This process's hits, misses and saves of AOTAutograd's and inductor's on-disk caches (torch's counters)."""
    from torch._dynamo.utils import counters

    found = {f"AOTAutograd {key.replace('autograd_cache_', '')}": n for key, n in counters["aot_autograd"].items()
             if key.startswith("autograd_cache_")}
    found.update({f"inductor {key.replace('fxgraph_cache_', '')}": n for key, n in counters["inductor"].items()
                  if key.startswith("fxgraph_cache_")})
    return found


def _all_reduce_latency(repeats: int = 50) -> float:
    """The median time of one gloo all-reduce of 16 floats between the ranks, both waiting for it (ms): what a
    step pays per collective at the least, before any waiting for a slower rank."""
    import torch
    import torch.distributed as dist

    value = torch.ones(16)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(value)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def jax_devices(name: str) -> Dict[str, Any]:
    """Run in a subprocess with KERAS_BACKEND=jax and ``RANKS`` virtual devices."""
    model, x, y = build(name, jit=True, distributed=True)
    return _timed_steps(model, x, y, lambda: None)


# ----------------------------------------------------------------------------- breakdown

BUCKETS = (
    ("the package's promotion and Keras integration", ("keras_dtensor_mixfix",)),
    ("Keras / keras_hub Python", ("/keras/", "/keras_hub/")),
    ("DTensor sharding propagation", ("tensor/_sharding_prop.py", "tensor/_ops/", "tensor/_op_schema.py")),
    ("DTensor redistribution (Python)", ("tensor/_redistribute.py", "tensor/_collective_utils.py",
                                         "distributed/_functional_collectives.py", "distributed/tensor/placement")),
    ("DTensor dispatch and wrapping", ("torch/distributed/tensor/",)),
)


COLLECTIVES = "collectives (gloo, incl. waiting for the other rank)"


def _bucket(filename: str, function: str) -> str:
    if filename == "~":  # a built-in: kernels, autograd engine, collectives
        # DTensor's functional collectives, and c10d's own (``dist.all_reduce``: the vocabulary-parallel loss)
        if "_c10d_functional" in function or "wait_tensor" in function or "_distributed_c10d" in function:
            return COLLECTIVES
        return "local kernels, autograd engine and other C++"
    # functional collectives reach gloo through torch.library's autograd wrapper, whose redispatch
    # cProfile charges with the collective's whole time (in these steps nothing else redispatches)
    if (filename.endswith("torch/_ops.py") and function == "redispatch") or "torch/_library/" in filename:
        return COLLECTIVES
    for bucket, needles in BUCKETS:
        if any(needle in filename for needle in needles):
            return bucket
    return "other Python (torch.nn, autograd glue, pytree, ...)"


def _profile_shares(model: Any, x: Any, y: Any, steps: int) -> Dict[str, float]:
    import cProfile
    import pstats

    import torch.distributed as dist

    profile = cProfile.Profile()
    dist.barrier()
    profile.enable()
    for _ in range(steps):
        model.train_on_batch(x, y)
    profile.disable()
    shares: Dict[str, float] = {}
    for (filename, _, function), row in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
        bucket = _bucket(filename, function)
        shares[bucket] = shares.get(bucket, 0.0) + row[2]  # tottime
    total = sum(shares.values())
    return {bucket: value / total for bucket, value in shares.items()}


def _collectives(model: Any, x: Any, y: Any) -> Dict[str, Any]:
    """One step's collectives: count, bytes (each call's local input) per kind, and the wall time in them.

    A dispatch mode of our own rather than ``CommDebugMode``: its module tracker fails inside
    Keras' nested layers (``IndexError`` in ``ModuleTracker``, torch 2.13). The time is each
    collective's issue plus its ``wait_tensor`` (functional collectives are asynchronous: the wait
    is where a rank sits until the others arrive and the bytes have moved); the mode slows every
    op a little on every rank, so the waits carry some of that skew too.
    """
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: Dict[str, int] = {}
    sizes: Dict[str, int] = {}
    seconds = [0.0]

    class CountCollectives(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # let DTensor run first and desugar into collectives on local tensors
            name = func._overloadpacket.__name__
            collective = func.namespace in ("_c10d_functional", "c10d") and name.startswith(
                ("all", "reduce", "broadcast"))
            if collective:
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
                counts[name] = counts.get(name, 0) + 1
                sizes[name] = sizes.get(name, 0) + sum(t.numel() * t.element_size() for t in tensors)
            if not collective and name != "wait_tensor":
                return func(*args, **(kwargs or {}))
            start = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            if func.namespace == "c10d" and isinstance(out, (tuple, list)) and hasattr(out[-1], "wait"):
                out[-1].wait()  # a c10d op returns its Work: wait here so the time is the collective's
            seconds[0] += time.perf_counter() - start
            return out

    with CountCollectives():
        model.train_on_batch(x, y)
    return {"total": sum(counts.values()), "counts": counts, "bytes": sizes, "ms": seconds[0] * 1e3}


# ----------------------------------------------------------------------------- driver


def _in_subprocess(kind: str, name: str, jit: bool, env: Optional[Dict[str, str]] = None,
                   threads: int = 1) -> Dict[str, Any]:
    command = [sys.executable, os.path.abspath(__file__), "--worker", kind, name, str(int(jit)), str(threads)]
    done = subprocess.run(command, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} {name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _worker(kind: str, name: str, jit: bool, threads: int) -> None:
    result = jax_devices(name) if kind == "jax" else torch_single(name, jit, threads)
    print(json.dumps(result))


def _jax_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("jax") is not None


VARIANTS = ("one", "one-cores", "one-jit", "eager", "jit", "jit-eager-update", "jit-eager-loss", "jit-step", "jax",
            "jit-warm", "jax-warm")
"""``--variants`` names of the rows, in the order they run (``jit``: the package's default, each distinct repeated
block compiled once; ``jit-step``: the whole step compiled; ``jit-warm`` and ``jax-warm``: a second launch of the
``jit`` and ``jax`` rows on this machine, their on-disk compile caches filled by a first launch)."""
JIT_WARM = f"{RANKED}, jit_compile, warm start"
JAX_WARM = f"{JAX}, warm start"
JIT_ROWS = {"jit": ("layer", f"{RANKED}, jit_compile"),
            "jit-eager-update": ("layer-eager-update", f"{RANKED}, jit_compile, optimizer update eager"),
            "jit-eager-loss": ("layer-eager-loss", f"{RANKED}, jit_compile, loss and metrics eager"),
            "jit-step": ("step", f"{RANKED}, jit_compile, whole step")}


def measure(name: str, breakdown: bool, variants: Any = VARIANTS) -> Dict[str, Any]:
    from keras_dtensor_mixfix.testing import run_on_ranks

    rows: Dict[str, Any] = {}

    def attempt(variant: str, run: Any) -> None:  # a variant that fails is reported, the others still run
        try:
            rows[variant] = run()
        except Exception as exc:  # noqa: BLE001 - the message goes into the report
            rows[variant] = {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]}"}

    def on_ranks(jit: bool, unit: str = "layer", cache: Optional[str] = None) -> Dict[str, Any]:
        if jit:  # fresh ranks with an empty inductor cache (or ``cache``, a second launch's): no kernel compiled by
            # an earlier variant is reused
            from keras_dtensor_mixfix.testing import shutdown_workers

            shutdown_workers()
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache or tempfile.mkdtemp(prefix="mixfix-keras-step-inductor-")
        per_rank = run_on_ranks(torch_ranks, name, jit, breakdown and not jit, unit, world_size=RANKS,
                                timeout=1800)
        merged = dict(per_rank[0])
        merged["steps_ms"] = [max(times) for times in zip(*(r["steps_ms"] for r in per_rank))]
        merged["first_s"] = max(r["first_s"] for r in per_rank)
        return merged

    if "one" in variants:
        attempt("torch, 1 process, eager", lambda: _in_subprocess("torch", name, False))
    if "one-cores" in variants:
        attempt(ONE_PROCESS_SAME_CORES, lambda: _in_subprocess("torch", name, False, threads=RANKS))
    if "one-jit" in variants:
        attempt("torch, 1 process, jit_compile", lambda: _in_subprocess("torch", name, True))
    if "eager" in variants:
        attempt(f"{RANKED}, eager", lambda: on_ranks(False))
    for variant, (unit, row) in JIT_ROWS.items():
        if variant in variants:
            attempt(row, lambda unit=unit: on_ranks(True, unit))
    jax_environment = {"KERAS_BACKEND": "jax", "XLA_FLAGS": f"--xla_force_host_platform_device_count={RANKS}",
                       "JAX_PLATFORMS": "cpu"}
    if "jax" in variants and _jax_available():
        attempt(JAX, lambda: _in_subprocess("jax", name, True, jax_environment))

    def second_launch(launch: Any) -> Dict[str, Any]:
        launch()  # the first launch fills the on-disk compile cache the second one reads
        return launch()

    if "jit-warm" in variants:
        cache = tempfile.mkdtemp(prefix="mixfix-keras-step-warm-")
        attempt(JIT_WARM, lambda: second_launch(lambda: on_ranks(True, "layer", cache)))
    if "jax-warm" in variants and _jax_available():
        jax_cache = {**jax_environment, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                     "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
                     "JAX_COMPILATION_CACHE_DIR": tempfile.mkdtemp(prefix="mixfix-keras-step-jax-")}
        attempt(JAX_WARM, lambda: second_launch(lambda: _in_subprocess("jax", name, True, jax_cache)))
    return rows


def report(name: str, rows: Dict[str, Any]) -> None:
    print(f"\n### {name}\n")
    print(f"| variant | first step | step, median of 3–{STEPS - 1} | min |")
    print("|---|---|---|---|")
    for variant, row in rows.items():
        if "error" in row:
            print(f"| {variant} | fails: {row['error']} | | |")
            continue
        steps = row["steps_ms"]
        print(f"| {variant} | {row['first_s']:.2f} s | {statistics.median(steps):.1f} ms | {min(steps):.1f} ms |")
    median = {variant: statistics.median(row["steps_ms"]) for variant, row in rows.items() if "error" not in row}
    nan = float("nan")
    eager = median.get(f"{RANKED}, eager", nan)
    jit = median.get(f"{RANKED}, jit_compile", nan)
    jit_step = median.get(JIT_ROWS["jit-step"][1], nan)
    best = min((t for t in (eager, jit, jit_step) if t == t), default=nan)  # nan: a variant not run
    print()
    jax = median.get(JAX)
    if jax is not None and eager == eager:
        ratio = best / jax
        target = (f" (target ≤ {P8_TARGET}: {'PASS' if ratio <= P8_TARGET else 'MISS'})" if SIZE == "tiny"
                  else "")  # P8 is the tiny size's; the compute size has P10 below
        print(f"- {'P8 ' if SIZE == 'tiny' else ''}{RANKS}-rank step (best of eager and both compiles) ÷ JAX: "
              f"{ratio:.2f}{target}; "
              f"eager ÷ JAX {eager / jax:.2f}")
        first = rows[f"{RANKED}, eager"]["first_s"]
        jax_first = rows[JAX]["first_s"]
        print(f"- first step, {RANKS}-rank eager ÷ JAX: {first / jax_first:.2f} (target ≤ 1: "
              f"{'PASS' if first <= jax_first else 'MISS'})")
    elif not _jax_available():
        print("- JAX not installed: no P8 ratio (pip install \"jax[cpu]\")")
    else:
        print("- no JAX row in this run (--variants): no P8 ratio")
    p9 = jit / eager
    print(f"- P9 {RANKS}-rank jit_compile ÷ eager: {p9:.2f} (target ≤ {P9_TARGET}: "
          f"{'n/a' if p9 != p9 else 'PASS' if p9 <= P9_TARGET else 'MISS'})")
    one = median.get("torch, 1 process, eager", nan)
    p11 = (f" (P11 target ≤ {P11_TARGET}: {'PASS' if eager / one <= P11_TARGET else 'MISS'})"
           if SIZE == "tiny" and name == "gemma" and one == one else "")
    print(f"- {RANKS}-rank eager ÷ 1-process eager: {eager / one:.2f}{p11}")
    ranked_jit = rows.get(f"{RANKED}, jit_compile", {})
    if jax is not None and "first_s" in ranked_jit:
        ratio = ranked_jit["first_s"] / rows[JAX]["first_s"]
        target = (f" (P12 target ≤ {P12_TARGET}: {'PASS' if ratio <= P12_TARGET else 'MISS'})"
                  if SIZE == "compute" and name == "gemma" else "")
        print(f"- first compiled step, {RANKS} ranks ÷ JAX's first step: {ratio:.2f}{target}")
    whole_step = rows.get(JIT_ROWS["jit-step"][1], {})
    if "first_s" in ranked_jit and "first_s" in whole_step:
        print(f"- each block compiled once ÷ the whole step compiled: first step {ranked_jit['first_s']:.1f} ÷ "
              f"{whole_step['first_s']:.1f} s = {ranked_jit['first_s'] / whole_step['first_s']:.2f}; later steps "
              f"{jit:.1f} ÷ {jit_step:.1f} ms = {jit / jit_step:.2f}")
    warm, jax_warm = rows.get(JIT_WARM, {}), rows.get(JAX_WARM, {})
    if "first_s" in warm:
        cold = f" (cold {ranked_jit['first_s']:.1f} s)" if "first_s" in ranked_jit else ""
        against = (f"; ÷ JAX's warm first step {jax_warm['first_s']:.1f} s (JAX_COMPILATION_CACHE_DIR): "
                   f"{warm['first_s'] / jax_warm['first_s']:.2f} (target ≤ {WARM_TARGET}: "
                   f"{'PASS' if warm['first_s'] <= WARM_TARGET * jax_warm['first_s'] else 'MISS'})"
                   if "first_s" in jax_warm else "")
        print(f"- warm start, a second launch's first compiled step: {warm['first_s']:.1f} s{cold}{against}")
    same_cores = median.get(ONE_PROCESS_SAME_CORES, nan)
    p10 = ((P10_JAX_TARGET, ("JAX", jax if jax is not None else nan)),
           (P10_ONE_PROCESS_TARGET, (f"1 process on {RANKS} cores", same_cores))) if SIZE == "compute" else ()
    for target, (against, value) in p10:
        ratio = best / value
        verdict = "n/a" if ratio != ratio else "PASS" if ratio <= target else "MISS"
        print(f"- P10 {RANKS}-rank step (best of eager and both compiles) ÷ {against}: {ratio:.2f} (target ≤ {target}: "
              f"{verdict}); "
              f"eager ÷ {against} {eager / value:.2f}")
    shared = ranked_jit.get("shared_blocks", warm.get("shared_blocks"))
    each_block = (f"each block once ({' and '.join(f'one for {n}' for n in shared)} blocks)" if shared
                  else "the whole step (no repeated block)")
    for label, row in ((each_block, ranked_jit), ("the whole step", whole_step), (f"{each_block}, warm start", warm)):
        if "compile_s" in row:
            parts = ", ".join(f"{part} {value:.1f} s" for part, value in row["compile_s"].items())
            caches = ", ".join(f"{part} {n}" for part, n in sorted(row.get("caches", {}).items()))
            print(f"- compiling {label} on rank 0 ({RANKS} ranks): {parts}; on-disk caches: {caches or 'not used'}")
    ranked = rows.get(f"{RANKED}, eager", {})
    if "profile" in ranked:
        print(f"\nWhere an eager {RANKS}-rank step's {eager:.1f} ms go (rank 0, cProfile shares scaled to the step):\n")
        print("| part | ms | share |")
        print("|---|---|---|")
        for bucket, share in sorted(ranked["profile"].items(), key=lambda item: -item[1]):
            print(f"| {bucket} | {share * eager:.1f} | {share:.0%} |")
        comms = ranked["comms"]
        kinds = ", ".join(f"{kind} {n} ({comms['bytes'].get(kind, 0) / 1024:.0f} KiB)"
                          for kind, n in sorted(comms["counts"].items()))
        print(f"\nCollectives per step (rank 0): {comms['total']}: {kinds or 'none'}; "
              f"{comms['ms']:.1f} ms in them (issue to wait, under the counting mode); "
              f"mixed operands promoted by the package per step: {ranked['promotions_per_step']:g}")
    if "all_reduce_ms" in ranked:
        comms_total = ranked.get("comms", {}).get("total")
        floor = "" if comms_total is None else (
            f"; {comms_total} collectives per step × that = {comms_total * ranked['all_reduce_ms']:.1f} ms of the "
            f"step however little waiting there is")
        print(f"\nOne gloo all-reduce of 64 bytes between these ranks, both waiting for it: "
              f"{ranked['all_reduce_ms']:.2f} ms (median of 50){floor}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gemma,mlp")
    parser.add_argument("--no-breakdown", action="store_true")
    parser.add_argument("--mesh", default="x".join(map(str, MESH)),
                        help="the (batch, model) mesh of the distributed variants, e.g. 2x2 (4 ranks)")
    parser.add_argument("--size", choices=sorted(SIZES), default=SIZE,
                        help="tiny (dispatch-bound) or compute (issue 21's compute-bound size); see the docstring")
    parser.add_argument("--variants", default=",".join(v for v in VARIANTS if JIT_ROWS.get(v, ("",))[0]
                                                       not in EAGER_REGIONS),
                        help=f"rows to run, of {','.join(VARIANTS)} (one-cores: 1 process on the ranks' cores)")
    parser.add_argument("--steps", type=int, default=STEPS, help="steps per variant (at least 3)")
    parser.add_argument("--json", help="also write each row's first step, median and min step there (for "
                                       "compiled_step_targets.py)")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker[0], args.worker[1], bool(int(args.worker[2])), int(args.worker[3]))
        return 0
    wanted = {"MIXFIX_BENCH_MESH": args.mesh, "MIXFIX_BENCH_SIZE": args.size, "MIXFIX_BENCH_STEPS": str(args.steps)}
    if "MIXFIX_BENCH_INDUCTOR_CACHE" not in os.environ:
        # first compiled steps as a user's first run sees them: inductor's and AOTAutograd's on-disk caches empty
        wanted["MIXFIX_BENCH_INDUCTOR_CACHE"] = wanted["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(
            prefix="mixfix-keras-step-inductor-")
    if any(os.environ.get(key) != value for key, value in wanted.items()):
        # the workers (rank pools, subprocesses) read these at import
        os.environ.update(wanted)
        os.execv(sys.executable, [sys.executable, *sys.argv])
    from keras_dtensor_mixfix.testing import shutdown_workers

    import torch

    print(f"torch {torch.__version__}, {RANKS} gloo ranks on 127.0.0.1, mesh {MESH}, size {SIZE}, {STEPS} steps; "
          f"load average at start {os.getloadavg()[0]:.1f}")
    measured: Dict[str, Any] = {}
    try:
        for name in args.models.split(","):
            rows = measure(name, breakdown=not args.no_breakdown, variants=args.variants.split(","))
            report(name, rows)
            measured[name] = {variant: ({"first_s": row["first_s"], "median_ms": statistics.median(row["steps_ms"]),
                                         "min_ms": min(row["steps_ms"])} if "error" not in row else row)
                              for variant, row in rows.items()}
            print(f"\n(load average after {name}: {os.getloadavg()[0]:.1f})")
    finally:
        shutdown_workers()
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"size": SIZE, "mesh": MESH, "models": measured}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
