import re
import sys

import pytest

from knnconv.tools import cli, demo

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_quick_run_writes_the_figure_and_ends_with_the_accuracy(tmp_path, capsys):
    out = tmp_path / "figures" / "digits.png"

    status = cli.main(["demo", "--epochs", "2", "--limit", "150", "--batch-size", "32",
                       "--device", "cpu", "--out", str(out)])

    lines = capsys.readouterr().out.splitlines()
    assert status == 0
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    assert lines[0].startswith("knnconv demo: 120 training and 30 test digits")
    assert sum(line.startswith("epoch ") for line in lines) == 2
    assert f"wrote {out}" in lines
    assert re.fullmatch(r"test accuracy: [01]\.\d{3}", lines[-1])


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--help"])

    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    for option in ("--epochs", "--batch-size", "--seed", "--out", "--device", "--limit"):
        assert option in help_text


def test_limit_below_one_digit_per_test_class_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--limit", str(demo.MIN_DIGITS - 1)])

    assert exit_info.value.code == 2
    assert f"must be >= {demo.MIN_DIGITS}" in capsys.readouterr().err


def test_plain_progress_bar_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes `from tqdm import tqdm` fail
    bar = demo.progress_bar(4, "training")
    assert isinstance(bar, demo.TextProgress)

    for _ in range(4):
        bar.update(1)
    bar.set_postfix_str("epoch 1/1 loss 0.500")
    bar.close()

    drawn = capsys.readouterr().err.split("\r")
    assert drawn[1] == "training [#######.......................]  25% "
    assert drawn[-1] == "training [##############################] 100% epoch 1/1 loss 0.500\n"


def test_a_missing_dependency_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)

    with pytest.raises(SystemExit, match=r"needs scikit-learn: pip install 'knnconv\[demo\]'"):
        demo.require("sklearn.datasets", "scikit-learn")
