"""pytest plugin (``pytest11`` entry point ``keras_dtensor_mixfix``; disable with ``-p no:keras_dtensor_mixfix``).

- fixture ``mixfix``: patched for one test, restored afterwards even if the test fails; its
  ``register_rule`` registers rules scoped to the test.
- marker ``@pytest.mark.mixfix(**options)``: ``patch()`` options for that test (patches the test
  even without the fixture).
- ``--mixfix``: patch for the whole session; ``--mixfix-default=RULE`` sets the default rule for
  the session, the fixture and the marker (a marker's own options win).

Multi-rank tests: :func:`keras_dtensor_mixfix.testing.run_on_ranks`.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List

import pytest

from ._rules.errors import MixfixError

MARKER = "mixfix"


class MarkerUsageError(MixfixError, pytest.UsageError):  # type: ignore[misc]  # pytest's UsageError is @final
    """``@pytest.mark.mixfix`` used with positional arguments (it takes ``patch()`` keyword options only).

    A ``pytest.UsageError``, so pytest reports it as a usage mistake rather than a crash.
    """


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("keras_dtensor_mixfix", "keras_dtensor_mixfix: mixed torch.Tensor/DTensor promotion")
    group.addoption("--mixfix", action="store_true", default=False,
                    help="patch keras_dtensor_mixfix for the whole test session")
    group.addoption("--mixfix-default", action="store", default=None, choices=("replicate", "local", "error"),
                    help="default rule while patched by --mixfix, the mixfix fixture or the mixfix marker")


def pytest_configure(config: Any) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(**options): patch keras_dtensor_mixfix for this test with these patch() options, "
        "e.g. @pytest.mark.mixfix(default='local')",
    )
    if config.getoption("--mixfix", default=False):
        import keras_dtensor_mixfix

        block = keras_dtensor_mixfix.patched(**_cli_options(config))
        block.__enter__()
        config.add_cleanup(lambda: block.__exit__(None, None, None))


def _cli_options(config: Any) -> Dict[str, Any]:
    default = config.getoption("--mixfix-default", default=None)
    return {"default": default} if default else {}


def _test_options(request: Any) -> Dict[str, Any]:
    options = _cli_options(request.config)
    marker = request.node.get_closest_marker(MARKER)
    if marker is not None:
        if marker.args:
            raise MarkerUsageError(f"@pytest.mark.{MARKER} takes keyword options only, got {marker.args!r}")
        options.update(marker.kwargs)
    return options


class MixfixFixture:
    """What the ``mixfix`` fixture yields."""

    def __init__(self, options: Dict[str, Any]) -> None:
        self.options = options
        self._handles: List[Any] = []

    def register_rule(self, op: Any, rule: Any) -> Any:
        """Like :func:`keras_dtensor_mixfix.register_rule`, removed when the test ends."""
        import keras_dtensor_mixfix

        handle = keras_dtensor_mixfix.register_rule(op, rule, source="pytest fixture")
        self._handles.append(handle)
        return handle

    def stats(self) -> Dict[str, Dict[str, int]]:
        """Promotions since the test started."""
        import keras_dtensor_mixfix

        return keras_dtensor_mixfix.stats()

    def _close(self) -> None:
        while self._handles:
            self._handles.pop().remove()


@pytest.fixture
def mixfix(request: Any) -> Iterator[MixfixFixture]:
    """Patch keras_dtensor_mixfix for this test; rules registered through it end with the test."""
    import keras_dtensor_mixfix

    options = _test_options(request)
    fixture = MixfixFixture(options)
    with keras_dtensor_mixfix.patched(**options):
        keras_dtensor_mixfix.reset_stats()
        try:
            yield fixture
        finally:
            fixture._close()


@pytest.fixture(autouse=True)
def _mixfix_marker(request: Any) -> Iterator[None]:
    if request.node.get_closest_marker(MARKER) is None or "mixfix" in request.fixturenames:
        yield
        return
    import keras_dtensor_mixfix

    with keras_dtensor_mixfix.patched(**_test_options(request)):
        yield
