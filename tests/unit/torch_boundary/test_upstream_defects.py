"""The upstream-defect table (``_upstream.DEFECTS``): well formed, and what decides which workarounds are installed."""

from __future__ import annotations

import pathlib
import re

import pytest

from keras_dtensor_mixfix._upstream import DEFECTS, KERAS_RELEASES, TORCH_RELEASES, Defect, Workaround, applies


def _defect(broken, fixed):
    return Defect("d", "torch", "r.py", broken, fixed, Workaround.DOCUMENTED, "docs/rules.md", "s")


def test_one_entry_per_defect_and_per_repro_each_release_listed_once():
    assert len({d.name for d in DEFECTS}) == len(DEFECTS)
    assert len({d.repro for d in DEFECTS}) == len(DEFECTS)
    for defect in DEFECTS:
        assert defect.upstream in ("torch", "keras"), defect.name
        assert not set(defect.broken) & set(defect.fixed), defect.name
        assert defect.broken, f"{defect.name}: a defect no release was seen to have works around nothing"
        supported = TORCH_RELEASES if defect.upstream == "torch" else KERAS_RELEASES
        assert set(defect.fixed) <= set(supported), defect.name


@pytest.mark.parametrize("release, expected", [
    ((2, 11), True), ((2, 13), True),    # listed broken
    ((2, 14), False), ((2, 15), False),  # listed fixed
    ((2, 16), False),                    # newer, unlisted: as the newest listed (fixed)
    ((2, 10), True),                     # older, unlisted: as the oldest listed (broken)
    (None, False),                       # an unreadable version: nothing assumed
])
def test_an_unlisted_release_is_taken_as_the_nearest_listed_one_before_it(release, expected):
    assert _defect(((2, 11), (2, 12), (2, 13)), ((2, 14), (2, 15))).applies(release) is expected


def test_a_defect_still_there_on_the_newest_release_keeps_its_workaround_on_a_newer_one():
    assert _defect(TORCH_RELEASES, ()).applies((2, 16))
    assert not _defect(((2, 14), (2, 15)), ((2, 11), (2, 12), (2, 13))).applies((2, 12))
    assert _defect(((2, 14), (2, 15)), ((2, 11), (2, 12), (2, 13))).applies((2, 16))


def test_the_engine_installs_a_correction_only_where_the_table_says_the_running_torch_has_the_defect():
    import torch

    from keras_dtensor_mixfix._engine.corrections import corrected
    from keras_dtensor_mixfix._torch.versions import release_of

    release = release_of(torch.__version__)
    for op, defect in (("aten::nll_loss_forward.default", "nll_loss_weighted_mean"),
                       ("aten::mse_loss.default", "mse_loss_mean_backward"),
                       ("aten::ne.Tensor", "ne_tensor_without_strategy")):
        installed = corrected(op, lambda *args, **kwargs: None) is not None
        assert installed is applies(defect, release), (op, torch.__version__)


def test_fixed_defects_are_not_worked_around_on_the_releases_that_fixed_them():
    # torch 2.15 fixed the weighted-mean nll_loss (2.14 too) and argmax over a dim split on a 2-D mesh
    assert not applies("nll_loss_weighted_mean", (2, 15)) and not applies("nll_loss_weighted_mean", (2, 14))
    assert not applies("argmax_2d_mesh_one_row_per_rank", (2, 15))
    assert applies("argmax_2d_mesh_one_row_per_rank", (2, 13)) and applies("nll_loss_weighted_mean", (2, 13))


PACKAGE = pathlib.Path(__file__).resolve().parents[3] / "src" / "keras_dtensor_mixfix"
ROOT = PACKAGE.parents[1]

NOT_YET_ASKED = {
    "dynamo_compiles_dtensor_unflatten": "the forked train step runs clearing and backward eagerly, which keeps "
                                         "TorchDynamo from tracing gradient guards too: not a part of its own",
    "keras_layer_compile_no_region_reuse": "the per-block compile, which exists for the compile time too",
}
"""Workarounds (of a kind other than ``documented``) installed without asking the table yet, each with why: the
part of the code that answers the defect is not a unit of its own. Each is installed on every release the table
lists as broken (all of them), so what runs is what the table says; a new entry may not join this list."""


def _sources(where: str) -> str:
    files = [part.strip() for part in where.split(",")]
    return "\n".join((PACKAGE / path).read_text() for path in files if path.endswith(".py"))


def test_every_entry_names_files_that_exist():
    for defect in DEFECTS:
        for part in defect.where.split(","):
            path = part.strip()
            assert path, defect.name
            assert (PACKAGE / path).is_file() or (ROOT / path).is_file(), f"{defect.name}: no file {path}"
        assert (ROOT / "repros" / defect.repro).is_file(), defect.name


def test_every_workaround_asks_the_table_by_name_in_the_module_its_entry_names():
    worked_around = [d for d in DEFECTS if d.workaround is not Workaround.DOCUMENTED]
    assert set(NOT_YET_ASKED) <= {d.name for d in worked_around}
    for defect in worked_around:
        named = f'"{defect.name}"' in _sources(defect.where)
        if defect.name in NOT_YET_ASKED:
            assert not named, f"{defect.name} is asked now: take it off NOT_YET_ASKED"
        else:
            assert named, f"{defect.name}: no module its entry names ({defect.where}) asks the table for it"


def test_every_defect_the_code_asks_for_is_in_the_table():
    asked = set()
    for path in PACKAGE.rglob("*.py"):
        asked |= set(re.findall(r'(?:has_defect|running_release_has|applies)\(\s*"(\w+)"', path.read_text()))
        asked |= set(re.findall(r'^\s*"(\w+)",\s*$', path.read_text(), re.M)) & {d.name for d in DEFECTS}
    assert asked, "the scan found no question to the table"
    assert asked <= {d.name for d in DEFECTS}, asked - {d.name for d in DEFECTS}
    documented = {d.name for d in DEFECTS if d.workaround is Workaround.DOCUMENTED}
    assert not asked & documented, f"a workaround for a defect the table says is only documented: {asked & documented}"
