"""``python -m keras_dtensor_mixfix doctor|demo`` (also installed as the ``keras-dtensor-mixfix`` command).

torch is imported by the commands, not by this module: ``--help`` and a mistyped command answer
at once, without waiting for torch's import.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Optional, TextIO, cast

SCRIPT = "keras-dtensor-mixfix"


def _write(out: TextIO, text: str = "") -> None:
    out.write(text + "\n")


def _describe_rule(rule: Any) -> str:
    if isinstance(rule, str):
        return repr(rule)
    name = getattr(rule, "__qualname__", None)
    return f"{getattr(rule, '__module__', '?')}.{name}" if name else repr(rule)


# --------------------------------------------------------------------------- doctor


def doctor(out: TextIO = sys.stdout) -> int:
    import torch

    import keras_dtensor_mixfix as mf

    from . import _autoload
    from ._rules import env as _env

    # DTensor first: its import runs auto-activation, which imports the lifecycle modules itself;
    # importing intercept first would leave it half-initialized when that happens.
    import torch.distributed.tensor

    from ._lifecycle import intercept as _intercept
    from ._lifecycle.patching import interceptor
    from ._rules import packs as _packs

    _write(out, f"keras_dtensor_mixfix {mf.__version__}")
    _write(out, f"python {sys.version.split()[0]}; torch {torch.__version__}; {_keras_version()}")

    _write(out, "\ninterception")
    available = hasattr(torch.library, "register_torch_dispatch")
    _write(out, f"  mechanism: {_intercept.MECHANISM}: {_intercept.MECHANISM_DESCRIPTION}")
    _write(out, f"  available on this torch: {'yes' if available else 'no (needs torch >= 2.5)'}")
    _write(out, "  why: since torch 2.10 base DTensor ops run through a C++ fast path that raises the mixed-operand "
                "error itself, so wrapping DTensor.__torch_dispatch__ intercepts nothing; per-op dispatch rules are "
                "consulted before that path")
    installed = interceptor()
    if installed is None:
        _write(out, "  live: no (not patched)")
    else:
        live = installed.owns("aten::mul.Tensor")
        _write(out, f"  live: {'yes' if live else 'NO'} ({installed.hooked_ops} ops hooked; "
                    f"our rule on aten::mul.Tensor: {'present' if live else 'missing'})")
        for qualname, why in sorted(installed.skipped.items())[:10]:
            _write(out, f"  skipped {qualname}: {why}")

    self_check_ok = _doctor_torch(out)
    keras_ok = _doctor_keras(out)

    _write(out, "\nauto-activation")
    _write(out, f"  torch.backends entry point installed: {'yes' if _entry_point_installed() else 'no'}")
    _write(out, f"  {_env.ENABLE}={os.environ.get(_env.ENABLE, '<unset>')} -> "
                f"{'enabled' if _env.auto_activation_enabled() else 'disabled'}")
    _write(out, f"  TORCH_DEVICE_BACKEND_AUTOLOAD={os.environ.get('TORCH_DEVICE_BACKEND_AUTOLOAD', '<unset>')}")
    _write(out, f"  state: {_autoload.state}")

    options, sources = _env.options_from_env()
    effective = mf.current_options()
    _write(out, "\noptions (effective)")
    for name, value in effective.as_dict().items():
        origin = (f"from {sources[name]}" if name in sources
                  else "default" if getattr(options, name) == value else "set by patch()")
        shown = _describe_rule(value) if name == "default" else repr(value)
        _write(out, f"  {name} = {shown}  ({origin})")

    _write(out, "\nrule packs")
    for record in _packs.load_packs():
        extra = f": {record.error}" if record.error else f", {len(record.rules)} rule(s)"
        _write(out, f"  {record.name} [{record.status}] from {record.origin}{extra}")

    _doctor_rules(out)
    return 0 if self_check_ok and keras_ok else 1


def _doctor_rules(out: TextIO) -> None:
    """Every registered rule, newest last, with its source; a rule for an op no library has defined yet says so."""
    from ._rules.registry import registry

    _write(out, "\nrules (newest last; the newest for an op wins)")
    registry.resolve_pending()
    entries = registry.entries()
    if not entries:
        _write(out, "  none")
    for entry in entries:
        pending = "  (pending: no such op is defined yet; applies once one is)" if entry.pending else ""
        _write(out, f"  {entry.op:45s} {_describe_rule(entry.rule):60s} from {entry.source}{pending}")


def _doctor_torch(out: TextIO) -> bool:
    """The version gate's answer for this torch and every self-check; returns whether the self-check passed."""
    from ._lifecycle.torch_gate import opted_in
    from ._rules.env import ALLOW_NEWER_TORCH
    from ._torch import versions
    from ._torch.selfcheck import self_check

    version = versions.running_torch_version()
    kind = versions.classify(version)
    _write(out, "\ntorch version gate")
    if kind == versions.SUPPORTED:
        _write(out, f"  torch {version}: supported ({versions.supported_range()})")
    elif kind == versions.NEWER:
        allowed = opted_in()
        _write(out, f"  torch {version}: newer than the newest tested release ({versions.supported_range()})")
        _write(out, f"  {ALLOW_NEWER_TORCH}={os.environ.get(ALLOW_NEWER_TORCH, '<unset>')} -> "
                    + ("allowed if the self-check below passes" if allowed else
                       "refused (set it to 1, or call patch(allow_newer_torch=True), to run on it if the self-check "
                       "below passes)"))
    else:
        _write(out, f"  torch {version}: not supported: {versions.unsupported_reason(version)}")
    report = self_check()
    _write(out, f"\nself-check of the torch internals the package relies on ({report.where})")
    for result in report.results:
        _write(out, f"  {'ok  ' if result.ok else 'FAIL'} {result.name}: {result.detail}")
    _write(out, f"  {report.summary()}")
    return report.ok


