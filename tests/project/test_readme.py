"""Every fenced ```python and ```bash block of the documentation runs as written, in a fresh process.

The documentation is README.md, CONTRIBUTING.md and every ``docs/*.md`` (``DOCS``); a block is tested wherever
it lives, and ``RUN_PER_FILE`` says how many blocks each file runs and checks, so that a file whose blocks lost
their markers, or a page added without its entry, fails instead of testing nothing.

A block runs as it is, with the environment a user has (auto-activation on), and must exit 0 with an
empty stderr; a ```text block marked ``output`` right after it lists lines its stdout must contain. A
marker (an HTML comment on the line before a block) says how a block is run:

- ``<!-- readme-test: ranks=2 -->``: a program for 2 processes, run with ``torchrun --nproc-per-node 2
  --master-addr 127.0.0.1`` (gloo on the loopback);
- `` requires=MODULE`` after a marker's value (``<!-- readme-test: ranks=2 requires=transformers -->``): the block
  needs a package that is not a requirement of this one (an extra); it is skipped, saying so, where ``MODULE``
  is not importable, and carries the pytest marker of that name (``pytest -m transformers`` runs it);
- ``<!-- readme-test: pytest -->``: a test file, run with ``python -m pytest``;
- ``<!-- readme-test: file=PATH -->``: a file of a package (a rule pack): written to a project directory
  that the blocks after it see installed (on ``PYTHONPATH``, with the entry points of a ``pyproject.toml``
  block in a ``.dist-info``, as pip would leave them);
- ``<!-- readme-test: same-as=PATH -->``: the text of a file in this repository (checked identical; that
  file is run by the block that runs it);
- ``<!-- readme-test: part-of=PATH -->``: lines of a file in this repository, in the file's order (checked; the
  file is run by the block that runs it);
- ``<!-- readme-test: skip=REASON -->``: not run (exactly the blocks listed in ``SKIPPED`` below);
- ``<!-- readme-test: output -->`` on a ```text block: lines the previous block's stdout contains;
- ``<!-- readme-test: message=ID -->`` on a ```text block: the first line of a message users see,
  checked against the message the case ``ID`` really produces (docs/troubleshooting.md).

Bash blocks run from the repository root (they name ``examples/...``), python blocks from a temporary
directory. The environment differs from a user's only where a tool would otherwise print to stderr or
collide with a concurrent run: ``OMP_NUM_THREADS=1`` (torchrun warns when it sets it) and a free port for
torchrun (``PET_MASTER_PORT``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
from typing import Any, Dict, List, Optional, Tuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ["README.md", "CONTRIBUTING.md"] + sorted(f"docs/{page.name}" for page in (ROOT / "docs").glob("*.md"))
"""Every file whose blocks are tested, as paths from the repository root."""
TIMEOUT = 300

RUN_PER_FILE = {
    # path: (blocks run, blocks checked in all: run, output, message, same-as, part-of, file)
    "README.md": (2, 6),  # the quick start on 2 ranks, the Keras example; their output, torch's error, 10 lines
    "CONTRIBUTING.md": (0, 0),  # its blocks are CI's commands (skipped here, checked against .ci/run)
    "docs/architecture.md": (0, 0),
    # a derived layout map (Mistral) on 2 ranks; a sharded checkpoint saved and loaded on 2 ranks; Llama3 with the
    # speed rules on 2 ranks; a torchrun restart after a lost rank; their outputs; the README's example
    "docs/keras.md": (4, 9),
    "docs/gpu.md": (0, 0),  # its blocks need a GPU, or run the whole check (tests/project/test_gpu_check.py)
    "docs/performance.md": (0, 0),
    "docs/rules.md": (2, 5),  # register_rule, a rule pack's doctor (its two files and output)
    "docs/testing.md": (3, 5),  # run_on_ranks and its output, the pytest plugin, the rank simulator and its output
    "docs/transformers.md": (2, 4),  # the tensor- and expert-parallel programs (need transformers), their output
    "docs/troubleshooting.md": (1, 15),  # the command line; every message users see
}
"""What each documentation file runs and checks. A block added or removed changes this too."""

SKIPPED = {
    # the whole suite (~35 minutes on 2 cores) as CI runs it on the newest torch, and what changes with torch on
    # the others
    "# on the newest supported torch: everything",
    # installs torch's registry build (several GB; CI keeps the wheels)
    "# the supported torch releases from the registry, as CI installs them (WHEELS: .ci/run's wheel cache)",
    "bash tools/newest_torch.sh",  # asks the registry for its newest torch, downloads it, runs the suite
    # the GPU check: on a CUDA machine with the wheels of tools/gpu_wheels.sh; on CPU (minutes), which
    # tests/project/test_gpu_check.py runs
    "# on the GPU machine: the wheels tools/gpu_wheels.sh made (DIR), then the check",
    "# on CPU, as tests/project/test_gpu_check.py runs it",
    "# the one-command GPU check on CPU, as docs/gpu.md gives it",
    "# CPU only (a laptop, a CPU cluster): torch's CPU wheel index, then this package",  # torch's own index
    # replace Keras with keras-nightly in the environment they run in, then the Keras tests (~6 minutes)
    "# Keras 3.16: keras-nightly installs the same `keras` package under another name, so Keras goes first",
    # installs TensorFlow (1.3 GB, the network), then the TensorBoard callback tests
    'pip install torch==2.13.0 -e ".[test]" keras==3.15.1 tensorflow-cpu tensorboard',
    # installs keras-hub, its tokenizers and jax (the network), then the real-model tests
    "# keras_hub: --no-deps, since keras-hub's own requirements pull in tensorflow (and tensorflow-text)",
    # Qwen3.5's derived maps on (2, 2) (Qwen3.5's alone 409 s on 2 cores; CI runs the other cells)
    'KERAS_BACKEND=torch python -m pytest tests/models/test_keras_hub.py -k "qwen3_5 and derived and 2x2"',
    # 8 ranks of every keras_hub model but Qwen3.5 (its derived cases alone 721 s on 2 cores), and a recipe for two
    # machines
    'KERAS_BACKEND=torch MIXFIX_TEST_MESHES=2x4,4x2 python -m pytest tests/models/test_keras_hub.py '
    '-k "(2x4 or 4x2) and not qwen3_5"',
    # four keras_hub models compiled on (1, 2) and (2, 2) (CI compiles two on (1, 2))
    "KERAS_BACKEND=torch python -m pytest tests/models/test_keras_hub.py -k compiled",
    # every keras_hub model compiled (1203 s on 2 cores)
    'KERAS_BACKEND=torch MIXFIX_TEST_COMPILED_MODELS=all python -m pytest tests/models/test_keras_hub.py '
    '-k "compiled and 1x2"',
    "# on the first machine (its address: MASTER), then the same with --node-rank 1 on the second",
}
"""The first line of every block that is not run. Adding a skip is a decision: it changes this set too."""

_MARKER = re.compile(r"<!--\s*readme-test:\s*([\w-]+)(?:=(.*?))?\s*-->")
_REQUIRES = re.compile(r"\s+requires=([\w.]+(?:,[\w.]+)*)$")
_KNOWN_MARKERS = {"ranks", "pytest", "file", "same-as", "part-of", "skip", "output", "message"}
_SHOWN = ("same-as", "part-of")  # blocks that show (part of) a file of this repository
_NOT_RUN = ("skip", "file") + _SHOWN
_RUN_LANGUAGES = {"python", "bash"}


# torch 2.15's DTensor logs advice (not an error) when it redistributes Partial over two mesh dims with two
# all_reduces, as a Keras ModelParallel step on a (batch, model) mesh does; earlier releases are silent. That
# one advisory line per rank is torch's, not the README's, and is the only stderr a block may print.
_TORCH_REDISTRIBUTE_ADVICE = re.compile(
    r"^\[rank\d+\]:W\d+ [\d:.]+ \d+ torch/distributed/tensor/_redistribute\.py:\d+\] While redistributing from .* "
    r"sequential all_reduce operations will be performed\..*$")


def _without_torch_advice(stderr: str) -> str:
    return "".join(line for line in stderr.splitlines(keepends=True)
                   if not _TORCH_REDISTRIBUTE_ADVICE.match(line.rstrip("\n")))


@dataclasses.dataclass
class Block:
    path: str  # the documentation file it is in, from the repository root
    line: int  # where its opening fence is (1-based)
    language: str
    code: str
    marker: Optional[str] = None
    value: Optional[str] = None
    output: Optional["Block"] = None  # the ```text block of its documented output
    requires: Tuple[str, ...] = ()  # modules it needs beyond this package's requirements (``requires=``)

    @property
    def id(self) -> str:
        first = next((line for line in self.code.splitlines() if line.strip()), "")
        return f"{self.path}:L{self.line}-{self.language}-{re.sub(r'[^A-Za-z0-9]+', '_', first)[:40].strip('_')}"

    @property
    def where(self) -> str:
        return f"{self.path} line {self.line}"

    @property
    def first_line(self) -> str:
        return next((line for line in self.code.splitlines() if line.strip()), "")


def parse(text: str, path: str) -> List[Block]:
    lines = text.splitlines()
    blocks: List[Block] = []
    index = 0
    while index < len(lines):
        fence = re.match(r"^```(\S*)\s*$", lines[index])
        if fence is None:
            index += 1
            continue
        start = index
        index += 1
        body = []
        while not lines[index].startswith("```"):
            body.append(lines[index])
            index += 1
        block = Block(path, start + 1, fence.group(1), "\n".join(body) + "\n")
        before = start - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        if before >= 0:
            found = _MARKER.fullmatch(lines[before].strip())
            if found is not None:
                block.marker, block.value = found.group(1), found.group(2)
                needs = _REQUIRES.search(block.value or "")
                if needs is not None:
                    block.value, block.requires = block.value[:needs.start()], tuple(needs.group(1).split(","))
        blocks.append(block)
        index += 1
    runnable = None
    for block in blocks:
        if block.language in _RUN_LANGUAGES and block.marker not in _NOT_RUN:
            runnable = block
        elif block.marker == "output":
            assert runnable is not None and runnable.output is None, f"{block.where}: output of what?"
            runnable.output = block
    return blocks


BLOCKS = [block for path in DOCS for block in parse((ROOT / path).read_text(), path)]
RUN = [block for block in BLOCKS if block.language in _RUN_LANGUAGES and block.marker not in _NOT_RUN]


def _normalize(text: str) -> str:
    return " ".join(text.split())


def _free_port() -> int:
    from keras_dtensor_mixfix._loopback_ports import free_port as below_the_ephemeral_range  # as rank pools draw

    return below_the_ephemeral_range()


EXIT_ABORT = "terminate called without an active exception"
"""What torch's gloo teardown sometimes prints when a rank aborts at exit after its program finished correctly
(repros/torch_gloo_exit_abort.py: torch 2.12.1 to 2.15.0, no package involved)."""


def _run_past_exit_aborts(command: List[str], fresh: Optional[pathlib.Path] = None,
                          **kwargs: Any) -> "subprocess.CompletedProcess[str]":
    """``subprocess.run(command)``, run again (twice at most) when a rank aborted at exit with ``EXIT_ABORT``:
    torch's flake, not the block's; any other failure is returned at once. Each run again starts with ``fresh`` (the
    block's working directory) emptied but for its script: what the aborted run wrote there (the sharded-checkpoint
    program's ``ckpt/``) made torch warn on stderr that it overwrote a checkpoint."""
    for attempt in range(3):
        if attempt and fresh is not None:
            for entry in fresh.iterdir():
                if entry.is_dir():
                    shutil.rmtree(entry)
                elif entry.name not in ("snippet.py", "test_readme_block.py"):
                    entry.unlink()
        result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, **kwargs)
        if result.returncode == 0 or EXIT_ABORT not in result.stderr:
            break
    return result


