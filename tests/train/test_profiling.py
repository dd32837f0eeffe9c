"""eagle3.train.profiling on profiler events: device time is counted once, from device events."""

from __future__ import annotations

from dataclasses import dataclass

from torch.autograd import DeviceType

from eagle3.train.profiling import _top, device_busy


@dataclass
class FakeEvent:
    """Test double for a profiler event (FunctionEvent / FunctionEventAvg): the fields the summary reads."""

    key: str
    device_type: DeviceType
    self_device_time_total: float
    self_cpu_time_total: float = 0.0
    count: int = 1
    is_user_annotation: bool = False


EVENTS = [
    FakeEvent("aten::mm", DeviceType.CPU, 900.0, self_cpu_time_total=50.0, count=2),  # the host op: its kernels' time again
    FakeEvent("nvjet_gemm", DeviceType.CUDA, 900.0, count=2),
    FakeEvent("triton_red_fused_softmax", DeviceType.CUDA, 400.0),
    FakeEvent("ProfilerStep", DeviceType.CUDA, 5000.0, is_user_annotation=True),  # an annotation, not device work
]


def test_device_busy_sums_device_events_once():
    assert device_busy(EVENTS) == (1300.0, 2)


def test_top_kernels_list_device_events_and_host_ops_list_host_time():
    kernels = _top(EVENTS[:3], "self_device_time_total", 5, steps=2, device=True)
    assert [k["name"] for k in kernels] == ["nvjet_gemm", "triton_red_fused_softmax"]
    assert kernels[0] == {"name": "nvjet_gemm", "ms_per_step": 0.45, "calls_per_step": 1.0}
    assert [k["name"] for k in _top(EVENTS, "self_cpu_time_total", 5, steps=1)] == ["aten::mm"]


def test_a_run_resumed_inside_the_range_profiles_from_its_first_step(tmp_path):
    import torch

    from eagle3.train.profiling import StepProfiler

    prof = StepProfiler((2, 5), torch.device("cpu"), tmp_path / "profile")
    for step in range(3, 7):  # resumed from a checkpoint at step 3
        prof.before_step(step)
        (torch.randn(64, 64) @ torch.randn(64, 64)).sum()
        prof.after_step(step + 1)
    assert prof.summary is not None and prof.summary["steps"] == [3, 5]
    assert (tmp_path / "profile" / "summary.json").exists()
