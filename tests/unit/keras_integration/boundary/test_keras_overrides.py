"""The Keras integration's declared overrides: their order, and the declarations themselves (no Keras needed)."""

from __future__ import annotations

import pytest

from keras_dtensor_mixfix._keras.boundary.overrides import Override, in_order


def _override(name: str, *after: str) -> Override:
    return Override(name=name, attributes=("__call__",), description=f"{name} applied", apply=lambda recorder: None,
                    after=after)


def test_the_order_keeps_the_declared_one_unless_an_override_comes_after_a_later_one():
    first, second, third = _override("first"), _override("second", "third"), _override("third")
    assert [o.name for o in in_order([first, second, third])] == ["first", "third", "second"]
    assert [o.name for o in in_order([first, third, second])] == ["first", "third", "second"]


@pytest.mark.parametrize("overrides, refusal", [
    ([_override("a", "b"), _override("b", "a")], "cycle"),
    ([_override("a", "nowhere")], "unknown"),
    ([_override("a"), _override("a")], "two overrides"),
], ids=["cycle", "unknown", "duplicate"])
def test_an_order_that_cannot_be_kept_is_refused(overrides, refusal):
    with pytest.raises(ValueError, match=refusal):
        in_order(overrides)


def test_the_folder_that_declares_an_override_is_what_it_changes():
    """An override whose report line says it changes a Keras op is declared in _keras/ops, and every override there
    says so: the folder is the declaration of what part of Keras an override changes."""
    from keras_dtensor_mixfix import keras_integration

    wings = {"backend", "files", "layout_maps", "ops", "step"}
    for override in keras_integration.OVERRIDES:
        module = override.apply.__module__
        assert module.startswith("keras_dtensor_mixfix._keras."), (override.name, module)
        wing = module.split(".")[2]
        assert wing in wings, (override.name, module)
        assert override.description.startswith("ops:") == (wing == "ops"), (override.name, module)


def test_every_declared_override_is_in_the_install_order_with_its_line_and_attributes():
    from keras_dtensor_mixfix import keras_integration

    ordered = in_order(keras_integration.OVERRIDES)  # raises on a duplicate name, an unknown `after`, a cycle
    assert len(ordered) == len(keras_integration.OVERRIDES)
    for override in ordered:
        assert override.description and "\n" not in override.description, override.name
        assert override.attributes and all(isinstance(name, str) for name in override.attributes), override.name
    position = {o.name: i for i, o in enumerate(ordered)}
    assert position["einsum kernel split"] > position["local einsum"]  # it wraps the einsum local einsum installs
    assert ordered[-1].name == "promotion mode"  # its report line is the last (tests/test_keras316.py reads it)


def test_every_function_of_our_backend_that_makes_a_parameter_gets_the_gradient_hook():
    """A parameter our ``distribution_lib`` makes that the gradient-layout hook misses keeps whatever placements
    backward leaves its gradient (the optimizer's kernels then reduce it again): the hook's list is the functions
    whose declared result is a parameter."""
    import importlib
    import inspect

    pytest.importorskip("keras")
    from keras_dtensor_mixfix._keras import backend
    from keras_dtensor_mixfix._keras.step import reductions

    for module_name in ("distribution_lib", "initial_pieces", "variables", "initial_values"):
        module = importlib.import_module(f"{backend.__name__}.{module_name}")
        making = sorted(name for name, function in inspect.getmembers(module, inspect.isfunction)
                        if function.__module__ == module.__name__ and "Parameter" in str(
                            inspect.signature(function).return_annotation))
        assert sorted(reductions._MADE_BY_OUR_BACKEND.get(module_name, ())) == making, module_name
    assert sum(len(names) for names in reductions._MADE_BY_OUR_BACKEND.values()) == 4
