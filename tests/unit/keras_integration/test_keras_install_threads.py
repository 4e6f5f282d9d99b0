"""``keras_integration.install()`` from several threads, and from inside itself: one install, no lock held while it
applies the overrides (``keras_integration._Integration``)."""

from __future__ import annotations

import dataclasses
import threading

import pytest

pytest.importorskip("keras", reason="installing the Keras integration needs Keras")


@pytest.fixture
def integration(monkeypatch):
    """keras_integration, uninstalled for the test and left as it was found."""
    from keras_dtensor_mixfix import keras_integration

    was_installed = keras_integration.is_installed()
    keras_integration.uninstall()
    yield keras_integration
    keras_integration.uninstall()
    if was_installed:
        keras_integration.install()


def _with_first_apply(integration, monkeypatch, before_apply):
    """``before_apply`` runs before the first override this Keras needs is applied (Keras 3.16 needs no backend of
    ours, the first declared)."""
    index, first = next((index, override) for index, override in enumerate(integration.OVERRIDES) if override.needed())

    def apply(patches):
        before_apply()
        return first.apply(patches)

    overrides = list(integration.OVERRIDES)
    overrides[index] = dataclasses.replace(first, apply=apply)
    monkeypatch.setattr(integration, "OVERRIDES", tuple(overrides))


def test_a_second_thread_waits_for_the_install_in_progress_and_nothing_is_applied_twice(integration, monkeypatch):
    applying, release = threading.Event(), threading.Event()

    def hold():
        applying.set()
        assert release.wait(60)

    _with_first_apply(integration, monkeypatch, hold)
    results = []
    first = threading.Thread(target=lambda: results.append(("first", integration.install())))
    first.start()
    assert applying.wait(60)
    second = threading.Thread(target=lambda: results.append(("second", integration.install())))
    second.start()
    second.join(0.5)
    assert second.is_alive() and not integration.is_installed()  # waiting; the state is readable meanwhile
    release.set()
    first.join(60)
    second.join(60)
    assert sorted(results) == [("first", True), ("second", True)]
    replaced = integration._replaced_attributes()
    assert replaced and len(replaced) == len(set((name, id(owner), attribute) for name, owner, attribute in replaced))


def test_install_called_while_its_own_overrides_are_applied_returns_at_once(integration, monkeypatch):
    nested = []
    _with_first_apply(integration, monkeypatch, lambda: nested.append(integration.install()))
    assert integration.install() and nested == [True] and integration.is_installed()
    integration.uninstall()
    assert not integration.is_installed() and integration._replaced_attributes() == []


def test_a_failing_override_leaves_keras_as_it_was_and_the_next_install_can_run(integration, monkeypatch):
    def fail():
        raise RuntimeError("an override failed")

    _with_first_apply(integration, monkeypatch, fail)
    with pytest.raises(RuntimeError, match="an override failed"):
        integration.install()
    assert not integration.is_installed()
    monkeypatch.undo()
    assert integration.install() and integration.is_installed()
