"""knnconv.bench on the CPU: geometry sets, outputs, the reference check, fovi's kernel times,
the floor."""

from __future__ import annotations

import csv
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import knnconv
from conftest import random_geometry
from knnconv import available_backends
from knnconv.tools import bench

TINY = {"K": 4, "V": 6, "Nin": 12, "Nout": 5}
QUICK = ["--batches", "2", "--repeats", "2", "--warmup", "1"]


def write_geometry_set(directory) -> None:
    """A geometry set in the published format: two convs (one padded) and three entries to skip."""
    rng = np.random.default_rng(0)
    k, v, nin, nout = TINY["K"], TINY["V"], TINY["Nin"], TINY["Nout"]
    knn = np.stack([rng.permutation(nin)[:k] for _ in range(nout)], axis=1).astype(np.int32)
    rf = np.stack([rng.permutation(v)[:k] for _ in range(nout)]).astype(np.int16)
    padded = knn.copy()
    padded[-1, :3] = nin  # the last neighbour of three outputs is the padding token
    for name, table in (("plain.npz", knn), ("padded.npz", padded)):
        np.savez(directory / name, knn_indices_pad_token=table, rf_index=rf, nin=np.int64(nin),
                 v=np.int64(v))
    layers = [
        {"model": "tiny", "layer": "backbone.block.0.conv", "kind": "conv", "Cin": 3, "Cout": 4,
         **TINY, "npz": "plain.npz"},
        {"model": "tiny", "layer": "backbone.block.0.pool", "kind": "pool", "K": 3, "Nin": 5,
         "Nout": 2},
        {"model": "tiny", "layer": "embeddings.patch", "kind": "conv", "Cin": 2, "Cout": 3,
         **TINY, "npz": "padded.npz"},
        {"model": "tiny", "layer": "backbone.no_tables", "kind": "conv", "Cin": 2, "Cout": 3,
         **TINY},
        {"model": "tiny", "layer": "backbone.block.1.conv", "kind": "conv", "Cin": 3, "Cout": 4,
         **TINY, "npz": "plain.npz"},  # block.0.conv again: times the same, so skipped
    ]
    (directory / "index.json").write_text(json.dumps({"layers": layers}))


def read_rows(out_dir, name: str = "cpu") -> list[dict]:
    return json.loads((out_dir / f"{name}.json").read_text())["rows"]


def test_geometry_set_writes_checked_rows(tmp_path):
    write_geometry_set(tmp_path)
    out = tmp_path / "out"
    rc = bench.main(["--geometry", str(tmp_path), *QUICK, "--dtypes", "float32", "--check",
                     "--out", str(out)])
    assert rc == 0
    for ext in ("json", "csv", "png"):
        assert (out / f"cpu.{ext}").stat().st_size > 0
    result = json.loads((out / "cpu.json").read_text())
    assert result["ceilings"] == {"copy_gbps": None, "matmul_tflops": None}
    rows = result["rows"]
    # Pools, entries without tables and repeats are skipped; only 'backbone.' leaves names.
    assert {row["layer"] for row in rows} == {"tiny:block.0.conv", "tiny:embeddings.patch"}
    assert len(rows) == 2 * len(available_backends()) * 2  # layers x backends x modes
    for row in rows:
        assert set(bench.ROW_FIELDS) <= set(row)
        assert row["floor_ms"] is None and row["pct_of_floor"] is None  # no ceilings on CPU
        assert row["fovi_ms"] is None  # fovi's times are fp16 only
        if row["backend"] in ("cuda", "triton"):  # the native backends: fp16/bf16 only
            assert row["status"] == "unsupported" and row["median_ms"] is None
            continue
        assert row["status"] == "ok" and row["backend_ran"] == row["backend"]
        assert row["median_ms"] > 0
        if row["mode"] == "forward":
            assert row["rel_err"] < 1e-5
        else:
            assert row["rel_err"] is None
    padded = [row for row in rows if row["layer"] == "tiny:embeddings.patch"]
    assert all(row["padding_fraction"] == pytest.approx(3 / 20) for row in padded)
    assert all((row["cin"], row["cout"], row["k"], row["v"], row["nin"], row["nout"], row["p64"])
               == (2, 3, 4, 6, 12, 5, 64) for row in padded)
    with (out / "cpu.csv").open() as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == len(rows) and tuple(table[0]) == bench.ROW_FIELDS


