"""What every test shares: the environment, the markers, the world sizes and the patch state around each test."""

import os
import sys

import pytest

# The suite decides itself when to patch: no auto-activation in this process or in the rank
# workers it spawns (they inherit the environment). Auto-activation has its own tests, which
# run subprocesses with their own environment.
os.environ["KERAS_DTENSOR_MIXFIX"] = "0"
os.environ.setdefault("KERAS_BACKEND", "torch")
# Inductor compiles kernels in this process (it otherwise starts a pool of compile workers, each importing torch, in
# every process that compiles: each rank worker, each subprocess); with two ranks on two cores the pool buys nothing.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

pytest_plugins = ["pytester"]

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

FOLDER_MARKERS = {
    "unit": ("unit",),
    "keras": ("keras_integration", "models"),
    "models": ("models",),
    "transformers": ("transformers_tp",),
    "simulated": ("simulated",),
}
"""Each marker and the folders (under tests/) whose tests carry it; a test outside ``unit/`` and ``simulated/`` is also
``ranks``.

The layout mirrors the package's layers (docs/architecture.md): ``unit/<layer>/`` runs in one process without a
process group; beside it, the multi-rank scenarios of each layer (``engine/``, ``lifecycle/``,
``keras_integration/``), the
differential corpus (``differential/``), the same promotions at 8 to 512 ranks under torch's rank simulator in this
one process (``simulated/``), real models (``models/``: keras_hub and JAX references, CI runs them in
their own environment), ``transformers_tp/``, the public surfaces (``surfaces/``), reported failure patterns and
torch repros (``patterns/``) and the project's own files (``project/``: README, links, pyproject). tests/ is on
``sys.path`` (the shared helpers live there), so a folder must not be named like a package a test imports: a
``transformers/`` folder would be imported as ``transformers`` where it is not installed
(``tests/project/test_project_config.py`` checks)."""


def _in_folder(path: str, folder: str) -> bool:
    return path.startswith(os.path.join(_TESTS_DIR, folder) + os.sep)


WORLD_SIZES = (2, 4)
"""Rank counts of the multi-rank scenarios: 2 ranks get a 1-D mesh, 4 the 2x2 ("dp", "tp") mesh
(``_ranks.mesh_for``)."""

_PLUGIN_MARKER = "mixfix"
"""The pytest plugin's marker (``keras_dtensor_mixfix.pytest_plugin``): it patches and restores a marked test itself."""


def pytest_configure(config):
    config.addinivalue_line("markers", "unit: fast, single process, no process group (tests/unit/<layer>/)")
    config.addinivalue_line("markers", "launches: a torch repro that compiles in fresh processes (minutes on a loaded "
                                       "machine); CI runs it on the oldest and the newest torch (CONTRIBUTING.md)")
    config.addinivalue_line("markers", "ranks: scenario tests on real gloo ranks, subprocesses or rule packs")
    config.addinivalue_line("markers", "simulated: 8 to 512 ranks under torch's rank simulator (LocalTensorMode on the "
                                       "fake process group), in the pytest process (tests/simulated/)")
    config.addinivalue_line("markers", "models: real models, keras_hub and JAX references (tests/models/); they "
                                       "skip without keras_hub or jax")
    config.addinivalue_line("markers", "keras: the Keras integration's multi-rank tests (tests/keras_integration/, "
                                       "tests/models/); CI runs them on the newest torch and on 2.13.0, not on the "
                                       "oldest (its unit tests run everywhere)")
    config.addinivalue_line("markers", "transformers: transformers' own tensor parallelism on tiny random checkpoints "
                                       "(tests/transformers_tp/, the docs/transformers.md program); they skip "
                                       "without transformers (the `transformers` extra)")
    config.addinivalue_line("markers", "cuda: needs 2 CUDA GPUs and NCCL (skipped, saying so, where they are absent)")
    config.addinivalue_line("markers", "slow(reason): minutes per test (compiled keras_hub models); skipped, giving "
                                       "the reason, unless MIXFIX_TEST_SLOW=1")


def pytest_collection_modifyitems(config, items):
    # The folder says which layer a test belongs to (`pytest -m unit` runs the fast layer alone) and which
    # packages beyond torch it needs (CI runs those in their own environments).
    for item in items:
        path = str(item.fspath)
        for marker, folders in FOLDER_MARKERS.items():
            if any(_in_folder(path, folder) for folder in folders):
                item.add_marker(getattr(pytest.mark, marker))
        if not _in_folder(path, "unit") and not _in_folder(path, "simulated"):
            item.add_marker(pytest.mark.ranks)
        slow = item.get_closest_marker("slow")
        if slow is not None and os.environ.get("MIXFIX_TEST_SLOW") != "1":
            item.add_marker(pytest.mark.skip(reason=f"{slow.kwargs.get('reason', 'minutes per test')}: "
                                                    "set MIXFIX_TEST_SLOW=1"))


def pytest_sessionfinish(session, exitstatus):
    """The rank workers end with the session (under ``-n``, README's test command, a pytest-xdist worker leaves without
    running ``atexit``; its ranks would otherwise wait out their process group on their own). A process that never
    imported ``keras_dtensor_mixfix.testing`` started none (xdist's controller, ``-m unit``): nothing to import
    there."""
    testing = sys.modules.get("keras_dtensor_mixfix.testing")
    if testing is not None:
        testing.shutdown_workers()


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
