"""Check 1 — no cost: %load_ext, %gpumem and idle after-cell hooks create no CUDA context.

A fresh interpreter runs a real IPython shell (``IPython.testing.globalipapp``): first without
torch (the extension must not import it), then after the user imports torch (the hooks and
%gpumem must read the GPU through NVML only). Ground truth: ``torch.cuda.is_initialized()`` and
NVML's own process list (pynvml), with a control: the same process creating a context on purpose
must then appear in that list. Where NVML cannot see this container's pids (the control fails),
NVML's device-wide used memory stands in: it must not grow by anything near a context's cost.
"""
from __future__ import annotations

import pytest

from tests.gpu.support import run_fresh

ITEM = 1
pytestmark = pytest.mark.gpu

CHILD = r'''
import pynvml
from oom_magic.device.nvml import Nvml, visible_nvml_devices  # the package's identity of cuda:0 (MIG, remaps)
pynvml.nvmlInit()
_nvml = Nvml(module=pynvml)
handle = _nvml.handle(visible_nvml_devices(_nvml)[0])
def used():
    return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)

facts = {"pid": os.getpid(), "used_at_start": used(), "errors": []}
ip = start_shell()
hooks_before = {e: len(ip.events.callbacks[e]) for e in ("pre_run_cell", "post_run_cell")}

def run(source):
    error = cell(ip, source)
    if error:
        facts["errors"].append(f"{source!r}: {error}")

# The user has not imported torch: the extension must not import it.
run("%load_ext oom_magic")
facts["hooks_added"] = {e: len(ip.events.callbacks[e]) - n for e, n in hooks_before.items()}
for source in ("a = 1", "snap0 = %gpumem -o", "b = [a] * 3"):
    run(source)
facts["torch_imported_without_user"] = "torch" in sys.modules

# The user imports torch, CUDA untouched: idle cells run the hooks, %gpumem reads the GPU.
for source in ("import torch", "c = 2", "snap = %gpumem -o", "%gpumem --all", "d = c + 1", "e = str(d)"):
    run(source)
import torch
snap = ip.user_ns.get("snap")
reading = getattr(snap, "reading", None)
facts["snap_device"] = getattr(snap, "device", None)
facts["snap_total"] = getattr(reading, "total", None)
facts["snap_free"] = getattr(reading, "free", None)
facts["initialized"] = bool(torch.cuda.is_initialized())
facts["listed_without_context"] = os.getpid() in nvml_processes()
facts["used_after_steps"] = used()
facts["nvml_total"] = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
facts["nvml_free"] = int(pynvml.nvmlDeviceGetMemoryInfo(handle).free)

# Control: creating a context on purpose must make this process visible to the same test.
x = torch.zeros(1, device="cuda")
torch.cuda.synchronize()
listed = nvml_processes()
facts["listed_with_context"] = os.getpid() in listed
facts["context_bytes"] = listed.get(os.getpid())
facts["used_with_context"] = used()
emit(facts)
'''


def test_extension_creates_no_cuda_context(checks):
    facts = run_fresh(CHILD, timeout=300)
    checks.true("cells ran without error (%load_ext, %gpumem, idle cells)", facts["errors"], expected=[])
    checks.at_least("extension registered an after-cell hook (post_run_cell), so idle cells ran it",
                    1, facts["hooks_added"]["post_run_cell"], unit=None)
    checks.true("torch not imported by %load_ext / %gpumem / hooks when the user has not", 
                facts["torch_imported_without_user"], expected=False)
    checks.true("%gpumem (torch imported, no context) reads cuda:0", facts["snap_device"], expected="cuda:0")
    checks.equal("%gpumem total == NVML total (read without a context)", facts["nvml_total"], facts["snap_total"])
    checks.true("torch.cuda.is_initialized() after %load_ext, %gpumem and idle hooks",
                facts["initialized"], expected=False)
    control = checks.true("control: NVML lists this process once it creates a context on purpose",
                          facts["listed_with_context"], expected=True,
                          note=None if facts["listed_with_context"] else
                          "NVML cannot see this container's pids: the used-memory row below stands in")
    if control:
        checks.true("this process absent from NVML's process list (no context)",
                    facts["listed_without_context"], expected=False)
    context_cost = facts["used_with_context"] - facts["used_after_steps"]
    checks.at_most("NVML used memory grew by less than half a context during the steps",
                   max(context_cost // 2, 1), facts["used_after_steps"] - facts["used_at_start"],
                   note=f"a CUDA context costs {context_cost} bytes here (measured by the control)")
    checks.verify()
