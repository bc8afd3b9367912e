"""Caches and shared state on the CPU: built once under racing threads and bounded across
many calls (the GPU counterparts, stale-cache cases included, are in
tests/ops/cuda/test_resources_gpu.py)."""

import collections
import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import knnconv.plan
from conftest import CPU_BACKENDS, random_geometry, random_inputs
from knnconv import knn_conv
from knnconv.ops.cuda.backend import RecentLaunches

THREADS = 8


def race(function):
    """``function(index)`` from THREADS threads released together; the results by index.
    A thread's exception is raised here, not lost with its thread."""
    barrier = threading.Barrier(THREADS)
    results, errors = [None] * THREADS, []

    def run(index):
        barrier.wait()
        try:
            results[index] = function(index)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


@pytest.fixture
def plan(rng):
    return random_geometry(rng, nin=13, nout=7, k=4, v=5, padding=0.2).plan(cin=3, cout=5)


def test_derived_builds_once_under_racing_threads(plan):
    builds = []

    def build(tables):
        builds.append(tables)
        time.sleep(0.05)  # long enough for every other thread to arrive while it builds
        return object()

    results = race(lambda _: plan.derived("cpu", "test.raced", build))

    assert len(builds) == 1
    assert all(result is results[0] for result in results)


def test_a_build_on_another_thread_may_derive_more_tables_of_its_plan(plan, monkeypatch):
    # On a GPU, builds run on knnconv.persistent's thread (torch_binned's device tables are
    # derived from its host tables there): nothing may hold a lock the build needs meanwhile.
    builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="builder")

    def on_the_builder(device, build):  # as knnconv.persistent: inline on the builder itself
        if threading.current_thread().name.startswith("builder"):
            return build()
        return builder.submit(build).result(timeout=10)

    monkeypatch.setattr(knnconv.plan, "build_persistent", on_the_builder)

    def outer(tables):
        return ("outer", plan.derived("cpu", "test.inner", lambda tables: "inner"))

    assert plan.derived("cpu", "test.outer", outer) == ("outer", "inner")
    builder.shutdown()


def test_a_build_needing_its_own_result_raises_instead_of_waiting_forever(plan):
    outcome = []

    def first_use():
        try:
            plan.derived("cpu", "test.self", lambda tables: plan.derived(
                "cpu", "test.self", lambda tables: "never"))
        except RuntimeError as exc:
            outcome.append(str(exc))

    thread = threading.Thread(target=first_use)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive() and "test.self" in outcome[0]


def test_a_failed_build_is_raised_and_a_later_call_builds_again(plan):
    def broken(tables):
        raise ValueError("no tables today")

    with pytest.raises(ValueError, match="no tables today"):
        plan.derived("cpu", "test.retry", broken)
    assert plan.derived("cpu", "test.retry", lambda tables: "built") == "built"


def test_tables_copy_once_per_device_under_racing_threads(plan):
    results = race(lambda _: plan.on("meta"))

    assert all(result is results[0] for result in results)
    assert results[0].input_linear.device.type == "meta"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_concurrent_calls_on_one_plan_match_serial_calls(rng, plan, backend):
    inputs = [random_inputs(rng, plan, batch)[:3] for batch in range(1, THREADS + 1)]

    results = race(lambda index: knn_conv(*inputs[index], plan, backend=backend))

    for operands, y in zip(inputs, results, strict=True):
        assert torch.equal(y, knn_conv(*operands, plan, backend=backend))


def test_plan_caches_do_not_grow_across_calls(rng, plan):
    calls = list(itertools.product(CPU_BACKENDS, (torch.float64, torch.float32), (1, 4),
                                   (False, True)))
    inputs = {(dtype, batch): random_inputs(rng, plan, batch, dtype=dtype)[:3]
              for _, dtype, batch, _ in calls}

    def sizes():
        return len(plan._per_device), {device: len(tables.derived)
                                       for device, tables in plan._per_device.items()}

    def run(step):
        backend, dtype, batch, grad = calls[step % len(calls)]
        x, weight, bias = inputs[dtype, batch]
        with torch.set_grad_enabled(grad):
            y = knn_conv(x.requires_grad_(grad), weight, bias, plan, backend=backend)
        if grad:
            y.sum().backward()

    for step in range(len(calls)):
        run(step)
    warm = sizes()
    for step in range(1000):
        run(step)

    assert sizes() == warm


def test_recent_launch_plans_stay_bounded_and_keep_the_hot_one():
    launches, builds = RecentLaunches(), collections.Counter()

    def get(batch):
        def build():
            builds[batch] += 1
            return batch

        return launches.get(("forward", batch, torch.float16), build)

    for batch in range(2, 1002):
        assert get(batch) == batch
        assert get(1) == 1  # a batch size used every step stays cached

    assert len(launches._plans) == RecentLaunches.LIMIT
    assert builds[1] == 1


