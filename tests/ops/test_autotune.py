"""knnconv.autotune on the CPU: measured auto choices, kept on disk, never measured where it
is unsafe."""

from __future__ import annotations

import json
import threading

import pytest
import torch

import knnconv
from conftest import CopyKeepingOps, KeptCopy, random_geometry, random_inputs, rel_err
from knnconv import context, knn_conv_with_backend
from knnconv.ops import autotune, dispatch, registry


@pytest.fixture
def tuning(tmp_path, monkeypatch):
    """Autotuning on, its file in tmp_path, nothing remembered from other tests; yields the
    list of (backend, batch) measurements made, with torch_binned made to look faster."""
    context.configure(autotune=True, cache_dir=tmp_path)
    autotune.forget()
    measured = []

    def fake_step_ms(name, plan, batch, device, dtype):
        measured.append((name, batch))
        return {"torch_binned": 1.0, "torch_compact": 2.0}[name]

    monkeypatch.setattr(autotune, "step_ms", fake_step_ms)
    # The plan below has V > K, so the heuristic policy then takes torch_compact at every
    # batch: a measured choice (torch_binned) and the policy's differ.
    monkeypatch.setattr(dispatch, "BINNED_ANY_CELLS_MAX_BATCH", 0)
    yield measured
    autotune.forget()


@pytest.fixture
def plan(rng):
    return random_geometry(rng, nin=30, nout=12, k=5, v=9, padding=0.1).plan(cin=3, cout=4)


def run(plan, rng, batch, dtype=torch.float32):
    x, weight, bias, _ = random_inputs(rng, plan, batch, dtype=dtype)
    return knn_conv_with_backend(x, weight, bias, plan, "auto")


def test_off_by_default_auto_keeps_its_policy(tuning, plan, rng, tmp_path, monkeypatch):
    monkeypatch.delenv(context.ENVIRONMENT["autotune"], raising=False)
    context.reset()  # the environment decides
    context.configure(cache_dir=tmp_path)
    assert not autotune.enabled()
    assert run(plan, rng, 2)[1] == "torch_compact"
    assert tuning == [] and not (tmp_path / "autotune.json").exists()
    monkeypatch.setenv(context.ENVIRONMENT["autotune"], "1")
    assert not autotune.enabled()  # read once
    context.reset()
    assert autotune.enabled()


def test_first_call_measures_and_later_calls_and_processes_reuse(tuning, plan, rng, tmp_path):
    assert run(plan, rng, 2)[1] == "torch_binned"
    assert sorted(tuning) == [("torch_binned", 2), ("torch_compact", 2)]
    assert run(plan, rng, 2)[1] == "torch_binned"
    assert len(tuning) == 2  # remembered
    autotune.forget()  # as a new process would: only the file is left
    assert run(plan, rng, 2)[1] == "torch_binned"
    assert len(tuning) == 2
    stored = json.loads((tmp_path / "autotune.json").read_text())
    [(key, record)] = stored.items()
    assert "B=2" in key and "torch.float32" in key
    assert record == {"backend": "torch_binned",
                      "step_ms": {"torch_binned": 1.0, "torch_compact": 2.0}}


def test_batch_and_dtype_are_cells_of_their_own(tuning, plan, rng):
    run(plan, rng, 2)
    run(plan, rng, 3)
    run(plan, rng, 3, torch.float64)
    assert [batch for _, batch in tuning] == [2, 2, 3, 3, 3, 3]


def test_no_measuring_under_deterministic_algorithms_or_compile(tuning, plan, rng):
    torch.use_deterministic_algorithms(True)
    try:
        assert run(plan, rng, 2)[1] == "torch_compact"  # the heuristic
        assert tuning == []
        torch.use_deterministic_algorithms(False)
        run(plan, rng, 2)  # measured now
        torch.use_deterministic_algorithms(True)
        assert run(plan, rng, 2)[1] == "torch_binned"  # a stored choice serves
    finally:
        torch.use_deterministic_algorithms(False)
    assert len(tuning) == 2
    compiled = torch.compile(lambda x, w, b: knn_conv_with_backend(x, w, b, plan, "auto")[0],
                             backend="eager", fullgraph=True)
    x, weight, bias, _ = random_inputs(rng, plan, 4, dtype=torch.float32)
    expected, _ = knn_conv_with_backend(x, weight, bias, plan, "reference")
    assert rel_err(compiled(x, weight, bias), expected) < 1e-5
    assert len(tuning) == 2  # traced without measuring


