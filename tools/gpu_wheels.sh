#!/usr/bin/env bash
# The wheels benchmarks/gpu_check.py needs on a GPU machine that has no network (docs/gpu.md): run here, on a
# machine with PyPI, then carry DIR there and install with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site DIR/*.whl
#   export PYTHONPATH=/tmp/site
#
#   bash tools/gpu_wheels.sh DIR [PYTHON_VERSION]      # PYTHON_VERSION: the GPU machine's, default 3.12
#
# That machine has torch (CUDA), JAX (CUDA), transformers, numpy, h5py, rich, ml-dtypes, regex, sentencepiece and
# tokenizers, but neither Keras nor keras_hub. What `import keras, keras_hub` and a keras_hub Gemma's
# fit/evaluate/predict/generate import beyond those (checked by blocking every other module): Keras, keras_hub
# (--no-deps: its requirements pull in tensorflow-text and kagglehub), absl-py, namex, optree (binary), and this
# package (built from the checkout) with pluggy, its one requirement torch does not bring. Not needed: kagglehub
# (keras_hub imports it only if it is installed; presets are not downloaded), grain (keras_hub's own fit batches
# NumPy with it; the check calls Keras' own fit, the same steps with preprocessor=None), tensorflow-text.
set -euo pipefail
DIR="${1:?usage: tools/gpu_wheels.sh DIR [PYTHON_VERSION]}"
PYTHON_VERSION="${2:-3.12}"
cd "$(dirname "$0")/.."
mkdir -p "$DIR"

# pure Python but optree (a binary wheel for that Python on x86-64 Linux)
WHEELS=(keras==3.15.1 keras-hub==0.32.0 absl-py==2.5.1 namex==0.1.0 pluggy==1.7.0 optree==0.20.0)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
    "${PLATFORMS[@]/#/--platform=}" -d "$DIR" "${WHEELS[@]}"
# this package, from the checkout as it is now (uncommitted changes included); pip builds it in an isolated
# environment with the setuptools pyproject asks for
rm -f "$DIR"/keras_dtensor_mixfix-*.whl
python3 -m pip wheel -q --no-deps -w "$DIR" .

ls -1 "$DIR"/*.whl
total=$(du -cb "$DIR"/*.whl | tail -1 | cut -f1)
echo "total: $((total / 1024)) KiB in $(ls "$DIR"/*.whl | wc -l) wheels (the carry limit is 64 MiB)"
