"""The pytest plugin, exercised with pytester (a real pytest session per test)."""

from __future__ import annotations

import pytest

CHECKS = """
import pytest
import torch
import keras_dtensor_mixfix as mf
from keras_dtensor_mixfix._rules.registry import registry

def test_fixture_patches(mixfix):
    assert mf.is_patched()
    assert mf.current_options().default == "replicate"

def test_not_patched_between_tests():
    assert not mf.is_patched()

def test_fixture_scoped_rule(mixfix):
    mixfix.register_rule("aten::mm.default", "local")
    assert registry.lookup(torch.ops.aten.mm.default) == "local"

def test_scoped_rule_is_gone():
    assert registry.lookup(torch.ops.aten.mm.default) is None

def test_fixture_restores_after_failure(mixfix):
    mixfix.register_rule("aten::bmm.default", "error")
    raise AssertionError("this test fails on purpose")

def test_state_after_failure():
    assert not mf.is_patched()
    assert registry.lookup(torch.ops.aten.bmm.default) is None

@pytest.mark.mixfix(default="local")
def test_marker_options_with_fixture(mixfix):
    assert mf.current_options().default == "local"

@pytest.mark.mixfix(default="error", plain_grads=False)
def test_marker_alone_patches():
    assert mf.is_patched()
    assert mf.current_options().default == "error" and mf.current_options().plain_grads is False

def test_still_clean():
    assert not mf.is_patched()
"""


@pytest.fixture
def session(pytester):
    pytester.makeconftest("import os\nos.environ['KERAS_DTENSOR_MIXFIX'] = '0'\n")
    return pytester


def test_fixture_and_marker_patch_per_test_and_restore_even_on_failure(session):
    session.makepyfile(test_checks=CHECKS)
    result = session.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=8, failed=1)
    result.stdout.fnmatch_lines(["*AssertionError: this test fails on purpose"])


def test_session_option_patches_the_whole_session_and_sets_the_default(session):
    session.makepyfile(
        test_session="""
        import keras_dtensor_mixfix as mf

        def test_a():
            assert mf.is_patched() and mf.current_options().default == "local"

        def test_b(mixfix):
            assert mf.current_options().default == "local"

        def test_c():
            assert mf.is_patched()
        """
    )
    result = session.runpytest_subprocess("--mixfix", "--mixfix-default=local")
    result.assert_outcomes(passed=3)
    import keras_dtensor_mixfix as mf

    assert not mf.is_patched()  # the inner session's patch was cleaned up


def test_help_and_markers_document_the_plugin(session):
    help_text = session.runpytest_subprocess("--help").stdout.str()
    assert "keras_dtensor_mixfix" in help_text and "--mixfix" in help_text and "--mixfix-default" in help_text
    markers = session.runpytest_subprocess("--markers").stdout.str()
    assert "@pytest.mark.mixfix(**options)" in markers


def test_plugin_can_be_disabled(session):
    session.makepyfile(test_off="def test_uses_fixture(mixfix):\n    pass\n")
    result = session.runpytest_subprocess("-p", "no:keras_dtensor_mixfix")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'mixfix' not found*"])
    assert "--mixfix" not in session.runpytest_subprocess("-p", "no:keras_dtensor_mixfix", "--help").stdout.str()


def test_marker_rejects_positional_arguments(session):
    session.makepyfile(
        test_bad="""
        import pytest

        @pytest.mark.mixfix("local")
        def test_x(mixfix):
            pass
        """
    )
    result = session.runpytest_subprocess()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*keyword options only*"])
