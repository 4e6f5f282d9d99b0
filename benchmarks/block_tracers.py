"""One keras_hub Gemma decoder block, forward and backward on 2 ranks, traced and compiled several ways (issue 61).

    python benchmarks/block_tracers.py                          # tiny Gemma, every tracer (~10 min on 2 cores)
    python benchmarks/block_tracers.py --size compute --tracers dynamo,aot,fx-dynamo

The block is what ``jit_compile=True`` compiles under a distribution today (``_keras/step/layer_compile.py``): the
template's ``call`` run as a stateless call on the block's variables (DTensors on a (1, 2) mesh, keras_hub's own layout
map) and its real inputs, taken from an eager train step. Tracers, each in fresh rank processes with an empty on-disk
compile cache (``TORCHINDUCTOR_CACHE_DIR``), then launched again on that cache (the warm start):

- ``eager``: the stateless call, no compile (the reference values);
- ``dynamo``: ``torch.compile`` (inductor), today's path: TorchDynamo interprets Keras' bytecode;
- ``dynamo-aot_eager``: the same with the ``aot_eager`` backend: TorchDynamo and AOTAutograd, no inductor;
- ``aot``: AOTAutograd alone (``aot_function``: Keras' Python runs once under fake tensors), inductor compiling the
  forward and backward graphs it partitions;
- ``aot-nop``: the same with no compiler: what tracing alone costs;
- ``fx-dynamo``: Keras' Python run once by ``make_fx`` (fake tensors, pre-dispatch: the graph of aten ops on DTensors,
  above autograd), and that flat graph compiled by ``torch.compile``: TorchDynamo reads generated code, not Keras'.

Printed per tracer: the first call (tracing and compiling, forward and backward) in seconds, the median later call in
ms, and the largest difference of the output and the gradients from ``eager`` (the slower rank's figures).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

os.environ.setdefault("KERAS_BACKEND", "torch")
os.environ["KERAS_DTENSOR_MIXFIX"] = "0"  # the benchmark installs what it measures explicitly
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

TRACERS = ("eager", "dynamo", "dynamo-aot_eager", "aot", "aot-nop", "fx-dynamo")
COMPILING = ("dynamo", "aot", "fx-dynamo")
"""The tracers that write inductor's on-disk cache, launched a second time on it."""
CALLS = 6


def _block_call(size: str) -> Any:
    """``(function, inputs, trainable)``: the first decoder block's stateless call over its variables and real
    inputs, the function taking ``inputs``; ``trainable`` the variables' values whose gradients are compared."""
    import torch

    import keras_model_step
    from keras_dtensor_mixfix._keras.boundary import keras_private
    from keras_dtensor_mixfix._keras.step import layer_compile

    keras_model_step.SIZE = size
    model, x, y = keras_model_step.build("gemma", jit=False, distributed=True)
    block = model.backbone.transformer_layers[0]
    original, captured = type(block).call, {}

    def capture(*args: Any, **kwargs: Any) -> Any:
        if "call" not in captured and isinstance(args[0], torch.Tensor) and args[0].device.type != "meta":
            captured["call"] = (args, kwargs)
        return original(block, *args, **kwargs)

    block.call = capture
    model.train_on_batch(x, y)
    del block.call
    args, kwargs = captured["call"]
    args = tuple(a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a for a in args)
    tensor_kwargs = {name: value for name, value in kwargs.items() if isinstance(value, torch.Tensor)}
    other_kwargs = {name: value for name, value in kwargs.items() if not isinstance(value, torch.Tensor)}
    scope = layer_compile._assigning_scope_class()
    trainable = [keras_private.variable_storage(v) for v in block.trainable_variables]
    non_trainable = [keras_private.variable_storage(v) for v in block.non_trainable_variables]

    def call(trainable: List[Any], non_trainable: List[Any], args: tuple, tensor_kwargs: Dict[str, Any]) -> Any:
        outputs, _, _ = layer_compile._stateless_call(scope, block, trainable, non_trainable, args,
                                                      {**tensor_kwargs, **other_kwargs})
        return outputs[0] if isinstance(outputs, (tuple, list)) else outputs

    return call, (trainable, non_trainable, args, tensor_kwargs), trainable


