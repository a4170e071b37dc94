"""What a real CUDA training step holds at its forward/backward peak, allocation by allocation (a diagnostic).

    python scripts/gpu_train_peak.py      # on a machine with an NVIDIA GPU; writes $OUT/train_peak.txt

GPU check 10 found a 1.1B Llama's (fp32, eager, batch 2 x 512) forward/backward transient on an
H200 266 MB (31%) above the sizing's figure. Most of it was the check's own loop, which held the
model's outputs (float32 logits) through backward: that loop holds 800,198,792 B on the cpu, the
loop the probe sizes (the loss alone, as transformers' Trainer keeps it) 602,017,928 B against the
probe's 602,017,800. What stays is CUDA's own 68 MB (8.5%) over the cpu in the held-output loop.
This script runs the probe's loop, records the allocator's history through one step and lists what
is live at its peak, grouped by the Python (and ATen) frames that allocated it. Not part of the
suite, and not run yet: no GPU was lent since.
"""
import collections, gc, os, sys
import torch
sys.path.insert(0, os.getcwd())
from tests.gpu.support import build_causal_lm
import tempfile, transformers
out = os.environ.get("OUT", "/tmp")
path = os.path.join(tempfile.mkdtemp(), "m")
SHAPE = dict(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, vocab=32000, max_positions=4096)
build_causal_lm(path, dtype="float32", **SHAPE)
model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").to("cuda")
model.train()
B, C = 2, 512
ids = torch.randint(3, 32000, (B, C), device="cuda")
# warm: cuBLAS handles and workspaces
loss = model(input_ids=ids[:, :8], labels=ids[:, :8]).loss; loss.backward(); model.zero_grad(set_to_none=True); del loss
torch.cuda.synchronize(); gc.collect(); torch.cuda.empty_cache()
base = torch.cuda.memory_allocated()
torch.cuda.reset_peak_memory_stats()
torch.cuda.memory._record_memory_history(max_entries=200000)
loss = model(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids)).loss
loss.backward()
del loss
torch.cuda.synchronize()
snap = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(enabled=None)
peak = torch.cuda.max_memory_allocated() - base
after = torch.cuda.memory_allocated() - base
grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
lines = [f"base {base} peak-base {peak} after-base {after} grads {grads} peak-after {peak - after}"]
events = snap["device_traces"][0]
live, cur, best, best_live = {}, 0, -1, None
for e in events:
    if e["action"] == "alloc":
        live[e["addr"]] = e; cur += e["size"]
        if cur > best:
            best, best_live = cur, dict(live)
    elif e["action"] in ("free_completed",):
        x = live.pop(e["addr"], None)
        if x is not None:
            cur -= x["size"]
lines.append(f"replayed peak above recording start {best}")
def where(e):
    frames = e.get("frames", [])
    py = [f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in frames if f["filename"].endswith(".py")][:3]
    cpp = [f["name"][:70] for f in frames if not f["filename"].endswith(".py") and ("at::" in f["name"] or "torch::" in f["name"])][:3]
    return " < ".join(py + cpp) or "?"
groups = collections.Counter(); counts = collections.Counter()
for e in (best_live or {}).values():
    groups[where(e)] += e["size"]; counts[where(e)] += 1
for k, v in groups.most_common(25):
    lines.append(f"{v:>14,} {counts[k]:>5}  {k}")
# the grads existing at the peak
text = "\n".join(lines)
print(text)
open(os.path.join(out, "train_peak.txt"), "w").write(text)
