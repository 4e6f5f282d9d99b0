"""Auto-activation through the torch.backends entry point, environment configuration, rule packs, CLI."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

from keras_dtensor_mixfix._torch import versions as _versions  # imports no torch

WORLD_ONE = textwrap.dedent(
    """
    import socket, torch, torch.distributed as dist
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    """
)


def _python(code: str, env_overrides: dict | None = None, extra_path: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERAS_DTENSOR_MIXFIX")}
    env["GLOO_SOCKET_IFNAME"] = "lo"
    if extra_path:
        env["PYTHONPATH"] = extra_path + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_overrides or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=300)


def _ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout


# --------------------------------------------------------------------------- auto-activation


def test_import_torch_activates_lazily_without_importing_torch_distributed():
    out = _ok(_python(
        """
        import sys, torch
        from keras_dtensor_mixfix import _autoload
        print("dist_tensor_imported", "torch.distributed.tensor" in sys.modules)
        print("state", _autoload.state)
        import keras_dtensor_mixfix as mf
        print("patched_before", mf.is_patched())
        import torch.distributed.tensor
        print("patched_after", mf.is_patched())
        print("state", _autoload.state)
        print("compile_stack_imported", sorted({name for name in sys.modules
                                                if name.startswith(("torch._dynamo", "torch._inductor"))}))
        """
    ))
    assert "dist_tensor_imported False" in out
    assert "state waiting for the first import of torch.distributed.tensor" in out
    assert "patched_before False" in out and "patched_after True" in out
    assert "state patched when torch.distributed.tensor was imported" in out
    # as importing DTensor alone does: TorchDynamo and inductor wait for the program's first torch.compile
    assert "compile_stack_imported []" in out


def test_the_first_compilation_that_promotes_in_a_process_stays_out_of_the_compile_cache():
    """The guard that keeps graphs traced with a promotion out of AOTAutograd's cache is put in place by the first
    such compilation (the cache's module was not imported when auto-activation patched), before it saves."""
    out = _ok(_python(WORLD_ONE + textwrap.dedent(
        """
        import json, sys
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        import keras_dtensor_mixfix as mf
        before = "torch._functorch._aot_autograd.autograd_cache" in sys.modules
        from torch._dynamo.utils import counters
        from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
        original = vars(AOTAutogradCache)["save"]
        mesh = init_device_mesh("cpu", (1,))
        weight = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]).requires_grad_()
        step = torch.compile(lambda a, b: (a * b).sin().sum(), backend="inductor")
        value = step(weight, torch.full((4, 4), 2.0))
        value.backward()
        guarded = vars(AOTAutogradCache)["save"] is not original
        mf.unpatch()
        print(json.dumps(dict(patched_without_the_cache_module=not before, guarded=guarded,
                              restored=vars(AOTAutogradCache)["save"] is original, value=value.item(),
                              counters=dict(counters["aot_autograd"]))))
        """)))
    found = json.loads(out.strip().splitlines()[-1])
    assert found["patched_without_the_cache_module"] and found["guarded"] and found["restored"], found
    assert abs(found["value"] - 16 * math.sin(2.0)) < 1e-5, found
    assert found["counters"].get("autograd_cache_miss") == 1 and "autograd_cache_saved" not in found["counters"], found


# Auto-activation on another torch: the version string the gate reads is replaced before `import torch`
# (importing the versions module imports no torch), and a changed torch by replacing one self-check.
_SIMULATED_TORCH = """
import dataclasses, sys
import keras_dtensor_mixfix._torch.versions as versions
versions.running_torch_version = lambda: sys.argv[1]     # the torch release the gate sees
if len(sys.argv) > 2:                                    # a torch on which this self-check fails
    from keras_dtensor_mixfix._torch import selfcheck
    def fails(probe):
        raise AssertionError("simulated: this torch changed it")
    selfcheck.CHECKS[sys.argv[2]] = dataclasses.replace(selfcheck.CHECKS[sys.argv[2]], run=fails)
import torch
print("dtensor_imported_by_import_torch", "torch.distributed.tensor" in sys.modules)
import torch.distributed.tensor  # auto-activation patches here, if it may
import keras_dtensor_mixfix as mf
from keras_dtensor_mixfix import _autoload
print("patched", mf.is_patched())
print("state", _autoload.state)
try:
    mf.unpatch(); mf.patch()
    print("patch() patched", mf.is_patched())
except mf.UnsupportedTorchError as exc:
    print("patch() raised", exc)
"""


# Derived from the range, so that these tests hold wherever it moves (tools/newest_torch.sh moves it).
NEWER = f"{_versions.NEWEST_TORCH[0]}.{_versions.NEWEST_TORCH[1] + 1}.0"
OLDER = f"{_versions.OLDEST_TORCH[0]}.{_versions.OLDEST_TORCH[1] - 1}.0"
RANGE = _versions.supported_range()


def _simulated(version: str, *failing_check: str, allow_newer: str | None = None) -> subprocess.CompletedProcess:
    env = {"KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_TORCH": allow_newer} if allow_newer is not None else {}
    return subprocess.run([sys.executable, "-c", _SIMULATED_TORCH, version, *failing_check], capture_output=True,
                          text=True, timeout=300,
                          env={**{k: v for k, v in os.environ.items() if not k.startswith("KERAS_DTENSOR_MIXFIX")},
                               **env})


@pytest.mark.parametrize("version, allow_newer", [(NEWER, None), (NEWER, "0"), (OLDER, "1"), ("1.13.1", None)])
def test_a_torch_outside_the_supported_range_stays_unpatched_with_one_log_line(version, allow_newer):
    result = _simulated(version, allow_newer=allow_newer)
    out = _ok(result)
    assert "dtensor_imported_by_import_torch False" in out
    assert "patched False" in out
    assert f"state off: torch {version} is outside the supported range ({RANGE})" in out
    assert f"patch() raised keras_dtensor_mixfix.patch(): torch {version} is outside the supported range" in out
    hint = "KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_TORCH=1 or call patch(allow_newer_torch=True)"
    assert (hint in out) == (version == NEWER), out  # only a newer torch may be opted into
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "auto-activation is off" in lines[0], result.stderr


def test_a_newer_torch_with_the_opt_in_and_a_passing_self_check_activates_with_one_warning_line():
    result = _simulated(NEWER, allow_newer="1")
    out = _ok(result)
    assert "dtensor_imported_by_import_torch False" in out  # the self-check waited for DTensor's import
    assert "patched True" in out and "state patched when torch.distributed.tensor was imported" in out
    assert "patch() patched True" in out
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert f"torch {NEWER} is newer than the newest tested release ({RANGE}); opted in with " \
           "KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_TORCH=1, and the self-check passed" in lines[0]


def test_a_newer_torch_with_the_opt_in_and_a_failing_self_check_stays_off_naming_the_check():
    result = _simulated(NEWER, "rule_before_fast_path", allow_newer="1")
    out = _ok(result)  # `import torch` and DTensor's import never break
    assert "patched False" in out and f"state off: torch {NEWER} is newer than the newest tested release" in out
    assert f"patch() raised keras_dtensor_mixfix.patch(): torch {NEWER} is newer" in out
    assert out.count("check 'rule_before_fast_path'") == 2 and "simulated: this torch changed it" in out
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "auto-activation is off" in lines[0] and "check 'rule_before_fast_path'" in lines[0], \
        result.stderr


@pytest.mark.parametrize("torch_first", [False, True])
def test_readme_quick_start_patches_silently_in_a_fresh_process(torch_first):
    result = _python(("import torch\n" if torch_first else "") + textwrap.dedent(
        """
        import keras_dtensor_mixfix
        keras_dtensor_mixfix.patch()
        from keras_dtensor_mixfix import _autoload
        print("patched", keras_dtensor_mixfix.is_patched(), _autoload.state)
        """
    ))
    assert "patched True" in _ok(result)
    assert result.stderr == ""


@pytest.mark.parametrize("enabled", ["1", "0"])
def test_a_patched_block_that_first_imports_dtensor_ends_in_the_configured_state(enabled):
    result = _python(
        """
        import sys, torch
        import keras_dtensor_mixfix as mf
        assert "torch.distributed.tensor" not in sys.modules
        with mf.patched(default="local"):
            print("inside", mf.is_patched(), mf.current_options().default)
        print("after", mf.is_patched(), mf.current_options().default)
        """,
        {"KERAS_DTENSOR_MIXFIX": enabled},
    )
    out = _ok(result)
    assert "inside True local" in out
    # auto-activation would have patched at DTensor's first import: it does once the block ends
    assert f"after {enabled == '1'} replicate" in out
    assert result.stderr == ""


def test_mixed_op_works_with_nothing_but_the_installed_package():
    out = _ok(_python(WORLD_ONE + textwrap.dedent(
        """
        from torch.distributed.tensor import distribute_tensor, Shard
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (1,))
        w, x = torch.randn(4, 3), torch.randn(4, 3)
        y = distribute_tensor(w, mesh, [Shard(0)]) * x
        print("equal", torch.equal(y.full_tensor(), w * x))
        """
    )))
    assert "equal True" in out


def test_activation_when_dtensor_is_already_imported_patches_at_once():
    out = _ok(_python(
        """
        import torch.distributed.tensor
        import keras_dtensor_mixfix as mf
        from keras_dtensor_mixfix._autoload import activate
        print("before", mf.is_patched())
        activate()
        print("after", mf.is_patched())
        """,
        {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
    ))
    assert "before False" in out and "after True" in out


def test_environment_turns_auto_activation_off():
    # one fresh process for the path from the environment to the import (each costs seconds of torch import); every
    # spelling of "off" through the same reader, here
    from keras_dtensor_mixfix._rules import env

    for value in ("0", "false", "off", "no", " OFF "):
        assert env.auto_activation_enabled({"KERAS_DTENSOR_MIXFIX": value}) is False, value
    out = _ok(_python(
        """
        import torch, torch.distributed.tensor, keras_dtensor_mixfix as mf
        from keras_dtensor_mixfix import _autoload
        print("patched", mf.is_patched(), "|", _autoload.state)
        """,
        {"KERAS_DTENSOR_MIXFIX": "no"},
    ))
    assert "patched False | disabled by KERAS_DTENSOR_MIXFIX" in out


def test_torch_backend_autoload_off_means_no_activation():
    out = _ok(_python(
        "import torch, torch.distributed.tensor, keras_dtensor_mixfix as mf; print('patched', mf.is_patched())",
        {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
    ))
    assert "patched False" in out


def test_environment_sets_patch_options():
    out = _ok(_python(
        """
        import torch, torch.distributed.tensor, keras_dtensor_mixfix as mf
        o = mf.current_options()
        print("default", o.default, "plain_grads", o.plain_grads, "direct", o.direct)
        mf.unpatch(); mf.patch(default="error")  # explicit options win over the environment
        print("explicit", mf.current_options().default, mf.current_options().plain_grads)
        """,
        {"KERAS_DTENSOR_MIXFIX_DEFAULT": "local", "KERAS_DTENSOR_MIXFIX_PLAIN_GRADS": "off",
         "KERAS_DTENSOR_MIXFIX_DIRECT": "0"},
    ))
    assert "default local plain_grads False direct False" in out
    assert "explicit error False" in out


MALFORMED = {
    "KERAS_DTENSOR_MIXFIX_DEFAULT": ("sideways", "ignoring KERAS_DTENSOR_MIXFIX_DEFAULT='sideways'"),
    "KERAS_DTENSOR_MIXFIX_PLAIN_GRADS": ("maybe", "ignoring KERAS_DTENSOR_MIXFIX_PLAIN_GRADS='maybe'"),
    "KERAS_DTENSOR_MIXFIX_DEFUALT": ("local", "unknown variable KERAS_DTENSOR_MIXFIX_DEFUALT"),
    "KERAS_DTENSOR_MIXFIX": ("perhaps", "ignoring KERAS_DTENSOR_MIXFIX='perhaps'"),
}


def test_malformed_environment_warns_falls_back_and_never_breaks_import_torch():
    # every malformed variable at once, in one fresh process: each warns once and falls back on its own
    result = _python(
        """
        import torch, torch.distributed.tensor, keras_dtensor_mixfix as mf
        print("patched", mf.is_patched(), "default", mf.current_options().default)
        mf.unpatch(); mf.patch(); mf.current_options()  # every one of these reads the environment again
        """,
        {name: value for name, (value, _) in MALFORMED.items()},
    )
    out = _ok(result)
    assert "patched True default replicate" in out
    for _, warning in MALFORMED.values():
        assert result.stderr.count(warning) == 1, result.stderr  # once per process, however often it is read
    assert len(result.stderr.splitlines()) == len(MALFORMED), result.stderr


def test_a_malformed_value_warns_once_per_variable_and_value(caplog):
    from keras_dtensor_mixfix._rules import env

    caplog.set_level("WARNING", logger="keras_dtensor_mixfix")
    for _ in range(3):
        env.options_from_env({"KERAS_DTENSOR_MIXFIX_CHECK": "loud-once"})
        env.auto_activation_enabled({"KERAS_DTENSOR_MIXFIX": "perhaps-once"})
    env.options_from_env({"KERAS_DTENSOR_MIXFIX_CHECK": "louder-once"})  # another value is another mistake
    messages = [record.getMessage() for record in caplog.records]
    assert sum("KERAS_DTENSOR_MIXFIX_CHECK='loud-once'" in m for m in messages) == 1, messages
    assert sum("KERAS_DTENSOR_MIXFIX='perhaps-once'" in m and "auto-activation stays on" in m for m in messages) == 1
    assert sum("KERAS_DTENSOR_MIXFIX_CHECK='louder-once'" in m for m in messages) == 1


def test_a_failing_patch_never_breaks_the_import():
    out = _ok(_python(
        """
        import torch
        import keras_dtensor_mixfix._lifecycle.patching as p
        def boom(**options):
            raise RuntimeError("simulated failure")
        p.patch = boom
        import torch.distributed.tensor  # must not raise
        from keras_dtensor_mixfix import _autoload
        print("state", _autoload.state)
        """
    ))
    assert "state failed: RuntimeError: simulated failure" in out


def _simulating_site(root, version: str, failing_check: str = "") -> str:
    """A sitecustomize that simulates another torch in every Python process started with it on PYTHONPATH
    (the self-check may run in a subprocess of its own)."""
    site = root / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(
        f"""
        import dataclasses
        import keras_dtensor_mixfix._torch.versions as versions
        from keras_dtensor_mixfix._torch import selfcheck
        versions.running_torch_version = lambda: {version!r}
        if {failing_check!r}:
            def fails(probe):
                raise AssertionError("simulated: this torch changed it")
            selfcheck.CHECKS[{failing_check!r}] = dataclasses.replace(selfcheck.CHECKS[{failing_check!r}], run=fails)
        """
    ))
    return str(site)


@pytest.mark.parametrize("failing_check", ["", "op_schema"])
def test_a_newer_torch_met_first_by_import_keras_decides_once_with_one_line(tmp_path, failing_check):
    # `import keras` installs the Keras integration from an import hook, while torch is still being imported;
    # the self-check then runs in a subprocess (a half-imported torch._dynamo would fail it for that alone).
    result = _python(
        """
        import keras
        import keras_dtensor_mixfix as mf
        from keras_dtensor_mixfix import _autoload
        from keras_dtensor_mixfix._torch.selfcheck import self_check
        print("patched", mf.is_patched())
        print("keras", _autoload.keras_state)
        print("where", self_check().where)
        """,
        {"KERAS_BACKEND": "torch", "KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_TORCH": "1"},
        extra_path=_simulating_site(tmp_path, NEWER, failing_check),
    )
    out = _ok(result)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "where in a subprocess (this process was still importing torch)" in out
    if failing_check:
        assert "patched False" in out and "keras off: " in out and "check 'op_schema'" in out
        assert "auto-activation is off" in lines[0] and "check 'op_schema'" in lines[0]
    else:
        assert "patched True" in out and "keras installed" in out
        assert "self-check passed" in lines[0] and "so promotion is on" in lines[0]


# --------------------------------------------------------------------------- rule packs


def _install_dummy_packs(root) -> str:
    """A real installed distribution (a .dist-info on sys.path) declaring three packs."""
    site = root / "site"
    site.mkdir()
    (site / "dummy_pack.py").write_text(textwrap.dedent(
        """
        from keras_dtensor_mixfix import hookimpl

        @hookimpl
        def register_rules(register):
            register("aten::mm.default", "local")
            register("aten::bmm", "error")
        """
    ))
    (site / "raising_pack.py").write_text(textwrap.dedent(
        """
        from keras_dtensor_mixfix import hookimpl

        @hookimpl
        def register_rules(register):
            register("aten::addmm.default", "local")
            raise ValueError("pack bug")
        """
    ))
    info = site / "dummy_pack-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dummy-pack\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[keras_dtensor_mixfix]\n"
        "dummy = dummy_pack\n"
        "raising = raising_pack\n"
        "missing = no_such_module_for_mixfix\n"
    )
    return str(site)


PACK_REPORT = """
import logging, torch
logging.basicConfig(level=logging.WARNING)
import keras_dtensor_mixfix as mf
from keras_dtensor_mixfix._rules import packs as _packs
from keras_dtensor_mixfix._rules.registry import registry
mf.patch()
for record in _packs.pack_records():
    print("pack", record.name, record.status, len(record.rules))
for entry in registry.entries():
    print("rule", entry.op, entry.rule if isinstance(entry.rule, str) else "callable", entry.source)
mf.unpatch(); mf.patch()
print("records_after_repatch", len(_packs.pack_records()))
"""


def test_rule_packs_from_an_installed_distribution(tmp_path):
    result = _python(PACK_REPORT, {"KERAS_DTENSOR_MIXFIX": "0"}, extra_path=_install_dummy_packs(tmp_path))
    out = _ok(result)
    from keras_dtensor_mixfix._rules.builtin_pack import (KNOWN_WRONG_IN_DTENSOR, KNOWN_WRONG_ON_RELEASES_WITH,
                                                          PARAMETER_OPS)

    rules = set(PARAMETER_OPS) | set(KNOWN_WRONG_IN_DTENSOR) | set(KNOWN_WRONG_ON_RELEASES_WITH)
    assert f"pack builtin loaded {len(rules)}" in out  # one rule per op
    assert "pack dummy loaded 2" in out
    assert "rule aten::mm.default local pack:dummy" in out and "rule aten::bmm error pack:dummy" in out
    # a pack that raises is skipped with nothing half-registered; one that fails to import is skipped
    assert "pack raising failed 0" in out and "aten::addmm" not in out
    assert "pack missing failed 0" in out
    assert "rule pack 'raising' raised while registering" in result.stderr
    assert "rule pack 'missing' failed to load" in result.stderr
    assert "rule aten::native_layer_norm callable pack:builtin" in out
    assert "records_after_repatch 4" in out  # loaded once


def test_rule_packs_disabled_by_environment(tmp_path):
    out = _ok(_python(PACK_REPORT, {"KERAS_DTENSOR_MIXFIX": "0", "KERAS_DTENSOR_MIXFIX_DISABLE_PACKS": "dummy,builtin"},
                      extra_path=_install_dummy_packs(tmp_path)))
    assert "pack dummy disabled 0" in out and "pack builtin disabled 0" in out
    assert "pack:dummy" not in out and "pack:builtin" not in out


# --------------------------------------------------------------------------- command line


@pytest.fixture(scope="module")
def doctor_output():
    """``doctor``'s report in a fresh process that imported ``torch.distributed.tensor`` first (so auto-activation
    has patched), with an option from the environment: the doctor tests share it (each run costs seconds)."""
    return _ok(_python(
        "import torch.distributed.tensor, sys; from keras_dtensor_mixfix._cli import main; sys.exit(main(['doctor']))",
        {"KERAS_DTENSOR_MIXFIX_DEFAULT": "local"},
    ))


def test_doctor_reports_versions_mechanism_activation_options_packs_and_rules(doctor_output):
    out = doctor_output
    for needle in ["keras_dtensor_mixfix 0.1.0", "torch 2.", "keras 3.", "mechanism: torch_dispatch_rules",
                   "torch.backends entry point installed: yes", "state:",
                   "default = 'local'  (from KERAS_DTENSOR_MIXFIX_DEFAULT)",
                   "builtin [loaded]", "aten::native_layer_norm", "from pack:builtin"]:
        assert needle in out, (needle, out)


def test_doctor_prints_every_self_check_and_fails_when_one_fails(doctor_output):
    from keras_dtensor_mixfix._torch.selfcheck import CHECKS

    out = doctor_output
    assert "torch version gate" in out and f"supported ({RANGE})" in out
    assert "self-check of the torch internals the package relies on (in this process, on a gloo world of one)" in out
    for name in CHECKS:
        assert f"  ok   {name}: " in out, (name, out)
    assert f"self-check passed ({len(CHECKS)} checks of torch internals" in out
    assert "live: yes" in out  # run while patched, it left the patch alone
    failing = _python(
        """
        import dataclasses, sys
        import keras_dtensor_mixfix._torch.versions as versions
        versions.running_torch_version = lambda: "%s"
        from keras_dtensor_mixfix._torch import selfcheck
        def fails(probe):
            raise AssertionError("simulated: this torch changed it")
        selfcheck.CHECKS["op_schema"] = dataclasses.replace(selfcheck.CHECKS["op_schema"], run=fails)
        from keras_dtensor_mixfix._cli import main
        sys.exit(main(["doctor"]))
        """ % NEWER,
        {"KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_TORCH": "1"},
    )
    assert failing.returncode == 1, failing.stdout + failing.stderr
    assert f"torch {NEWER}: newer than the newest tested release ({RANGE})" in failing.stdout
    assert "KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_TORCH=1 -> allowed if the self-check below passes" in failing.stdout
    assert "  FAIL op_schema: AssertionError: simulated: this torch changed it" in failing.stdout
    assert "  ok   rule_before_fast_path" in failing.stdout
    assert f"state: off: torch {NEWER} is newer" in failing.stdout


def test_help_answers_without_importing_torch_under_both_names():
    import sysconfig

    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "keras_dtensor_mixfix", "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "{doctor,demo}" in result.stdout, result.stdout + result.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line]
    assert "keras_dtensor_mixfix._cli" in imported
    assert not [name for name in imported if name.split(".")[0] in ("torch", "keras", "numpy")], imported
    script = os.path.join(sysconfig.get_path("scripts"), "keras-dtensor-mixfix")
    result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("usage: keras-dtensor-mixfix "), result.stdout


def test_doctor_shows_the_live_patch(doctor_output):
    out = doctor_output
    assert ("live: yes" in out and "ops hooked" in out
            and "state: patched when torch.distributed.tensor was imported" in out)


def test_demo_shows_the_error_then_the_reference_result(tmp_path):
    # Isolated from the user's configuration: an installed pack that reads aten::mm's operand as
    # "local" and a default rule of "error" would both make the demo's computation fail.
    site = tmp_path / "site"
    site.mkdir()
    (site / "mm_local_pack.py").write_text(
        "from keras_dtensor_mixfix import hookimpl\n\n"
        "@hookimpl\ndef register_rules(register):\n    register('aten::mm', 'local')\n"
    )
    (site / "mm_local_pack-1.0.dist-info").mkdir()
    (site / "mm_local_pack-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: mm-local-pack\nVersion: 1.0\n")
    (site / "mm_local_pack-1.0.dist-info" / "entry_points.txt").write_text(
        "[keras_dtensor_mixfix]\nmm_local = mm_local_pack\n")
    env = dict(os.environ, PYTHONPATH=str(site) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               KERAS_DTENSOR_MIXFIX_DEFAULT="error")
    result = subprocess.run([sys.executable, "-m", "keras_dtensor_mixfix", "demo"], capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "installed rule packs and KERAS_DTENSOR_MIXFIX_* settings are not used" in result.stdout
    assert "got mixed torch.Tensor and DTensor" in result.stdout
    assert result.stdout.count("-> OK") == 2
    assert "aten::mm.default -> replicate" in result.stdout
    assert "values and gradients equal the single-process reference" in result.stdout


# --------------------------------------------------------------------------- stats and logging


def stats_and_first_promotion_log(world_size):
    import logging

    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    import keras_dtensor_mixfix as mf
    from keras_dtensor_mixfix.testing import mesh

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("keras_dtensor_mixfix")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        dw = distribute_tensor(torch.ones(4, 2), mesh(), [Shard(0)])
        with mf.patched():
            for _ in range(3):
                dw * torch.ones(4, 2)
            dw + torch.ones(4, 2)
            first = mf.stats()
            mf.reset_stats()
            dw * torch.ones(4, 2)
            after_reset = mf.stats()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    messages = [r.getMessage() for r in records if "promoted plain operand" in r.getMessage()]
    return first, after_reset, messages


def test_stats_count_per_op_and_decision_and_the_first_promotion_is_logged():
    from keras_dtensor_mixfix.testing import run_on_ranks

    first, after_reset, messages = run_on_ranks(stats_and_first_promotion_log, 2, world_size=2)[0]
    assert first == {"aten::mul.Tensor": {"replicate": 3}, "aten::add.Tensor": {"replicate": 1}}
    assert after_reset == {"aten::mul.Tensor": {"replicate": 1}}
    mul_logs = [m for m in messages if "aten::mul.Tensor" in m]
    assert len(mul_logs) == 2  # once per op, and again after reset_stats()
