"""FAKES for hardware the test machines lack, one per surface, each built from the real library's value shapes.

- ``fake_pynvml``: nvidia-ml-py's module (devices, MIG, processes, error codes). Put it in place of
  this machine's NVML with conftest's ``use_nvml`` fixture (``oom_magic.device.nvml.use``), or pass
  ``Nvml(fake.module)`` to the function under test.
- ``fake_torch_cuda``: ``torch.cuda`` (allocator counters, stats, snapshot, fraction cap, contexts).
  Hand ``FakeTorch(cuda)`` (or ``FakeTorch(cuda, torch)`` for real tensors besides) to code that
  takes a torch, or ``cuda.install(monkeypatch, torch)`` for code that reads ``sys.modules['torch']``.
"""
