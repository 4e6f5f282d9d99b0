"""The Keras gate on a real Keras: outside the supported releases the integration leaves Keras exactly as it is.

Another Keras release is simulated by the version string the gate reads (``keras_modules.running_keras_version``),
in this process or, for auto-activation (which decides during ``import keras``), through a ``sitecustomize``.
The real older releases (3.0.5, 3.11.3) were tried by hand: see docs/keras.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

keras = pytest.importorskip("keras", reason="the Keras gate needs Keras installed")

from keras_dtensor_mixfix import keras_integration  # noqa: E402
from keras_dtensor_mixfix._keras.boundary import keras_modules  # noqa: E402
from keras_dtensor_mixfix._keras.gate import keras_gate, selfcheck  # noqa: E402
from keras_dtensor_mixfix._rules import env  # noqa: E402

NEWEST = keras_modules.NEWEST_KERAS
OLDER = "3.11.3"
NEWER = f"{NEWEST[0]}.{NEWEST[1] + 1}.0"


def _keras_attributes() -> dict:
    """Every attribute of every Keras module and class the integration may replace, by identity."""
    owners = [keras_modules.core(), keras_modules.core().Variable, keras_modules.base_variable_class(),
              keras_modules.backend_numpy(), keras_modules.backend_nn(), keras_modules.trainer_module(),
              keras_modules.trainer_class(), keras_modules.backend_package(), keras_modules.torch_backend_package(),
              keras_modules.distribution_module(), keras_modules.data_adapters(), keras_modules.saving_lib(),
              keras_modules.layer_class()]
    owners += [module for name, module in sorted(sys.modules.items())
               if module is not None and (name == "keras" or name.startswith("keras."))]
    snapshot = {}
    for owner in owners:
        for name, value in vars(owner).items():
            snapshot[(getattr(owner, "__name__", repr(owner)), name)] = id(value)
    for name, module in sys.modules.items():
        if name == "keras" or name.startswith("keras."):
            snapshot[("sys.modules", name)] = id(module)
    return snapshot


def _differences(before: dict, after: dict) -> list:
    return sorted(str(key) for key in set(before) | set(after) if before.get(key) != after.get(key))


@pytest.mark.parametrize("version", [OLDER, NEWER])
def test_install_on_an_unsupported_keras_raises_and_changes_nothing(monkeypatch, version):
    keras_integration.uninstall()
    monkeypatch.setattr(keras_modules, "running_keras_version", lambda: version)
    monkeypatch.delenv("KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_KERAS", raising=False)
    before = _keras_attributes()
    with pytest.raises(keras_integration.UnsupportedKerasError) as raised:
        keras_integration.install()
    assert raised.value.reason == keras_gate.unsupported_reason(version)
    assert str(raised.value).startswith("keras_dtensor_mixfix.keras_integration.install(): Keras ")
    assert not keras_integration.is_installed()
    assert _differences(before, _keras_attributes()) == []


def test_install_and_uninstall_on_a_supported_keras_restore_every_attribute():
    keras_integration.uninstall()
    before = _keras_attributes()
    assert keras_integration.install()
    assert _differences(before, _keras_attributes()) != []  # the snapshot sees what install replaces
    keras_integration.uninstall()
    after = _keras_attributes()
    # Modules Keras imports lazily, first imported by install (kept: Keras would import them the same way)
    imported = [key for key in after if key not in before and key[0] == "sys.modules"]
    assert _differences(before, {key: value for key, value in after.items() if key not in imported}) == []


def test_a_newer_keras_opted_in_runs_the_real_self_check_in_a_subprocess(monkeypatch):
    keras_integration.uninstall()
    monkeypatch.setattr(keras_modules, "running_keras_version", lambda: NEWER)
    monkeypatch.setattr(env, "_warned", set())
    selfcheck.clear_cache()
    try:
        assert keras_integration.install(allow_newer_keras=True)
        report = selfcheck.self_check()
        assert report.ok, report.summary()
        assert report.where == "in a subprocess" and [r.name for r in report.results] == list(selfcheck.CHECKS)
    finally:
        keras_integration.uninstall()
        selfcheck.clear_cache()


def _site(tmp_path, version: str) -> str:
    """A sitecustomize that makes every Python process started with it report Keras ``version`` to the gate."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import keras_dtensor_mixfix._keras.boundary.keras_modules as keras_modules
        keras_modules.running_keras_version = lambda: {version!r}
        """))
    return str(site)


_PROGRAM = """
import keras
import numpy as np
import torch.distributed.tensor
import keras_dtensor_mixfix as mf
from keras_dtensor_mixfix import _autoload, keras_integration
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
model.compile(optimizer="adam", loss="mse")
model.fit(np.ones((4, 3), "float32"), np.zeros((4, 2), "float32"), verbose=0)
print("keras", _autoload.keras_state)
print("installed", keras_integration.is_installed())
print("patched", mf.is_patched())
"""


def _run(tmp_path, version: str, **env: str) -> subprocess.CompletedProcess:
    environ = {name: value for name, value in os.environ.items() if name != "KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_KERAS"}
    environ.update(KERAS_DTENSOR_MIXFIX="1", KERAS_BACKEND="torch",
                   PYTHONPATH=os.pathsep.join(filter(None, [_site(tmp_path, version), os.environ.get("PYTHONPATH")])))
    environ.update(env)
    return subprocess.run([sys.executable, "-c", _PROGRAM], capture_output=True, text=True, env=environ, timeout=300)


@pytest.mark.parametrize("version", [OLDER, NEWER])
def test_auto_activation_on_an_unsupported_keras_says_one_line_and_keeps_torch_promotion(tmp_path, version):
    result = _run(tmp_path, version)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [f"keras_dtensor_mixfix: {keras_gate.unsupported_reason(version)}"], result.stderr
    assert f"keras off: {keras_gate.unsupported_reason(version)}" in result.stdout
    assert "installed False" in result.stdout
    assert "patched True" in result.stdout  # the torch side is the torch gate's alone


def test_auto_activation_on_another_backend_says_nothing_whatever_the_keras(tmp_path):
    # Keras' jax and numpy backends both import jax (CI's keras_hub environment has it)
    pytest.importorskip("jax", reason="no other Keras backend here: Keras' jax and numpy backends need jax")
    result = _run(tmp_path, OLDER, KERAS_BACKEND="jax")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr.strip() == ""
    # Keras imports no torch backend module there, so auto-activation never even reaches the gate
    assert "keras not installed\n" in result.stdout and "installed False" in result.stdout


def test_auto_activation_on_a_newer_keras_opted_in_installs_with_one_line(tmp_path):
    result = _run(tmp_path, NEWER, KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_KERAS="1")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Keras self-check passed" in lines[0], result.stderr
    assert "KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_KERAS=1" in lines[0]
    assert "keras installed" in result.stdout and "installed True" in result.stdout