def _compiled(tracer: str, call: Any, inputs: tuple) -> Any:
    import torch

    if tracer == "eager":
        return call
    if tracer == "dynamo":
        return torch.compile(call, dynamic=False)
    if tracer == "dynamo-aot_eager":
        return torch.compile(call, backend="aot_eager", dynamic=False)
    if tracer in ("aot", "aot-nop"):
        from functorch.compile import aot_function, nop

        if tracer == "aot-nop":
            return aot_function(call, fw_compiler=nop)
        from keras_dtensor_mixfix._torch.aot_compile import aot_inductor_function

        return aot_inductor_function(call)  # what the block tracer compiles with
    if tracer == "fx-dynamo":
        from torch.fx.experimental.proxy_tensor import make_fx

        def traced_then_compiled(*args: Any) -> Any:
            if not hasattr(traced_then_compiled, "compiled"):
                started = time.perf_counter()
                graph = make_fx(call, tracing_mode="fake", pre_dispatch=True)(*args)
                traced_then_compiled.trace_s = time.perf_counter() - started  # type: ignore[attr-defined]
                traced_then_compiled.compiled = torch.compile(graph, dynamic=False)  # type: ignore[attr-defined]
            return traced_then_compiled.compiled(*args)  # type: ignore[attr-defined]

        return traced_then_compiled
    raise ValueError(tracer)


def on_rank(size: str, tracer: str) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist

    from keras_dtensor_mixfix import keras_integration

    torch.set_num_threads(1)
    keras_integration.install()
    call, inputs, trainable = _block_call(size)
    compiled = _compiled(tracer, call, inputs)
    times = []
    for _ in range(CALLS):
        for value in trainable:
            value.grad = None
        dist.barrier()
        started = time.perf_counter()
        output = compiled(*inputs)
        output.sum().backward()
        times.append(time.perf_counter() - started)

    def whole(t: Any) -> Any:
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().double().cpu().numpy().tolist()

    result = {"first_s": times[0], "later_ms": statistics.median(times[2:]) * 1e3, "output": whole(output),
              "grads": [whole(v.grad) for v in trainable]}
    if hasattr(compiled, "trace_s"):
        result["trace_s"] = compiled.trace_s
    return result


def _launch(size: str, tracer: str, cache: str) -> Dict[str, Any]:
    """One tracer in fresh rank processes on the on-disk cache ``cache``: the slower rank's figures."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, __file__, "--worker", tracer, "--size", size, "--json", out.name], check=True,
                       env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
        with open(out.name) as saved:
            return json.load(saved)


def _worker(size: str, tracer: str, out: str) -> None:
    from keras_dtensor_mixfix.testing import run_on_ranks

    from keras_dtensor_mixfix.testing import RankError

    try:
        ranks = run_on_ranks(on_rank, size, tracer, world_size=2, timeout=3600)
    except RankError as error:  # a tracer that cannot trace the block is a row of the table too
        result: Dict[str, Any] = {"error": " ".join(str(error).split("--- traceback")[0].split())[:300]}
    else:
        slower = max(ranks, key=lambda r: r["first_s"])
        result = {**slower, "output": ranks[0]["output"], "grads": ranks[0]["grads"]}
    with open(out, "w") as saved:
        json.dump(result, saved)


def _largest_difference(a: Any, b: Any) -> float:
    import numpy as np

    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="tiny", choices=("tiny", "compute"))
    parser.add_argument("--tracers", default=",".join(TRACERS))
    parser.add_argument("--worker")
    parser.add_argument("--json")
    options = parser.parse_args()
    if options.worker:
        _worker(options.size, options.worker, options.json)
        return 0
    tracers = options.tracers.split(",")
    reference = _launch(options.size, "eager", tempfile.mkdtemp(prefix="block-tracers-"))
    print(f"Gemma ({options.size}) decoder block, forward and backward, 2 ranks, (1, 2) mesh")
    print(f"{'tracer':<26} {'first call':>11} {'later':>9} {'trace':>7}  largest difference from eager "
          f"(output, gradients)")
    for tracer in tracers:
        cache = tempfile.mkdtemp(prefix="block-tracers-")
        launches = [("", _launch(options.size, tracer, cache))] if tracer != "eager" else [("", reference)]
        if tracer in COMPILING and "error" not in launches[0][1]:
            launches.append((", warm", _launch(options.size, tracer, cache)))
        for label, row in launches:
            if "error" in row:
                print(f"{tracer + label:<26} failed: {row['error']}", flush=True)
                break
            grads = max(_largest_difference(g, r) for g, r in zip(row["grads"], reference["grads"]))
            trace = f"{row['trace_s']:.2f} s" if "trace_s" in row else ""
            print(f"{tracer + label:<26} {row['first_s']:>9.2f} s {row['later_ms']:>6.1f} ms {trace:>7}  "
                  f"{_largest_difference(row['output'], reference['output']):.1e}, {grads:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
