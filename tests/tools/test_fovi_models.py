"""The fovi whole-model benchmark's smoke run on the CPU: ``knnconv bench --fovi-model`` times
fovi's own KNNAlexNet (shrunk through --in-res) as fovi runs it, accelerated, and accelerated
under torch.compile, and writes its JSON and PNG."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

pytest.importorskip("fovi.models.knnalexnet")

from knnconv.tools import bench, fovi_models  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:torch.meshgrid"),
              pytest.mark.filterwarnings("ignore:To copy construct from a tensor")]


def test_tiny_alexnet_runs_every_path(tmp_path):
    torch.compiler.reset()
    try:
        code = bench.main(["--fovi-model", "alexnet", "--in-res", "8", "--batches", "2",
                           "--repeats", "1", "--warmup", "0", "--device", "cpu",
                           "--out", str(tmp_path), "--name", "smoke"])
    finally:
        torch.compiler.reset()
    assert code == 0
    result = json.loads((tmp_path / "smoke_fovi_models.json").read_text())
    assert (tmp_path / "smoke_fovi_models.png").stat().st_size > 0
    rows = {row["path"]: row for row in result["rows"]}
    for path in ("fovi", "accelerated", "accelerated+compile"):
        row = rows[path]
        assert (row["status"], row["mode"], row["batch"]) == ("ok", "eager", 2), row
        assert row["median_ms"] > 0 and row["peak_mib"] is None and row["footprint_mib"] is None
    assert result["settings"]["sizes"]["alexnet"]["sensor_samples"] > 0
    for path in ("grid", "grid+compile"):  # torchvision's ResNet-18, eager and compiled
        if importlib.util.find_spec("torchvision") is None:
            assert rows[path]["status"] == "skipped"
            assert "torchvision" in rows[path]["error"]
        else:
            assert rows[path]["status"] == "ok"
    assert result["breakdown"] == {"alexnet": {}}  # the GPU-time profile needs CUDA


def test_the_paths_timed_are_an_option(tmp_path):
    code = bench.main(["--fovi-model", "alexnet", "--paths", "accelerated", "--in-res", "8",
                       "--batches", "2", "--repeats", "1", "--warmup", "0", "--device", "cpu",
                       "--out", str(tmp_path), "--name", "smoke"])
    assert code == 0
    result = json.loads((tmp_path / "smoke_fovi_models.json").read_text())
    assert [row["path"] for row in result["rows"]] == ["accelerated"]
    assert result["settings"]["paths"] == ["accelerated"]


@pytest.mark.parametrize(("kernel", "expected"), [
    ("void cudnn::batchnorm_bwtr_nhwc_semiPersist<__half, float>", "normalisation"),
    ("void cudnn::bn_fw_tr_1C11_kernel_NCHW<__half, float>", "normalisation"),
    ("void at::native::batch_norm_collect_statistics_channels_last_kernel", "normalisation"),
    ("void knnconv::knn_pool_backward_channels_last<__half, 0, 8>", "knn_pool"),
    ("void knnconv::knn_forward<__half, __half, 128, 64, 64>", "knn_conv"),
    ("void knnconv::transpose_pad<__half, __half>", "relayout_copy"),
    ("void at::native::elementwise_kernel<direct_copy_kernel_cuda>", "relayout_copy"),
    ("void at::native::vectorized_elementwise_kernel<launch_clamp_scalar>", "other"),
])
def test_breakdown_categories(kernel, expected):
    assert fovi_models.category(kernel) == expected


def test_breakdown_lines_list_every_path_and_batch():
    ok = {"status": "ok", "ms_per_step": dict.fromkeys(fovi_models.CATEGORIES, 1.0)}
    breakdowns = {"resnet18": {
        "accelerated": [{**ok, "batch": 512}, {**ok, "batch": 2048}],
        "fovi": [{"batch": 512, "status": "error", "error": "RuntimeError: out of memory"}]}}
    lines = fovi_models.breakdown_lines(breakdowns)
    assert lines[0].startswith("resnet18 accelerated B=512 GPU ms/step: knn_conv 1.00")
    assert lines[1].startswith("resnet18 accelerated B=2048 GPU ms/step")
    assert lines[2] == "resnet18 fovi B=512: RuntimeError: out of memory"


def test_the_breakdown_batches_are_an_option():
    import argparse

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert parser.parse_args(["--profile-batches", "512,2048"]).profile_batches == [512, 2048]
    assert parser.parse_args([]).profile_batches is None


def test_the_other_families_build_with_the_published_sensor():
    from fovi.arch.knn import KNNDepthwiseSeparableConvLayer
    from fovi.models.knnresnet import KNNResNetBottleneck

    resnet50 = fovi_models.build_fovi("resnet50", 32, torch.device("cpu"))
    assert [len(stage) for stage in (resnet50.layer1, resnet50.layer2, resnet50.layer3,
                                     resnet50.layer4)] == [3, 4, 6, 3]
    assert isinstance(resnet50.layer1[0], KNNResNetBottleneck)
    separable = fovi_models.build_fovi("resnet18_dwsep", 32, torch.device("cpu"))
    assert any(isinstance(m, KNNDepthwiseSeparableConvLayer) for m in separable.modules())


def test_a_model_fovi_cannot_build_is_a_row_not_a_crash(tmp_path, monkeypatch):
    def cannot_build(name, in_res, device):
        raise TypeError("fovi's constructor failed")

    monkeypatch.setattr(fovi_models, "build_fovi", cannot_build)
    code = bench.main(["--fovi-model", "convnextv2", "--in-res", "8", "--batches", "2",
                       "--repeats", "1", "--warmup", "0", "--device", "cpu",
                       "--out", str(tmp_path), "--name", "unbuilt"])
    assert code == 0
    (row,) = json.loads((tmp_path / "unbuilt_fovi_models.json").read_text())["rows"]
    assert (row["model"], row["status"]) == ("convnextv2", "error")
    assert row["error"] == "build: TypeError: fovi's constructor failed"


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_one_rank_of_the_ddp_bench_times_every_path(tmp_path, monkeypatch):
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    code = bench.main(["--fovi-model", "alexnet", "--ddp", "--in-res", "8", "--batches", "2",
                       "--repeats", "1", "--warmup", "0", "--device", "cpu",
                       "--out", str(tmp_path), "--name", "one"])
    assert code == 0
    result = json.loads((tmp_path / "one_ddp.json").read_text())
    assert result["world_size"] == 1
    rows = {row["path"]: row for row in result["rows"]}
    for path in ("fovi", "accelerated"):
        row = rows[path]
        assert (row["status"], row["world_size"], row["batch_per_rank"]) == ("ok", 1, 2), row
        assert row["images_per_s"] == pytest.approx(2 / row["median_ms"] * 1e3)
    expected_grid = "skipped" if importlib.util.find_spec("torchvision") is None else "ok"
    assert rows["grid"]["status"] == expected_grid


def test_the_ddp_bench_outside_torchrun_says_how_to_launch_it(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    code = bench.main(["--fovi-model", "alexnet", "--ddp", "--device", "cpu",
                       "--out", str(tmp_path)])
    assert code == 2
    assert "torchrun" in capsys.readouterr().err


def test_scaling_efficiency_is_against_one_rank_of_the_same_cell():
    from knnconv.tools.fovi_ddp import scaling

    def run(world, rates):
        return {"rows": [{"model": "resnet18", "path": path, "world_size": world,
                          "batch_per_rank": 512, "status": "ok", "images_per_s": rate}
                         for path, rate in rates.items()]}

    table = scaling([run(1, {"accelerated": 100.0, "grid": 80.0}),
                     run(2, {"accelerated": 190.0, "grid": 160.0}),
                     run(4, {"accelerated": 360.0})])
    efficiency = {(row["path"], row["world_size"]): row["scaling_efficiency"] for row in table}
    assert efficiency == {("accelerated", 1): 1.0, ("accelerated", 2): 0.95,
                          ("accelerated", 4): 0.9, ("grid", 1): 1.0, ("grid", 2): 1.0}
