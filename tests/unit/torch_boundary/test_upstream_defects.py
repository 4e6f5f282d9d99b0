"""The upstream-defect table (``_upstream.DEFECTS``): well formed, and what decides which workarounds are installed."""

from __future__ import annotations

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