def _user_environment(extra_path: Optional[pathlib.Path] = None) -> Dict[str, str]:
    """A user's environment: none of the suite's own settings (conftest turns auto-activation off)."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("KERAS_DTENSOR_MIXFIX", "PYTEST_")) and name not in ("KERAS_BACKEND", "PYTHONPATH")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # python, torchrun, the script
    env["OMP_NUM_THREADS"] = "1"  # else torchrun says on stderr that it sets it
    env["PET_MASTER_PORT"] = str(_free_port())  # torchrun's --master-port default: never collide with another run
    if extra_path is not None:
        env["PYTHONPATH"] = str(extra_path)
    return env


def _install_files(project: pathlib.Path, upto: Block) -> Optional[pathlib.Path]:
    """Write the ``file=`` blocks above ``upto`` (in its file) into ``project`` and "install" it as pip would."""
    files = [block for block in BLOCKS if block.marker == "file" and block.path == upto.path and block.line < upto.line]
    if not files:
        return None
    project.mkdir(exist_ok=True)
    for block in files:
        target = project / block.value
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(block.code)
        if block.value == "pyproject.toml":
            tomllib = pytest.importorskip("tomllib")
            groups = tomllib.loads(block.code)["project"]["entry-points"]
            info = project / "my_pack-1.0.dist-info"
            info.mkdir(exist_ok=True)
            (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-pack\nVersion: 1.0\n")
            (info / "entry_points.txt").write_text("".join(
                f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in entries.items())
                for group, entries in groups.items()))
    return project


def _check_output(block: Block, stdout: str) -> None:
    got = [_normalize(line) for line in stdout.splitlines()]
    for expected in block.output.code.splitlines():
        expected = _normalize(expected)
        if expected and expected != "...":
            assert any(expected in line for line in got), (
                f"{block.output.where}: {expected!r} is not in the output of the block at line "
                f"{block.line}:\n{stdout}")


# --------------------------------------------------------------------------- the blocks themselves


def test_every_block_is_run_or_deliberately_skipped():
    languages = {block.language for block in BLOCKS}
    assert languages <= {"python", "bash", "text", "toml"}, f"fenced blocks of unknown kind: {languages}"
    for block in BLOCKS:
        assert block.language, f"{block.where}: a fence without a language (python, bash, text, toml)"
        assert block.marker is None or block.marker in _KNOWN_MARKERS, (block.where, block.marker)
        if block.language in ("text", "toml"):
            assert block.language == "toml" or block.marker in (None, "output", "message"), block.where
    skipped = [block.first_line for block in BLOCKS if block.language in _RUN_LANGUAGES and block.marker == "skip"]
    assert sorted(skipped) == sorted(SKIPPED)  # each once: a skip's first line names it
    assert all(block.value for block in BLOCKS if block.marker == "skip"), "a skip says why"
    assert len(RUN) >= 7  # the quick start, rules, pack doctor, pytest, CLI, run_on_ranks, the Keras example


def test_each_documentation_file_runs_and_checks_what_it_should():
    assert set(RUN_PER_FILE) == set(DOCS), "a documentation file added or removed: give its counts"
    checked_markers = ("output", "message", "file") + _SHOWN
    found = {path: (sum(block.path == path for block in RUN),
                    sum(block.path == path and (block in RUN or block.marker in checked_markers) for block in BLOCKS))
             for path in DOCS}
    assert found == RUN_PER_FILE


MARKER_OF = {"keras_hub": "models"}
"""The pytest marker of a block that requires a module, where it is not the module's name: a keras_hub program
runs with the real-model tests (``pytest -m models``, in CI's keras_hub environment)."""


def _param(block: Block) -> Any:
    """A block as a test parameter, with the marker of each module it requires (``pytest -m transformers``)."""
    return pytest.param(block, id=block.id,
                        marks=[getattr(pytest.mark, MARKER_OF.get(module, module)) for module in block.requires])


@pytest.mark.parametrize("block", [_param(block) for block in RUN])
def test_block_runs_as_written(block, tmp_path):
    missing = [module for module in block.requires if importlib.util.find_spec(module) is None]
    if missing:
        pytest.skip(f"{block.where} needs {', '.join(missing)}, which is not installed here")
    work = tmp_path / "work"
    work.mkdir()
    env = _user_environment(_install_files(tmp_path / "project", block))
    if block.language == "bash":
        command, cwd = ["bash", "-euo", "pipefail", "-c", block.code], ROOT
    else:
        script = work / ("test_readme_block.py" if block.marker == "pytest" else "snippet.py")
        script.write_text(block.code)
        cwd = work
        if block.marker == "ranks":
            command = ["torchrun", f"--nproc-per-node={int(block.value)}", "--master-addr", "127.0.0.1", str(script)]
        elif block.marker == "pytest":
            command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(script)]
        else:
            command = [sys.executable, str(script)]
    result = _run_past_exit_aborts(command, fresh=work if cwd == work else None, cwd=cwd, env=env)
    where = f"{block.where}:\n{block.code}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, where
    assert _without_torch_advice(result.stderr) == "", where
    if block.output is not None:
        _check_output(block, result.stdout)