def test_geometry_dir_keeps_repeats_when_asked(tmp_path):
    write_geometry_set(tmp_path)
    unique = [layer.name for layer in bench.load_geometry_dir(tmp_path)]
    assert unique == ["tiny:block.0.conv", "tiny:embeddings.patch"]
    every = [layer.name for layer in bench.load_geometry_dir(tmp_path, ["tiny:"], repeats=True)]
    assert every == ["tiny:block.0.conv", "tiny:embeddings.patch", "tiny:block.1.conv"]


def test_network_layers_are_every_conv_of_the_model_in_order(tmp_path):
    from knnconv.tools.bench_networks import network_layers

    write_geometry_set(tmp_path)
    layers = network_layers(tmp_path, "tiny", torch.device("cpu"), torch.float64)
    assert [(layer.in_channels, layer.out_channels) for layer in layers] == [(3, 4), (2, 3),
                                                                              (3, 4)]
    assert all(layer.bias is None and layer.weight.dtype == torch.float64 for layer in layers)
    assert torch.equal(layers[1].plan.on("cpu").knn_indices[-1, :3], torch.full((3,), 12))


def test_builtin_set_with_layer_filter(tmp_path):
    rc = bench.main(["--layers", "builtin-resnet:layer3", *QUICK, "--dtypes", "float32",
                     "--backends", "torch_compact", "--out", str(tmp_path), "--name", "builtin"])
    assert rc == 0
    rows = read_rows(tmp_path, "builtin")
    assert [(row["layer"], row["mode"]) for row in rows] == [
        ("builtin-resnet:layer3.0.conv1", "forward"), ("builtin-resnet:layer3.0.conv1", "train")]
    assert all((row["cin"], row["cout"], row["k"]) == (128, 256, 9) for row in rows)
    assert rows[0]["nin"] > rows[0]["nout"]  # a strided layer: one level coarser


def test_fovi_times_fill_fp16_rows(tmp_path):
    write_geometry_set(tmp_path)
    fovi_times = tmp_path / "fovi_kernel_times.json"
    fovi_times.write_text(json.dumps([
        {"layer": "tiny:block.0.conv", "batch": 2, "floor_fwd_ms": 0.001, "fovi_fwd_ms": 0.5,
         "reference_fwd_ms": 1.0, "floor_train_ms": 0.003, "fovi_train_ms": 1.5,
         "reference_train_ms": 3.0},
    ]))
    rc = bench.main(["--geometry", str(tmp_path), "--layers", "block", *QUICK,
                     "--dtypes", "float16,float32", "--backends", "torch_compact",
                     "--fovi-times", str(fovi_times), "--out", str(tmp_path)])
    assert rc == 0
    for row in read_rows(tmp_path):
        if row["dtype"] == "float32":
            assert row["fovi_ms"] is None and row["speedup_vs_fovi"] is None
        else:
            assert row["fovi_ms"] == {"forward": 0.5, "train": 1.5}[row["mode"]]
            assert row["speedup_vs_fovi"] == pytest.approx(row["fovi_ms"] / row["median_ms"])
    summary = json.loads((tmp_path / "cpu.json").read_text())["summary"]
    assert [entry["backend"] for entry in summary["train_speedup_vs_fovi_geomean"]] == [
        "torch_compact"]


def test_the_repo_fovi_times_cover_its_table():
    entries = json.loads(bench.REPO_FOVI_TIMES.read_text())
    assert len(entries) == 72 and len({(e["layer"], e["batch"]) for e in entries}) == 72
    fovi_times = bench.load_fovi_times(bench.REPO_FOVI_TIMES)
    layer = "fovi-alexnet_a-0.5_res-64_rfmult-1:layers.0.conv"
    assert fovi_times[(layer, 128, "forward")] == 0.419
    assert fovi_times[(layer, 128, "train")] == 1.283


