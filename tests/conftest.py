import os

# The suite decides itself when to patch: no auto-activation in this process or in the rank
# workers it spawns (they inherit the environment). Auto-activation has its own tests, which
# run subprocesses with their own environment.
os.environ["KERAS_DTENSOR_MIXFIX"] = "0"
os.environ.setdefault("KERAS_BACKEND", "torch")

pytest_plugins = ["pytester"]

_UNIT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "unit")


def pytest_configure(config):
    config.addinivalue_line("markers", "unit: fast, single process, no process group (tests/unit/)")
    config.addinivalue_line("markers", "ranks: scenario tests on real gloo ranks, subprocesses or rule packs")


def pytest_collection_modifyitems(config, items):
    # The folder says which layer a test belongs to: `pytest -m unit` runs the fast layer alone.
    import pytest

    for item in items:
        unit = str(item.fspath).startswith(_UNIT_DIR + os.sep)
        item.add_marker(pytest.mark.unit if unit else pytest.mark.ranks)