CI_RUNS = {
    "# on the newest supported torch: everything",  # README.md, "Test"
    "# the supported torch releases from the registry, as CI installs them (WHEELS: .ci/run's wheel cache)",
    "# Keras 3.16: keras-nightly installs the same `keras` package under another name, so Keras goes first",
    "# keras_hub: --no-deps, since keras-hub's own requirements pull in tensorflow (and tensorflow-text)",
}
"""The first line of every skipped block whose commands ``.ci/run`` runs (each in its own environment)."""


def test_ci_runs_the_commands_the_readme_gives():
    # a subshell's closing parenthesis is not part of its last command
    ci_lines = [line.strip().rstrip(")") for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    blocks = [block for block in BLOCKS if block.marker == "skip" and block.first_line in CI_RUNS]
    assert {block.first_line for block in blocks} == CI_RUNS
    for block in blocks:
        commands = [line.strip() for line in block.code.splitlines() if line.strip() and not line.startswith("#")]
        assert commands, block.where
        # a line of .ci/run, or its end (`.venv-ci/bin/pip install ...`, `... && lint-imports`)
        for command in commands:
            assert any(line == command or line.endswith(" " + command) or line.endswith("/" + command)
                       for line in ci_lines), f"{block.where}: .ci/run does not run {command!r}"
    test_command = next(block for block in blocks if block.first_line == "# on the newest supported torch: everything")
    assert test_command.path == "README.md", "the README gives the test command CI runs"


_CI_SECTION = re.compile(r'\b(README\.md|CONTRIBUTING\.md|docs/[\w.-]+\.md) \(?"([^"]+)"')


def _headings(path: str) -> List[str]:
    text = re.sub(r"^```.*?^```", "", (ROOT / path).read_text(), flags=re.S | re.M)  # not a comment in a block
    return [line.lstrip("#").strip() for line in text.splitlines() if re.match(r"#{1,6} ", line)]


def test_ci_names_sections_that_exist():
    named = _CI_SECTION.findall((ROOT / ".ci" / "run").read_text())
    assert len(named) >= 5, named  # the test command, the three environments' installs and tests
    for path, section in named:
        assert section in _headings(path), f'.ci/run names {path} "{section}", which has no such heading'


def test_blocks_that_show_a_file_show_it_exactly():
    shown = [block for block in BLOCKS if block.marker in _SHOWN]
    assert {block.marker for block in shown} == set(_SHOWN)
    for block in shown:
        source = (ROOT / block.value).read_text()
        if block.marker == "same-as":
            code = re.sub(r'\A""".*?"""\n+', "", source, flags=re.S)  # the file's docstring is not shown
            assert code == block.code, f"{block.where} differs from {block.value}"
        else:
            lines = iter(source.splitlines())  # each shown line, in order: `in` on an iterator consumes it
            missing = [line for line in block.code.splitlines() if line.strip() and line not in lines]
            assert not missing, f"{block.where}: not lines of {block.value} in its order: {missing}"
        assert any(block.value in run.code for run in RUN if run.language == "bash"), f"nothing runs {block.value}"


def test_every_example_script_is_run_by_a_block():
    for script in sorted((ROOT / "examples").glob("*.py")):
        name = f"examples/{script.name}"
        assert any(name in block.code for block in RUN), f"{name} is not run by any documentation block"


# --------------------------------------------------------------------------- Troubleshooting: the real messages

_RANK_CASES = textwrap.dedent(
    """
    import json

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import keras_dtensor_mixfix as mf


    def first_line(fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the message is the result
            return f"{type(exc).__name__}: {exc}".splitlines()[0]
        return "no error"


    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    weight = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
    lib = torch.library.Library("mylib", "DEF")  # a custom op with no DTensor sharding strategy
    lib.define("scale_add(Tensor x, Tensor y) -> Tensor")
    lib.impl("scale_add", lambda x, y: x + 2 * y, "CompositeExplicitAutograd")
    found = {}
    while mf.is_patched():
        mf.unpatch()
    found["unpatched"] = first_line(lambda: weight * torch.ones(4, 4))
    with mf.patched():
        found["local_looking"] = first_line(lambda: weight * torch.ones(2, 4))  # shaped like this rank's rows
        found["no_strategy"] = first_line(lambda: torch.ops.mylib.scale_add(weight, torch.ones(4, 4)))
        other_mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))
        other = distribute_tensor(torch.ones(4, 4), other_mesh, [Replicate(), Shard(0)])
        found["meshes"] = first_line(lambda: torch.addcmul(weight, other, torch.ones(4, 4)))
        lib.define("late_add(Tensor x, Tensor y) -> Tensor")  # an op defined after patch()
        lib.impl("late_add", lambda x, y: x + y, "CompositeExplicitAutograd")
        found["defined_after_patch"] = first_line(lambda: torch.ops.mylib.late_add(weight, torch.ones(4, 4)))
    with mf.patched(check="raise"):
        per_rank = torch.full((4, 4), float(dist.get_rank()))  # each rank's own data, read as "replicate"
        found["check"] = first_line(lambda: weight * per_rank)
    if dist.get_rank() == 0:
        print(json.dumps(found))
    dist.destroy_process_group()
    """
)

_UNSUPPORTED_TORCH = textwrap.dedent(
    """
    import dataclasses, sys
    import keras_dtensor_mixfix._torch.versions as versions
    newer = (versions.NEWEST_TORCH[0], versions.NEWEST_TORCH[1] + 1)
    versions.running_torch_version = lambda: "%d.%d.0" % newer  # the release the gate sees: newer than supported
    if len(sys.argv) > 1:                               # a torch on which this self-check fails
        from keras_dtensor_mixfix._torch import selfcheck
        def fails(probe):
            raise AssertionError("simulated: this torch changed it")
        selfcheck.CHECKS[sys.argv[1]] = dataclasses.replace(selfcheck.CHECKS[sys.argv[1]], run=fails)
    import torch, torch.distributed.tensor  # auto-activation runs here
    import keras_dtensor_mixfix as mf
    try:
        mf.patch()
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}".splitlines()[0])
    """
)


_UNSUPPORTED_KERAS = textwrap.dedent(
    """
    import sys
    import keras_dtensor_mixfix._keras.boundary.keras_modules as keras_modules  # imports no Keras
    keras_modules.running_keras_version = lambda: sys.argv[1]  # the release the Keras gate sees
    import keras  # auto-activation decides here
    """
)


def _packs_that_fail(site: pathlib.Path) -> None:
    site.mkdir()
    (site / "typo_rules.py").write_text(
        "from keras_dtensor_mixfix import hookimpl\n\n"
        "@hookimpl\ndef register_rules(register):\n    register('aten::mmm', 'local')\n")
    for name, target in (("flash", "my_pack.rules"), ("typo", "typo_rules")):
        info = site / f"{name}_pack-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}-pack\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[keras_dtensor_mixfix]\n{name} = {target}\n")


