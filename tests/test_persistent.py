"""knnconv.persistent: where first-use tables are built (the CUDA-graph-pool case itself is
tests/ops/cuda/test_cuda_backend.py's reduce-overhead training test)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
import torch

from knnconv import persistent


def test_off_cuda_the_build_runs_inline():
    value = persistent.build_persistent(torch.device("cpu"),
                                        lambda: threading.current_thread().name)
    assert value == threading.current_thread().name


def test_every_tensor_of_a_built_value_is_found():
    @dataclass
    class Tables:
        a: torch.Tensor
        b: object

    parts = [torch.zeros(1), torch.zeros(2), torch.zeros(3), torch.zeros(4)]
    value = (Tables(parts[0], {"x": [parts[1], "not a tensor"]}), (parts[2],), parts[3], Tables)
    assert [t.numel() for t in persistent._tensors(value)] == [1, 2, 3, 4]


@pytest.mark.gpu
def test_on_a_gpu_the_builder_thread_builds_on_its_stream_after_the_callers_work():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    device = torch.device("cuda", torch.cuda.current_device())
    source = torch.empty(1 << 22, device=device)
    # Queued behind ~50 ms of the caller's stream: a build not ordered after it reads garbage
    torch.cuda._sleep(10**8)
    source.fill_(3.0)

    def build():
        torch.cuda._sleep(10**8)  # the caller must wait for the build's stream too
        return threading.current_thread().name, source * 2, persistent.build_persistent(
            device, lambda: threading.current_thread().name)  # nested: inline

    name, doubled, nested_name = persistent.build_persistent(device, build)
    assert name.startswith("knnconv-tables") and nested_name == name
    assert torch.equal(doubled, torch.full_like(source, 6.0))
