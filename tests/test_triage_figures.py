"""Chart labels the notebooks show (issue 20: notebook 3 labelled layers "L0.0")."""
from __future__ import annotations

import pytest

pytest.importorskip("plotly")

from dsv4lab.triage.ablation import layer_cos_figure  # noqa: E402


def test_layer_labels_are_integers():
    fig = layer_cos_figure({"w4a4": {"layer_cos": {0.0: 0.99, 1.0: 0.98}}, "bf16": {"layer_cos": {0: 1.0, 1: 1.0}}})
    assert [list(t.x) for t in fig.data] == [["L0", "L1"], ["L0", "L1"]]