def _real_messages(tmp_path: pathlib.Path) -> Dict[str, str]:
    """Each quoted message as a user's program prints it; the programs are independent, so they run side by side."""
    from keras_dtensor_mixfix._keras.boundary import keras_modules

    script = tmp_path / "cases.py"
    script.write_text(_RANK_CASES)
    _packs_that_fail(tmp_path / "site")
    opted_in = {**_user_environment(), "KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_TORCH": "1"}
    keras_environment = {**_user_environment(), "KERAS_BACKEND": "torch"}
    newest = keras_modules.NEWEST_KERAS

    def python(*arguments: str, env: Dict[str, str]) -> "subprocess.CompletedProcess[str]":
        return subprocess.run([sys.executable, *arguments], env=env, capture_output=True, text=True, timeout=TIMEOUT)

    programs = {
        "ranks": lambda: _run_past_exit_aborts(
            ["torchrun", "--nproc-per-node=2", "--master-addr", "127.0.0.1", str(script)], env=_user_environment(),
            cwd=tmp_path),
        "unsupported_torch": lambda: python("-c", _UNSUPPORTED_TORCH, env=_user_environment()),
        "newer_torch_allowed": lambda: python("-c", _UNSUPPORTED_TORCH, env=opted_in),
        "newer_torch_refused": lambda: python("-c", _UNSUPPORTED_TORCH, "rule_before_fast_path", env=opted_in),
        "older_keras": lambda: python("-c", _UNSUPPORTED_KERAS, "3.11.3", env=keras_environment),
        "newer_keras": lambda: python("-c", _UNSUPPORTED_KERAS, f"{newest[0]}.{newest[1] + 1}.0",
                                      env=keras_environment),
        "packs": lambda: python("-c", "import keras_dtensor_mixfix as mf; mf.patch()",
                                env=_user_environment(tmp_path / "site")),
    }
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(program) for name, program in programs.items()}
        results = {name: future.result() for name, future in futures.items()}

    ranks = results.pop("ranks")
    assert ranks.returncode == 0 and ranks.stderr == "", ranks.stdout + ranks.stderr
    found = json.loads(ranks.stdout.strip().splitlines()[-1])
    unsupported = results.pop("unsupported_torch")
    assert unsupported.returncode == 0, unsupported.stderr
    found["unsupported_torch"] = unsupported.stderr.splitlines()[0]
    found["unsupported_torch_patch"] = unsupported.stdout.splitlines()[0]
    packs = results.pop("packs")
    assert packs.returncode == 0, packs.stderr
    for line in packs.stderr.splitlines():
        if "rule pack 'flash'" in line:
            found["pack_import"] = line
        if "rule pack 'typo'" in line:
            found["pack_raises"] = line
    for case, result in results.items():  # the gates: one line on stderr each
        assert result.returncode == 0 and len(result.stderr.splitlines()) == 1, result.stdout + result.stderr
        found[case] = result.stderr.splitlines()[0]
    return found


