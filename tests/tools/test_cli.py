import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from knnconv.ops import TorchCompactOps, registry
from knnconv.tools import cli

SMALL_RUN = ["run", "--device", "cpu", "--batch", "2", "--repeats", "1", "--resolution", "24",
             "--levels", "3", "--channels", "8"]


class OffByTenPercentOps(TorchCompactOps):
    name = "off_by_ten_percent"

    def forward(self, plan, x, weight, bias):
        return super().forward(plan, x, weight, bias) * 1.1


class NaNOnLastGeometryOps(TorchCompactOps):
    """Wrong on one check geometry only, so the worst-of-geometries error must keep the NaN."""

    name = "nan_on_last_geometry"

    def forward(self, plan, x, weight, bias):
        y = super().forward(plan, x, weight, bias)
        return y * math.nan if plan.cin == cli.CHECK_GEOMETRIES[-1][3] else y


@pytest.fixture(params=[OffByTenPercentOps, NaNOnLastGeometryOps])
def broken_backend(request, monkeypatch):
    monkeypatch.setitem(registry._REGISTRY, request.param.name, request.param())
    return request.param.name


def result_rows(output, headers):
    """The table's rows as {header: cell} dicts; every cell is one word, every row as wide
    as the header line."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split() == " ".join(headers).split())
    width = len(lines[start])
    rows = []
    for line in lines[start + 2:]:
        if len(line) != width:
            break
        rows.append(dict(zip(headers, line.split(), strict=True)))
    return rows


def test_check_passes_every_cpu_backend_in_every_dtype(capsys):
    assert cli.main(["check", "--device", "cpu"]) == 0

    output = capsys.readouterr().out
    rows = result_rows(output, cli.CHECK_HEADERS)
    served = {(row["backend"], row["dtype"]) for row in rows}
    assert served >= {(name, dtype) for name in ("reference", "torch_compact", "torch_binned")
                      for dtype in cli.DTYPES}
    assert all(row["result"] == "PASS" for row in rows)
    assert output.rstrip().endswith("all checks passed")


def test_check_warns_about_nothing_it_builds_itself():
    """The check's own geometries (K > Nin among them) are deliberate: no warning may open
    its report."""
    assert any(k > nin for nin, _, k, *_ in cli.CHECK_GEOMETRIES)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli.main(["check", "--device", "cpu", "--dtype", "float64", "--repeats", "1"]) == 0

    assert [str(warning.message) for warning in caught] == []


def test_check_fails_a_wrong_backend(capsys, broken_backend):
    assert cli.main(["check", "--device", "cpu", "--dtype", "float32"]) == 1

    rows = result_rows(capsys.readouterr().out, cli.CHECK_HEADERS)
    results = {row["backend"]: row["result"] for row in rows}
    assert results == {"reference": "PASS", "torch_compact": "PASS", "torch_binned": "PASS",
                       broken_backend: "FAIL"}


def test_run_agrees_with_reference(capsys):
    assert cli.main(SMALL_RUN) == 0

    output = capsys.readouterr().out
    rows = result_rows(output, cli.RUN_HEADERS)
    assert {(row["layer"], row["backend"]) for row in rows} >= {
        (layer, backend) for layer in "01"
        for backend in ("reference", "torch_compact", "torch_binned")}
    assert {(row["layer"], row["k"], row["cin->cout"]) for row in rows} == {("0", "49", "3->8"),
                                                                          ("1", "9", "8->16")}
    assert all(row["result"] == "PASS" for row in rows)
    assert output.rstrip().endswith("all backends agree with the reference")


def test_run_fails_a_wrong_backend(capsys, broken_backend):
    assert cli.main(SMALL_RUN) == 1

    output = capsys.readouterr().out
    assert f"backends disagreeing with the reference: {broken_backend}" in output


def test_run_is_the_default_command(monkeypatch):
    commands = []
    monkeypatch.setattr(cli, "run", lambda args: commands.append(args) or 0)

    assert cli.main([]) == 0

    assert [(args.command, args.batch, args.device) for args in commands] == [("run", 8, "auto")]


def test_python_dash_m_entry_point():
    source = Path(cli.__file__).parents[1]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(source),
                                                              os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "knnconv", "check", "--device", "cpu",
                             "--dtype", "float64", "--repeats", "1"], capture_output=True,
                            text=True, env=environment, timeout=120)

    assert result.returncode == 0, result.stderr
    assert "all checks passed" in result.stdout