# The ceilings of the run that measured fovi 2.4.0's published per-layer times (its
# table, bench/fovi_kernel_times.json), and some of the forward floors that table lists
# (floor_fwd_ms), recomputed from each layer's sizes.
FOVI_TABLE_CEILINGS = {"copy_gbps": 4124.0, "matmul_tflops": 750.0}
FOVI_TABLE_FLOORS = [
    # (B, Cin, Cout, K, V, Nin, Nout, P64, floor fwd ms): compute-bound, then memory-bound
    (128, 3, 96, 121, 121, 4085, 964, 384, 0.011),
    (2048, 96, 256, 25, 25, 230, 230, 2432, 0.772),
    (2048, 256, 512, 1, 1, 16, 2, 256, 0.005),
    (2048, 512, 512, 2, 36, 2, 2, 1024, 0.007),
]


@pytest.mark.parametrize("batch, cin, cout, k, v, nin, nout, p64, expected", FOVI_TABLE_FLOORS)
def test_floor_matches_fovi_times_table(batch, cin, cout, k, v, nin, nout, p64, expected):
    plan = SimpleNamespace(cin=cin, cout=cout, k=k, v=v, nin=nin, nout=nout, p64=p64)
    assert bench.forward_floor_ms(plan, batch, FOVI_TABLE_CEILINGS) == pytest.approx(expected,
                                                                                 abs=5e-4)


def test_time_calls_resets_before_every_call():
    events = []

    def call():
        events.append("call")
        return len(events)

    median_ms, last = bench.time_calls(call, torch.device("cpu"), warmup=2, repeats=3,
                                       reset=lambda: events.append("reset"))
    assert events == ["reset", "call"] * 5
    assert last == 10 and median_ms >= 0


def test_bad_requests_exit_with_2(tmp_path):
    assert bench.main(["--backends", "nope", "--out", str(tmp_path)]) == 2
    assert bench.main(["--layers", "no-such-layer", "--out", str(tmp_path)]) == 2
    with pytest.raises(SystemExit):
        bench.main(["--dtypes", "float8"])


def test_model_mode_times_a_whole_network(tmp_path):
    assert bench.main(["--model", "alexnet", "--resolution", "16", "--batches", "3",
                       "--repeats", "1", "--warmup", "0", "--backends", "torch_compact",
                       "--compile", "--out", str(tmp_path), "--name", "m"]) == 0
    rows = json.loads((tmp_path / "m_alexnet.json").read_text())["rows"]
    assert [(r["backend"], r["batch"], r["compiled"], r["status"]) for r in rows] == [
        ("torch_compact", 3, False, "ok"), ("torch_compact", 3, True, "ok")]
    for row in rows:
        assert row["images_per_s"] == pytest.approx(3 / row["median_ms"] * 1e3)
        assert row["backend_ran"] == "torch_compact"  # the KNN convolutions and pooling layers


def test_summary_keeps_dtypes_apart_and_compares_backends_on_the_cells_all_completed():
    def row(layer, dtype, backend, status="ok", pct=10.0, speedup=2.0):
        return {"layer": layer, "batch": 8, "dtype": dtype, "backend": backend, "mode": "train",
                "status": status, "median_ms": None if pct is None else 100 / pct,
                "pct_of_floor": pct, "speedup_vs_fovi": speedup}

    rows = [row("a", "float16", "cuda", pct=40.0), row("a", "float16", "torch_compact"),
            row("b", "float16", "cuda", pct=4.0), row("b", "float16", "torch_compact", "oom",
                                                       None, None),
            row("a", "bfloat16", "cuda", pct=20.0)]
    summary = bench.summarize(rows)
    pct = {(e["dtype"], e["backend"]): (round(e["geomean"], 9), e["cells"])
           for e in summary["pct_of_floor_geomean"]}
    # cell b is left out for float16: torch_compact did not complete it
    assert pct == {("float16", "cuda"): (40.0, 1), ("float16", "torch_compact"): (10.0, 1),
                   ("bfloat16", "cuda"): (20.0, 1)}
    assert summary["statuses"] == {"ok": 4, "oom": 1}
    times = {(e["dtype"], e["backend"]): e["cells"] for e in summary["median_ms_geomean"]}
    assert times == {("float16", "cuda"): 1, ("float16", "torch_compact"): 1,
                     ("bfloat16", "cuda"): 1}