def _comparable(text: str) -> str:
    # Version numbers vary with the torch installed and the supported range; the words around them do not.
    return re.sub(r"\d+\.\d+(\.\d+|\.x)?(\+\w+)?", "<version>", _normalize(text))


def test_troubleshooting_quotes_the_messages_users_really_see(tmp_path):
    quoted = [block for block in BLOCKS if block.marker == "message"]
    assert quoted
    real = _real_messages(tmp_path)
    assert {block.value for block in quoted} == set(real), "every case is quoted, and only those"
    for block in quoted:
        expected = _comparable(block.code)
        actual = _comparable(real[block.value])
        if expected.endswith("..."):
            assert actual.startswith(expected[:-3].rstrip()), (block.where, real[block.value])
        else:
            assert actual == expected, f"{block.where} ({block.value}): the message is now\n{real[block.value]}"


def test_ci_states_what_it_proves_not_how_past_runs_went():
    """``.ci/run``'s comments say what each phase proves: no commit, date or run's seconds (fresh-clone timings go in
    BENCHMARKS.md "CI", history in git and CHANGELOG.md)."""
    history = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b|\b20\d\d-\d\d-\d\d\b|\b\d+ s\b")
    found = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
             if line.lstrip().startswith("#") and history.search(line)]
    assert found == [], found