def test_an_unreadable_file_is_replaced(tuning, plan, rng, tmp_path):
    (tmp_path / "autotune.json").write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring the autotune file"):
        assert run(plan, rng, 2)[1] == "torch_binned"
    assert len(json.loads((tmp_path / "autotune.json").read_text())) == 1


def test_a_stored_choice_that_cannot_serve_is_measured_again(tuning, plan, rng, tmp_path):
    key = autotune.cell_key(plan, 2, torch.device("cpu"), torch.float32)
    (tmp_path / "autotune.json").write_text(json.dumps({key: {"backend": "cuda"}}))
    assert run(plan, rng, 2)[1] == "torch_binned"
    assert len(tuning) == 2


def test_real_measurement_picks_a_candidate_and_results_stay_right(plan, rng, tmp_path,
                                                                    monkeypatch):
    context.configure(autotune=True, cache_dir=tmp_path)
    autotune.forget()
    try:
        x, weight, bias, _ = random_inputs(rng, plan, 3)
        y, ran = knn_conv_with_backend(x, weight, bias, plan, "auto")
        expected, _ = knn_conv_with_backend(x, weight, bias, plan, "reference")
    finally:
        autotune.forget()
    assert ran in autotune.candidates(plan, torch.device("cpu"), torch.float64)
    assert rel_err(y, expected) < 1e-12
    [record] = json.loads((tmp_path / "autotune.json").read_text()).values()
    assert record["backend"] == ran and set(record["step_ms"]) == {"torch_binned",
                                                                   "torch_compact"}


def test_a_malformed_record_is_measured_again(tuning, plan, rng, tmp_path):
    key = autotune.cell_key(plan, 2, torch.device("cpu"), torch.float32)
    (tmp_path / "autotune.json").write_text(json.dumps({key: "torch_compact", "other": {}}))
    assert run(plan, rng, 2)[1] == "torch_binned"
    assert len(tuning) == 2


