"""What every test shares: the environment, the markers, the world sizes and the patch state around each test."""

import os

import pytest

# The suite decides itself when to patch: no auto-activation in this process or in the rank
# workers it spawns (they inherit the environment). Auto-activation has its own tests, which
# run subprocesses with their own environment.
os.environ["KERAS_DTENSOR_MIXFIX"] = "0"
os.environ.setdefault("KERAS_BACKEND", "torch")

pytest_plugins = ["pytester"]

_UNIT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "unit")
_MODEL_FILES = ("test_keras_hub", "test_jax_reference")
"""Files whose names start so hold real-model tests (keras_hub, JAX references): `pytest -m models`."""
_KERAS_FILES = ("test_keras",)
"""Files whose names start so test the Keras integration: `pytest -m keras` (CI skips them on the oldest torch)."""
_TRANSFORMERS_FILES = ("test_transformers",)
"""Files whose names start so test transformers' tensor parallelism: `pytest -m transformers` (they skip without it)."""

WORLD_SIZES = (2, 4)
"""Rank counts of the multi-rank scenarios: 2 ranks get a 1-D mesh, 4 the 2x2 ("dp", "tp") mesh (``_ranks.mesh_for``)."""

_PLUGIN_MARKER = "mixfix"
"""The pytest plugin's marker (``keras_dtensor_mixfix.pytest_plugin``): it patches and restores a marked test itself."""


def pytest_configure(config):
    config.addinivalue_line("markers", "unit: fast, single process, no process group (tests/unit/)")
    config.addinivalue_line("markers", "ranks: scenario tests on real gloo ranks, subprocesses or rule packs")
    config.addinivalue_line("markers", "models: real models, keras_hub and JAX references (tests/test_keras_hub*.py, "
                                       "tests/test_jax_reference*.py); they skip without keras_hub or jax")
    config.addinivalue_line("markers", "keras: the Keras integration (tests/test_keras*.py); CI runs them on the newest "
                                       "torch and on 2.13.0, not on the oldest")
    config.addinivalue_line("markers", "transformers: transformers' own tensor parallelism on tiny random checkpoints "
                                       "(tests/test_transformers*.py, the docs/transformers.md program); they skip "
                                       "without transformers (the `transformers` extra)")
    config.addinivalue_line("markers", "cuda: needs 2 CUDA GPUs and NCCL (skipped, saying so, where they are absent)")
    config.addinivalue_line("markers", "slow: minutes per test (compiled keras_hub models); skipped unless "
                                       "MIXFIX_TEST_SLOW=1")


def pytest_collection_modifyitems(config, items):
    # The folder says which layer a test belongs to: `pytest -m unit` runs the fast layer alone.
    for item in items:
        unit = str(item.fspath).startswith(_UNIT_DIR + os.sep)
        item.add_marker(pytest.mark.unit if unit else pytest.mark.ranks)
        # and the file name which tests need the model packages (CI runs them in their own environment)
        if os.path.basename(str(item.fspath)).startswith(_MODEL_FILES):
            item.add_marker(pytest.mark.models)
        if os.path.basename(str(item.fspath)).startswith(_KERAS_FILES):
            item.add_marker(pytest.mark.keras)
        if os.path.basename(str(item.fspath)).startswith(_TRANSFORMERS_FILES):
            item.add_marker(pytest.mark.transformers)


@pytest.fixture(params=WORLD_SIZES, ids=str)
def world_size(request) -> int:
    """A test that takes ``world_size`` runs once per entry of ``WORLD_SIZES``; a test that parametrizes
    ``world_size`` itself (other sizes, or sizes paired with meshes) overrides this."""
    return request.param


@pytest.fixture(autouse=True)
def _unpatched_around_each_test(request):
    """Each test starts unpatched and leaves the process unpatched, whatever it did or however it ended.

    ``unpatch()`` also clears the promotion caches, so the next test starts without any. Only the process
    running pytest needs this: rank workers are fresh processes.
    """
    import keras_dtensor_mixfix as mf

    # The plugin's own autouse fixture, set up before this one, has already patched a marked test and restores it.
    marked = request.node.get_closest_marker(_PLUGIN_MARKER) is not None
    assert marked or not mf.is_patched(), (
        "patched before the test started: by pytest's --mixfix option, by a test module at import, or by "
        "auto-activation (this conftest turns it off with KERAS_DTENSOR_MIXFIX=0)")
    yield
    while not marked and mf.is_patched():
        mf.unpatch()