def _keras_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for distribution in ("keras", "keras-nightly"):
        try:
            return f"{distribution} {version(distribution)} (backend {os.environ.get('KERAS_BACKEND', 'default')})"
        except PackageNotFoundError:
            continue
    return "keras not installed"


def _doctor_keras(out: TextIO) -> bool:
    """The Keras integration: the gate's answer for the installed Keras, its state, what it installed and every
    Keras self-check; returns False only where a check fails on a Keras the integration would install into."""
    import importlib.util

    from . import _autoload, keras_integration
    from ._keras.boundary import keras_modules
    from ._keras.gate import keras_gate
    from ._keras.gate.selfcheck import self_check
    from ._rules.env import ALLOW_NEWER_KERAS

    _write(out, "\nKeras integration")
    if importlib.util.find_spec("keras") is None:
        _write(out, "  Keras is not installed: nothing to install")
        return True
    try:
        import keras  # noqa: F401 - installs the integration when auto-activation is on
    except Exception as exc:  # noqa: BLE001 - e.g. KERAS_BACKEND names a backend that is not installed
        _write(out, f"  Keras could not be imported: {type(exc).__name__}: {exc} (KERAS_BACKEND="
                    f"{os.environ.get('KERAS_BACKEND', '<unset>')}; the integration needs the torch backend)")
        return True
    version, backend = keras_modules.running_keras_version(), keras_modules.backend_name()
    kind = keras_gate.classify(version)
    _write(out, f"  Keras {version}, backend {backend}")
    if kind == keras_gate.SUPPORTED:
        _write(out, f"  version gate: supported ({keras_gate.supported_releases()})")
    elif kind == keras_gate.NEWER:
        _write(out, f"  version gate: newer than the newest tested release ({keras_gate.supported_releases()}); "
                    f"{ALLOW_NEWER_KERAS}={os.environ.get(ALLOW_NEWER_KERAS, '<unset>')} -> "
                    + ("installs if the self-check below passes" if keras_gate.opted_in() else
                       "not installed (set it to 1 to install if the self-check below passes)"))
    else:
        _write(out, f"  version gate: not supported: {keras_gate.unsupported_reason(version)}")
    state = _autoload.keras_state
    if state == f"off: {keras_gate.unsupported_reason(version)}":
        state = "off (the version gate above)"
    elif state == "not installed" and not keras_integration.is_installed():
        state = "not installed (auto-activation is off; keras_integration.install() installs it)"
    _write(out, f"  auto-activation: {state}")
    for line in keras_integration.report():
        _write(out, f"  installed: {line}")
    if backend != "torch":
        _write(out, "  (the integration is for the torch backend: KERAS_BACKEND=torch; self-check not run)")
        return True
    report = self_check()
    _write(out, f"\nself-check of the Keras internals the integration relies on ({report.where})")
    for result in report.results:
        _write(out, f"  {'ok  ' if result.ok else 'FAIL'} {result.name}: {result.detail}")
    _write(out, f"  {report.summary()}")
    would_install = kind == keras_gate.SUPPORTED or (kind == keras_gate.NEWER and keras_gate.opted_in())
    return report.ok or not would_install


def _entry_point_installed() -> bool:
    from importlib.metadata import entry_points

    return any(ep.value.startswith("keras_dtensor_mixfix") for ep in entry_points(group="torch.backends"))


# --------------------------------------------------------------------------- demo


