"""Facts about the machine: device readings (NVML, the PyTorch allocator, psutil), who the processes
on a GPU are, the host's budgets (RAM, rlimits, cgroups, disk) and file-mapped memory.

A new device kind goes in ``reading.py``; nothing here imports IPython or draws a figure.
"""
