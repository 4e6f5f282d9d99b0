"""The derived layout maps at the scale users run: published model sizes at tensor-parallel degrees 2 to 64 and a
(data, model) mesh of (8, 64), read off the model's shapes (nothing is built in memory, no rank, no step).

    KERAS_BACKEND=torch python benchmarks/layouts_at_scale.py [--models llama3_8b,...] [--meshes 1x2,8x64,...]

For each model and mesh: how many variables split and how many stay whole, each rank's bytes of the weights against
one process's / n (1.00 is the ideal; optimizer slots follow their variables' layouts), and the reasons weights stay
whole, grouped (a count of heads, experts or a vocabulary the mesh axis does not divide; norms; routers). Needs
keras_hub (CONTRIBUTING.md "keras_hub on Keras 3.15.1"). The figures go in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import re
import time
from typing import Any, Dict, List, Tuple

os.environ.setdefault("KERAS_BACKEND", "torch")

SLIDING = dict(sliding_window=4096)
MODELS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    # name: (keras_hub backbone class, its published configuration; vision and audio encoders left out)
    "gemma_7b": ("GemmaBackbone", dict(vocabulary_size=256000, num_layers=28, num_query_heads=16,
                                       num_key_value_heads=16, hidden_dim=3072, intermediate_dim=49152, head_dim=256)),
    "gemma3_4b": ("Gemma3Backbone", dict(vocabulary_size=262144, num_layers=34, num_query_heads=8,
                                         num_key_value_heads=4, hidden_dim=2560, intermediate_dim=10240, head_dim=256,
                                         image_size=896, use_post_ffw_norm=True, use_post_attention_norm=True,
                                         use_sliding_window_attention=True, sliding_window_size=1024,
                                         vision_encoder=None)),
    "llama3_8b": ("Llama3Backbone", dict(vocabulary_size=128256, num_layers=32, num_query_heads=32,
                                         num_key_value_heads=8, hidden_dim=4096, intermediate_dim=14336)),
    "mistral_7b": ("MistralBackbone", dict(vocabulary_size=32000, num_layers=32, num_query_heads=32,
                                           num_key_value_heads=8, hidden_dim=4096, intermediate_dim=14336, **SLIDING)),
    "mixtral_8x7b": ("MixtralBackbone", dict(vocabulary_size=32000, num_layers=32, num_query_heads=32,
                                             num_key_value_heads=8, hidden_dim=4096, intermediate_dim=14336,
                                             num_experts=8, top_k=2, **SLIDING)),
    "qwen3_moe_30b_a3b": ("Qwen3MoeBackbone", dict(vocabulary_size=151936, num_layers=48, num_query_heads=32,
                                                   num_key_value_heads=4, hidden_dim=2048, intermediate_dim=6144,
                                                   moe_intermediate_dim=768, num_experts=128, top_k=8, head_dim=128)),
    "phi3_mini": ("Phi3Backbone", dict(vocabulary_size=32064, num_layers=32, num_query_heads=32,
                                       num_key_value_heads=32, hidden_dim=3072, intermediate_dim=8192,
                                       max_sequence_length=4096, pretraining_sequence_length=4096)),
    "gpt2_xl": ("GPT2Backbone", dict(vocabulary_size=50257, num_layers=48, num_heads=25, hidden_dim=1600,
                                     intermediate_dim=6400, max_sequence_length=1024)),
}
MESHES = [(1, 2), (1, 4), (1, 8), (1, 16), (1, 64), (8, 64)]


def _mesh(shape: Tuple[int, int]) -> Any:
    import keras

    return keras.distribution.DeviceMesh(shape, ["batch", "model"], [f"cpu:{i}" for i in range(math.prod(shape))])


def _reason_kind(reason: str) -> str:
    """A reason with its numbers and layer names left out, so that one kind counts once per mesh."""
    reason = re.sub(r"^[\w/]+: ", "", reason)
    return re.sub(r"\d+", "N", reason)[:90]


def cell(name: str, shape: Tuple[int, int]) -> Dict[str, Any]:
    import keras_hub

    from keras_dtensor_mixfix.layouts import derive_layouts

    class_name, config = MODELS[name]
    started = time.perf_counter()
    derived = derive_layouts(getattr(keras_hub.models, class_name), _mesh(shape), config=config)
    per_rank, whole = derived.bytes_per_rank()
    n = math.prod(shape)
    kinds = collections.Counter(_reason_kind(reason) for reason in derived.left_whole.values())
    whole_elements = collections.Counter()  # elements left whole, by reason: which reasons weigh most
    for path, reason in derived.left_whole.items():
        dims, dtype = derived.variables[path]
        whole_elements[_reason_kind(reason)] += math.prod(dims)
    return dict(model=name, mesh="x".join(map(str, shape)), split=len(derived.axes), whole=len(derived.left_whole),
                ratio=per_rank / (whole / n), per_rank_gib=per_rank / 2**30, total_gib=whole / 2**30,
                reasons=kinds, reason_elements=whole_elements, seconds=time.perf_counter() - started)


def main() -> None:
    import logging

    logging.getLogger("keras_dtensor_mixfix").setLevel(logging.ERROR)  # each weight left whole is in the table
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--meshes", default=",".join("x".join(map(str, m)) for m in MESHES))
    args = parser.parse_args()
    rows: List[Dict[str, Any]] = []
    for name in args.models.split(","):
        for mesh in args.meshes.split(","):
            rows.append(cell(name, tuple(int(part) for part in mesh.split("x"))))
    print("| model | mesh | split | whole | per rank, GiB (one process) | per rank ÷ (one process / n) | "
          "the largest weights left whole, and why |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        largest = ", ".join(f"{kind} ({row['reasons'][kind]})" for kind, _ in row["reason_elements"].most_common(2))
        print(f"| {row['model']} | {row['mesh']} | {row['split']} | {row['whole']} | {row['per_rank_gib']:.2f} "
              f"({row['total_gib']:.1f}) | {row['ratio']:.2f} | {largest} |")
    print(f"\nderivation time per cell: {min(r['seconds'] for r in rows):.1f}-{max(r['seconds'] for r in rows):.1f} s "
          "(float32 weights; bfloat16 halves every byte figure, not the ratio)")


if __name__ == "__main__":
    main()