def test_an_unwritable_directory_keeps_the_choice_in_the_process(tuning, plan, rng, tmp_path,
                                                                  monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    context.configure(cache_dir=blocker / "below")
    with pytest.warns(UserWarning, match="could not write the autotune file"):
        assert run(plan, rng, 2)[1] == "torch_binned"
    assert run(plan, rng, 2)[1] == "torch_binned"
    assert len(tuning) == 2


def test_a_failing_candidate_is_left_out(tuning, plan, rng, tmp_path, monkeypatch):
    def binned_fails(name, plan, batch, device, dtype):
        if name == "torch_binned":
            raise RuntimeError("out of memory")
        return 2.0

    monkeypatch.setattr(autotune, "step_ms", binned_fails)
    with pytest.warns(UserWarning, match="torch_binned failed"):
        assert run(plan, rng, 2)[1] == "torch_compact"
    assert not (tmp_path / "autotune.json").exists()  # a choice made short of a candidate
    measured = []
    monkeypatch.setattr(autotune, "step_ms", lambda *args: measured.append(args) or 1.0)
    assert run(plan, rng, 2)[1] == "torch_compact"  # holds for the process: not measured again
    assert measured == []


def test_all_candidates_failing_leaves_the_policy_and_retries(tuning, plan, rng, monkeypatch):
    attempts = []

    def everything_fails(name, plan, batch, device, dtype):
        attempts.append(name)
        raise RuntimeError("out of memory")

    monkeypatch.setattr(autotune, "step_ms", everything_fails)
    with pytest.warns(UserWarning):
        assert run(plan, rng, 2)[1] == "torch_compact"
    with pytest.warns(UserWarning):
        run(plan, rng, 2)
    assert len(attempts) == 4


def test_threads_measure_a_cell_once(tuning, plan):
    barrier, ran = threading.Barrier(4), []

    def call():
        barrier.wait()
        ran.append(run(plan, torch.Generator().manual_seed(1), 2)[1])

    threads = [threading.Thread(target=call) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert ran == ["torch_binned"] * 4 and len(tuning) == 2


def test_no_measuring_during_capture(tuning, plan, rng, monkeypatch):
    monkeypatch.setattr(autotune, "_capturing", lambda device: True)
    assert run(plan, rng, 2)[1] == "torch_compact"
    assert tuning == []


@pytest.mark.gpu
def test_on_the_gpu_every_candidate_is_timed_and_capture_only_reads_the_choice(rng, tmp_path,
                                                                               monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("cupy")
    context.configure(cache_dir=tmp_path)
    plan = random_geometry(rng, nin=400, nout=150, k=9, v=9, padding=0.1).plan(cin=32, cout=64)
    x, weight, bias, _ = (t.to("cuda", torch.float16)
                          for t in random_inputs(rng, plan, 64, dtype=torch.float16))
    expected, _ = knn_conv_with_backend(x.double(), weight.double(), bias.double(), plan,
                                        "reference")
    autotune.forget()
    context.configure(autotune=True)
    try:
        y, ran = knn_conv_with_backend(x, weight, bias, plan, "auto")
        [record] = json.loads((tmp_path / "autotune.json").read_text()).values()
        # A new process: the choice comes from the file; any measuring now would fail.
        autotune.forget()

        def no_measuring(*args):
            raise AssertionError("autotune measured during capture")

        monkeypatch.setattr(autotune, "_measure", no_measuring)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            knn_conv_with_backend(x, weight, bias, plan, "auto")  # warm-up, as capture asks
        torch.cuda.current_stream().wait_stream(side)
        autotune.forget()  # the warm-up remembered the choice; capture must read the file
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured, ran_captured = knn_conv_with_backend(x, weight, bias, plan, "auto")
        graph.replay()
        torch.cuda.synchronize()
    finally:
        autotune.forget()
    native = {"cuda"} | ({"triton"} if torch.cuda.get_device_capability() >= (9, 0) else set())
    assert set(record["step_ms"]) == native | {"torch_binned", "torch_compact"}
    assert ran == record["backend"] == min(record["step_ms"], key=record["step_ms"].get)
    assert ran_captured == ran
    assert rel_err(y, expected) < 1e-2 and rel_err(captured, expected) < 1e-2


def test_a_choice_is_measured_and_kept_per_input_relayout_setting(tuning, plan, rng):
    # With the re-layout kept the cuda backend's step skips one re-layout of x, so the two
    # settings are two cells, each measured once.
    x, weight, bias, _ = random_inputs(rng, plan, batch=2, dtype=torch.float32)
    keys = []
    for keep in (False, True, False):
        with knnconv.keep_input_relayout(keep):
            knn_conv_with_backend(x, weight, bias, plan)
            keys.append(autotune.cell_key(plan, 2, torch.device("cpu"), torch.float32))
    assert keys[0] == keys[2] != keys[1]
    assert tuning == [(name, 2) for name in ("torch_binned", "torch_compact")] * 2


@pytest.mark.parametrize("keep", [False, True])
def test_a_measured_step_runs_as_a_training_call_would(plan, monkeypatch, keep):
    ops = CopyKeepingOps()
    monkeypatch.setitem(registry._REGISTRY, ops.name, ops)
    with knnconv.keep_input_relayout(keep):
        autotune.step_ms(ops.name, plan, 2, torch.device("cpu"), torch.float32)
    # every timed backward got what a call's would, for x, weight and bias
    assert {type(x) for x in ops.received} == {KeptCopy if keep else torch.Tensor}
    assert set(ops.needs) == {(True, True, True)}