def demo_rank() -> Dict[str, Any]:
    """Run on each rank: the real error unpatched, the right answer patched, checked against plain torch."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    import keras_dtensor_mixfix as mf
    from keras_dtensor_mixfix.testing import mesh

    while mf.is_patched():  # show torch's own behaviour first, whatever auto-activation did
        mf.unpatch()
    device_mesh = mesh()
    torch.manual_seed(0)
    weight, batch, labels = torch.randn(6, 8), torch.randn(4, 8), torch.randint(0, 6, (4,))
    sharded = distribute_tensor(weight, device_mesh, [Shard(0)]).requires_grad_()
    result: Dict[str, Any] = {}
    try:
        F.linear(batch, sharded)
        result["unpatched"] = "no error"
    except RuntimeError as exc:
        result["unpatched"] = str(exc).split("!")[0] + "!"
    with mf.patched():
        logits = F.linear(batch, sharded)  # plain batch, sharded weight
        loss = F.cross_entropy(logits, labels)  # plain labels
        loss.backward()
        result["stats"] = mf.stats()
    reference_weight = weight.clone().requires_grad_()
    reference = F.cross_entropy(F.linear(batch, reference_weight), labels)
    reference.backward()
    result["loss"] = float(cast(DTensor, loss.detach()).full_tensor())  # a DTensor: the weight's
    result["reference_loss"] = float(reference.detach())
    grad = cast(DTensor, sharded.grad)  # set by backward(), a DTensor as the weight is
    reference_grad = cast(torch.Tensor, reference_weight.grad)  # set by backward()
    result["grad_max_diff"] = float((grad.full_tensor() - reference_grad).abs().max())
    result["placements"] = str(tuple(grad.placements))
    return result


# The demo shows the package as shipped: its worker processes see none of the user's configuration.
# Third-party rule packs are not loaded (a pack that reads aten::mm's operand as "local" would make
# the demo's replicated batch fail), KERAS_DTENSOR_MIXFIX_* options are unset (the demo's patched()
# block uses the defaults) and auto-activation is off (the demo patches itself).
DEMO_ENVIRONMENT = {"KERAS_DTENSOR_MIXFIX": "0", "KERAS_DTENSOR_MIXFIX_DISABLE_PACKS": "*"}


def _demo_environment() -> Dict[str, Optional[str]]:
    """The environment changes that isolate the demo's workers: name -> value (None: unset)."""
    changes: Dict[str, Optional[str]] = {name: None for name in os.environ if name.startswith("KERAS_DTENSOR_MIXFIX")}
    changes.update(DEMO_ENVIRONMENT)
    return changes


def demo(out: TextIO = sys.stdout, world_size: int = 2) -> int:
    from keras_dtensor_mixfix.testing import _Pool

    _write(out, f"starting {world_size} CPU processes (gloo on 127.0.0.1; built-in rules only: installed rule packs "
                "and KERAS_DTENSOR_MIXFIX_* settings are not used)...")
    changes = _demo_environment()
    saved = {name: os.environ.get(name) for name in changes}
    for name, value in changes.items():  # the workers inherit the environment they are started with
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        pool = _Pool(world_size, start_timeout=120.0)  # its own workers, never ones run_on_ranks may have started
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    try:
        results = pool.run(demo_rank, (), {}, timeout=300.0)
    finally:
        pool.close()
    first = results[0]
    _write(out, "\nwithout keras_dtensor_mixfix:")
    _write(out, f"  F.linear(plain_batch, sharded_weight) -> RuntimeError: {first['unpatched']}")
    _write(out, "\nwith keras_dtensor_mixfix.patched():")
    ok = True
    for rank, result in enumerate(results):
        loss_ok = abs(result["loss"] - result["reference_loss"]) <= 1e-5 * max(1.0, abs(result["reference_loss"]))
        grad_ok = result["grad_max_diff"] <= 1e-5
        ok = ok and loss_ok and grad_ok
        _write(out, f"  rank {rank}: loss {result['loss']:.6f} "
                    f"(single-process reference {result['reference_loss']:.6f}), "
                    f"weight grad max diff {result['grad_max_diff']:.1e}, grad placements {result['placements']} "
                    f"-> {'OK' if loss_ok and grad_ok else 'MISMATCH'}")
    _write(out, "\npromoted ops (rank 0): op -> decision: count")
    for op, decisions in sorted(first["stats"].items()):
        _write(out, f"  {op} -> " + ", ".join(f"{kind}: {count}" for kind, count in sorted(decisions.items())))
    _write(out, "\nresult: " + ("values and gradients equal the single-process reference" if ok else "MISMATCH"))
    return 0 if ok else 1


def main(argv: Optional[List[str]] = None) -> int:
    invoked_as_script = os.path.basename(sys.argv[0] if sys.argv else "") == SCRIPT
    parser = argparse.ArgumentParser(prog=SCRIPT if invoked_as_script else "python -m keras_dtensor_mixfix",
                                     description="Diagnostics and a demo for keras_dtensor_mixfix.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("doctor", help="versions, interception mechanism, torch version gate and self-check, "
                                       "auto-activation, options, packs, rules (exit 1 if the self-check fails)")
    demo_parser = commands.add_parser("demo", help="2-process CPU run: the mixed-operand error, then the fix")
    demo_parser.add_argument("--world-size", type=int, default=2, choices=(2, 4))
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return doctor()
    return demo(world_size=args.world_size)
