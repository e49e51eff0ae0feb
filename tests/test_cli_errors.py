"""A bad command line is ONE stderr line ``dsv4lab <cmd>: <message>`` and a non-zero exit, never a
traceback (issue 20); the wrapper is :func:`dsv4lab.cli.dispatch`."""
from __future__ import annotations

import shutil

import pytest

from dsv4lab.__main__ import main
from dsv4lab.checkpoint.locate import TINY_DIR


def _one_line(capsys, cmd: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"dsv4lab {cmd}: "), err
    return err


def _exit_status(argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse-level refusals exit through SystemExit
        return e.code


def test_report_only_unknown_lists_the_valid_ones(capsys):
    assert _exit_status(["report", "--only", "99"]) == 2
    err = _one_line(capsys, "report")
    assert "--only 99" in err and "01_load_and_inspect" in err and "07_nightly_regression" in err


def test_report_bad_model_path(capsys, tmp_path):
    assert _exit_status(["report", "--only", "05", "--model", str(tmp_path / "missing"), "--out",
                         str(tmp_path / "r")]) == 2
    assert "--model" in _one_line(capsys, "report")


def test_decode_check_missing_checkpoint(capsys, tmp_path):
    assert _exit_status(["decode-check", "--model", str(tmp_path / "missing"), "--steps", "2"]) == 2
    assert "missing" in _one_line(capsys, "decode-check")


def test_decode_check_truncated_checkpoint(capsys, tmp_path):
    ckpt = tmp_path / "truncated"
    ckpt.mkdir()
    shutil.copy(TINY_DIR / "config.json", ckpt / "config.json")
    data = (TINY_DIR / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert _exit_status(["decode-check", "--model", str(ckpt), "--steps", "2"]) == 2
    assert "model.safetensors" in _one_line(capsys, "decode-check")


@pytest.mark.parametrize("steps", ["-1", "0", "x"])
def test_decode_check_steps_must_be_positive(capsys, steps):
    assert _exit_status(["decode-check", "--steps", steps]) == 2
    err = _one_line(capsys, "decode-check")
    assert "--steps" in err and "positive integer" in err


def test_bugzoo_unknown_bug(capsys):
    assert _exit_status(["bugzoo", "--bugs", "sink_scaledd"]) == 2
    err = _one_line(capsys, "bugzoo")
    assert "--bugs='sink_scaledd'" in err and "did you mean 'sink_scaled'" in err


def test_version(capsys):
    import dsv4lab

    assert _exit_status(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"dsv4lab {dsv4lab.__version__}"
    assert dsv4lab.__version__ and dsv4lab.__version__ != "0+unknown"  # installed editable: the metadata's
