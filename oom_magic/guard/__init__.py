"""``%%guardload`` and ``guard_load()``: the guarded load as a pipeline (plan, attempt, settle,
recover, report), PyTorch's out-of-memory messages parsed, and the ranked diagnosis of a failure.
"""