def test_compiled_steps_compare_with_fovis_training_step_and_replays_with_none():
    geometry = random_geometry(torch.Generator().manual_seed(3))
    plan = knnconv.make_plan(geometry.knn_indices, geometry.rf_index, nin=geometry.nin,
                             v=geometry.v, cin=2, cout=3)
    fovi_times = {("a", 8, "forward"): 0.3, ("a", 8, "train"): 1.5}
    ceilings = {"copy_gbps": 1000.0, "matmul_tflops": 100.0}
    recorder = bench.Benchmark(SimpleNamespace(), torch.device("cpu"), ["cuda"], ceilings,
                               fovi_times, name_width=4)
    for mode, median_ms in (("forward", 0.1), ("train", 0.75), ("train_graph", 0.2),
                            ("train_compiled", 0.25)):
        recorder._record("a", plan, 8, "float16", "cuda", mode, "ok", median_ms=median_ms)
    fovi_ms = {row["mode"]: row["fovi_ms"] for row in recorder.rows}
    # a compiled step stands in for fovi's eager step; a replay (GPU time) for nothing
    assert fovi_ms == {"forward": 0.3, "train": 1.5, "train_graph": None,
                       "train_compiled": 1.5}
    summary = bench.summarize(recorder.rows)
    speedups = {entry["mode"]: entry["geomean"]
                for entry in summary["train_speedup_vs_fovi_geomean"]}
    assert speedups == pytest.approx({"train": 2.0, "train_compiled": 6.0})
    assert bench.FOVI_MODE == {"forward": "forward", "train": "train",
                                 "train_compiled": "train"}


def test_compile_without_a_model_is_refused(tmp_path, capsys):
    assert bench.main(["--compile", "--out", str(tmp_path)]) == 2
    assert "--model" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_compiled_steps_are_opt_in():
    parser = bench.argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert "train_compiled" not in parser.parse_args([]).modes
    assert parser.parse_args(["--modes", "train_compiled"]).modes == ["train_compiled"]


def test_the_no_dx_modes_train_without_the_input_gradient(tmp_path, monkeypatch):
    needs_seen = []
    ops = knnconv.get_ops("torch_compact")
    gradients = ops.gradients
    monkeypatch.setattr(ops, "gradients", lambda plan, grad_y, x, w, needs, *args, **kwargs: (
        needs_seen.append(tuple(needs)), gradients(plan, grad_y, x, w, needs, *args, **kwargs))[1])
    write_geometry_set(tmp_path)
    rc = bench.main(["--geometry", str(tmp_path), "--layers", "block", *QUICK,
                     "--backends", "torch_compact", "--modes", "train,train_no_dx",
                     "--out", str(tmp_path), "--name", "no_dx"])
    assert rc == 0
    rows = {r["mode"]: r for r in read_rows(tmp_path, "no_dx")}
    assert set(rows) == {"train", "train_no_dx"}
    assert all(r["status"] == "ok" and r["median_ms"] > 0 for r in rows.values())
    # every step asks for dW and the bias gradient; only the train steps ask for dx
    assert {needs[1:] for needs in needs_seen} == {(True, True)}
    assert {needs[0] for needs in needs_seen} == {True, False}
    # the floor counts no grad-input pass
    plan = random_geometry(torch.Generator().manual_seed(0), nin=30, nout=20, k=5).plan(
        cin=16, cout=16)
    floors = {mode: bench.mode_floor_ms(plan, 64, mode, FOVI_TABLE_CEILINGS)
              for mode in ("forward", "train", "train_graph", "train_no_dx", "train_graph_no_dx")}
    assert floors["train"] == floors["train_graph"] == pytest.approx(
        bench.TRAIN_FLOOR_FACTOR * floors["forward"])
    assert floors["train_no_dx"] == floors["train_graph_no_dx"] == pytest.approx(
        (bench.TRAIN_FLOOR_FACTOR - 1) * floors["forward"])


