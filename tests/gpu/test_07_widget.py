"""Check 7 — the after-cell widget's figures equal the allocator's and NVML's at the same moment.

A cell allocates 512 MiB on the GPU; the widget the after-cell hook shows under it must carry the
allocator's figures (``memory_allocated``/``memory_reserved``, this cell's change) and NVML's
(total, free, this pid's bytes), read right after the cell: nothing runs on the device between the
hook's reading and ours. Its caption and bar must show those same figures, and the timeline
(``%gpumem --plot``) is saved to the output folder.
"""
from __future__ import annotations

import os

import pytest

from oom_magic.render.segments import memory_segments
from oom_magic.render.units import format_bytes
from tests.gpu.support import MiB, nvml_memory, nvml_processes, settle

ITEM = 7
pytestmark = pytest.mark.gpu


def test_widget_figures_equal_allocator_and_nvml(gpu_ip, cuda, checks, out_dir):
    torch = cuda
    watch = gpu_ip.magics_manager.registry["OomMagics"].cell_watch
    settle(torch)
    gpu_ip.run_cell("warm = torch.zeros(1, device='cuda')", store_history=True)  # the hook now watches cuda:0
    allocated_before = torch.cuda.memory_allocated(0)
    shown_before = len(watch.live)
    result = gpu_ip.run_cell("t = torch.empty(512 << 20, dtype=torch.uint8, device='cuda')", store_history=True)
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0)
    nvml = nvml_memory(torch)
    process = nvml_processes().get(os.getpid())
    checks.true("the cell ran", result.error_in_exec is None)
    checks.equal("a widget was shown under the cell", shown_before + 1, len(watch.live), unit=None)
    widget = watch.live[-1] if len(watch.live) > shown_before else None
    if widget is not None:
        snap, change = widget.report.snapshot, widget.report.change
        r = snap.reading
        checks.true("it watches cuda:0", snap.device, expected="cuda:0")
        checks.equal("widget allocated == torch.cuda.memory_allocated()", allocated, r.allocated)
        checks.equal("widget reserved == torch.cuda.memory_reserved()", reserved, r.reserved)
        checks.equal("widget 'this cell' == the cell's memory_allocated() change", allocated - allocated_before,
                     change.delta if change else None)
        checks.equal("widget total == NVML total", nvml["total"], r.total)
        checks.equal("widget free == NVML free", nvml["free"], r.free, tol=2 * MiB,
                     note="tolerance: NVML read a moment later; nothing else runs on the device")
        checks.equal("widget used == NVML used", nvml["used"], r.used, tol=2 * MiB)
        bar = {s.key: s.bytes for s in memory_segments(snap)}
        checks.equal("bar: cache == reserved − allocated", reserved - allocated, bar.get("cache"))
        if process is None:
            checks.skip("widget: this process == NVML usedGpuMemory for this pid",
                        "NVML does not list this pid here (another pid namespace): no ground truth")
        else:
            checks.equal("widget: this process == NVML usedGpuMemory for this pid", process, r.process_used,
                         tol=2 * MiB)
            checks.equal("bar: context/non-PyTorch == NVML process bytes − reserved", process - reserved,
                         bar.get("context"), tol=2 * MiB)
        checks.equal("bar: user includes the 512 MiB tensor", 512 * MiB, snap.held_by("t"))
        caption = widget.caption.value
        expected_caption = f"{format_bytes(r.used)} / {format_bytes(nvml['total'])} used"
        checks.true("caption shows NVML's used / total", expected_caption in caption, note=caption)
        delta_text = f"this cell {format_bytes(allocated - allocated_before, signed=True)}"
        checks.true("caption shows the cell's change", delta_text in caption, note=caption)
        checks.true("bar shows the user figure on hover", f"user: {format_bytes(bar.get('user'))}" in widget.bar.value)
    timeline = gpu_ip.run_line_magic("gpumem", f'-o --plot "{out_dir / "timeline.png"}"')
    checks.true("the timeline PNG was written", (out_dir / "timeline.png").exists(), note=repr(timeline))
    records = watch.watcher.records("cuda:0")
    checks.equal("the timeline's last cell == memory_allocated()", allocated, records[-1].allocated if records else None)
    gpu_ip.run_cell("del t, warm")
    checks.verify()
