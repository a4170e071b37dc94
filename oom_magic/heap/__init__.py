"""The heap engine: find a device's live tensors, name who holds each one as the user would write it
(user variable, output cache, traceback, garbage, other), take a snapshot, free what is stale.

Nothing here runs user code: objects are read at C level (``reads``), never through their dunders.
"""
