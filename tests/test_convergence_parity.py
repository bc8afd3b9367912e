"""scripts/convergence_parity.py at a tiny size on the CPU: both paths (fovi's own layers run
there through their torch fallback) and both seeds train, and the JSON and PNG are written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fovi.models.knnalexnet")
pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "convergence_parity.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_tiny_cpu_run_writes_both_paths_and_the_summary(tmp_path):
    out = tmp_path / "convergence"
    command = [sys.executable, str(SCRIPT), "--epochs", "1", "--limit", "60", "--batch-size",
               "16", "--in-res", "16", "--features", "8,8", "--seeds", "0,1", "--device", "cpu",
               "--out", str(out)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]

    result = json.loads((out / "convergence_parity.json").read_text())
    assert (out / "convergence_parity.png").read_bytes().startswith(PNG_SIGNATURE)
    assert {"command", "device", "torch", "fovi", "model", "training", "runs",
            "summary"} <= set(result)
    assert result["command"][2:] == command[2:] and result["device"].startswith("cpu")
    assert set(result["runs"]) == {"fovi", "accelerated"}
    for path, by_seed in result["runs"].items():
        assert set(by_seed) == {"0", "1"}
        for run in by_seed.values():
            assert {"loss", "train_accuracy", "test_accuracy", "seconds", "backends"} <= set(run)
            assert len(run["loss"]) == len(run["test_accuracy"]) == 1
            assert set(run["backends"]) == set(result["model"]["routed"])
            if path == "fovi":
                assert all(ran == ["baseline"] for ran in run["backends"].values())
    summary = result["summary"]
    assert set(summary["path_difference"]) == {"0", "1"}
    assert set(summary["seed_spread"]) == {"fovi", "accelerated"}
    assert set(summary["paths_within_seed_noise"]) == {"loss", "test_accuracy"}
    # float32 on the CPU: the paths agree far inside the seed-to-seed spread
    for difference in summary["path_difference"].values():
        assert abs(difference["loss"]) < 1e-4
    assert "paths within seed noise" in finished.stdout
