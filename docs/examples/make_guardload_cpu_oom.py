"""Regenerate guardload-cpu-oom.txt: run %%guardload on a real CPU out-of-memory in a real IPython shell.

    .venv/bin/python docs/examples/make_guardload_cpu_oom.py > docs/examples/guardload-cpu-oom.txt

The model is a tiny Llama built from a config and saved (bfloat16) to a temporary folder; the
cell loads it in float32 (the preflight lints that) and then asks for 1 PiB, which fails for real.
Everything below the cell is what the shell printed, unedited.
"""
import contextlib
import io
import sys
import tempfile

import torch
from IPython.testing.globalipapp import start_ipython
from transformers import LlamaConfig, LlamaForCausalLM

folder = tempfile.mkdtemp(prefix="oom-magic-example-")
torch.manual_seed(0)
config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256)
LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(f"{folder}/tiny-llama")

ip = start_ipython()
ip.run_line_magic("load_ext", "oom_magic")
setup = f'import torch\nfrom transformers import AutoModelForCausalLM\npath = "{folder}/tiny-llama"'
ip.run_cell(setup, store_history=True)
cell = ("%%guardload\n"
        "model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)\n"
        "def warm_up(model):\n"
        "    scratch = torch.ones(64 << 20, dtype=torch.uint8)    # a 64 MiB buffer...\n"
        "    return torch.empty(1 << 50, dtype=torch.uint8)       # ...then a 1 PiB cache: far past this RAM\n"
        "kv_cache = warm_up(model)\n")
printed = io.StringIO()
with contextlib.redirect_stdout(printed):
    ip.run_cell(cell, store_history=True)
count = ip.execution_count - 1
shown = [f"In [{count - 1}]: " + setup.replace("\n", "\n        "), "",
         f"In [{count}]: " + cell.rstrip().replace("\n", "\n        "), "", printed.getvalue().rstrip()]
sys.stdout.write("\n".join(shown) + "\n")