@pytest.mark.gpu
def test_on_the_gpu_graph_modes_time_the_native_backends_and_compiled_cuda(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("cupy")
    write_geometry_set(tmp_path)
    fovi_times = tmp_path / "fovi_kernel_times.json"
    fovi_times.write_text(json.dumps([
        {"layer": "tiny:block.0.conv", "batch": 2, "floor_fwd_ms": 0.001, "fovi_fwd_ms": 0.5,
         "reference_fwd_ms": 1.0, "floor_train_ms": 0.003, "fovi_train_ms": 1.5,
         "reference_train_ms": 3.0}]))
    rc = bench.main(["--geometry", str(tmp_path), "--layers", "block", *QUICK,
                     "--backends", "torch_compact,cuda,auto", "--fovi-times", str(fovi_times),
                     "--modes", "train,train_graph,train_compiled,train_graph_no_dx",
                     "--out", str(tmp_path), "--name", "gpu"])
    assert rc == 0
    rows = {(r["backend"], r["mode"]): r for r in read_rows(tmp_path, "gpu")}
    # graph replays run the native backends (auto's choice among them), compiled cells cuda
    assert set(rows) == {("torch_compact", "train"), ("cuda", "train"), ("cuda", "train_graph"),
                         ("cuda", "train_compiled"), ("auto", "train"), ("auto", "train_graph"),
                         ("cuda", "train_graph_no_dx"), ("auto", "train_graph_no_dx")}
    assert all(r["status"] == "ok" and r["median_ms"] > 0 for r in rows.values())
    assert rows[("cuda", "train_compiled")]["fovi_ms"] == 1.5
    assert rows[("cuda", "train_graph")]["fovi_ms"] is None


def test_relative_error_on_known_values():
    # the library's metric (bench tables; first-use checks use their own): known answers, NaN fails
    assert bench.relative_error(torch.tensor([1.1]), torch.tensor([1.0])) == pytest.approx(0.1)
    assert bench.relative_error(torch.tensor([3.0, 4.0]), torch.zeros(2)) == pytest.approx(5.0)
    assert math.isnan(bench.relative_error(torch.tensor([math.nan]), torch.tensor([1.0])))


def test_generated_stems_are_three_channel_image_layers_with_thousands_of_nodes():
    stems = bench.generated_stems()
    assert [stem.name for stem in stems] == [name for name, _ in bench.GENERATED_STEMS]
    for stem in stems:
        plan = stem.plan()
        assert (plan.cin, plan.cout, plan.k, plan.v) == (3, 64, 49, 196)
        assert plan.nin == plan.nout > 3000  # stride 1: every sensor sample is an output
    assert [stem.name for stem in bench.generated_stems(["res72"])] == [stems[1].name]


def test_the_stems_join_the_benchmark_set_when_asked(tmp_path):
    rc = bench.main(["--layers", "stem-res64", "--stems", "--batches", "1", "--modes", "forward",
                     "--backends", "torch_compact", "--dtypes", "float32", "--repeats", "1",
                     "--warmup", "0", "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "cpu.json").read_text())["rows"]
    assert {row["layer"] for row in rows} == {"generated:stem-res64-k49"}
    assert all(row["status"] == "ok" for row in rows)


def test_a_scripts_rows_are_written_with_the_device_and_what_else_it_says(tmp_path, capsys):
    path = tmp_path / "out.json"
    bench.write_rows(path, [{"ms": 1.5}], torch.device("cpu"), batch=7)
    assert json.loads(path.read_text()) == {"device": "cpu", "batch": 7, "rows": [{"ms": 1.5}]}
    assert f"wrote {path}" in capsys.readouterr().out


@pytest.mark.gpu
def test_on_the_gpu_a_replayed_call_is_timed_per_call():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    device = torch.device("cuda")
    x = torch.randn(2**24, device=device)
    one = bench.replayed_ms_per_call(lambda: x.add_(1), device, calls=4, repeats=3)
    # sixteen adds a call take longer than one (a per-call figure, not per graph)
    sixteen = bench.replayed_ms_per_call(lambda: [x.add_(1) for _ in range(16)], device,
                                         calls=4, repeats=3)
    assert 0 < one < sixteen
