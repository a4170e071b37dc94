"""Compile a %%guardload cell as IPython runs it, so the guard can call it as a function.

The cell's source goes through IPython's transformers and its compiler cache (tracebacks show
"Cell In[N]"), a final expression's value comes back, and top-level ``await`` runs as in a
plain cell.
"""
from __future__ import annotations

from typing import Any
from collections.abc import Callable

__all__ = ["compile_cell"]

_CO_COROUTINE = 0x80  # inspect.CO_COROUTINE: code compiled with a top-level await


def _cell_number(shell: Any) -> int:
    """The In[N] of the running %%guardload cell, so tracebacks say "Cell In[N]" as the prompt did.

    IPython counts the cell before running it; the number it cached the cell under is the last
    one in its compiler's filename map when that cell is this magic's.
    """
    import linecache

    try:
        name, number = next(reversed(shell.compile._filename_map.items()))
        entry = linecache.cache.get(name)
        lines = entry[2] if entry is not None and len(entry) == 4 else []  # a lazy entry has no lines yet
        if "run_cell_magic('guardload'" in "".join(lines):
            return int(number)
    except Exception:
        pass
    return int(shell.execution_count)


def compile_cell(shell: Any, cell: str) -> tuple[Callable[[], Any], str]:
    """Compile a cell as IPython runs it (transform_cell, AST transformers, cached source for tracebacks).

    Returns a function that runs it in the user namespace and returns the value of a final
    expression (None otherwise), and the transformed source (for the preflight). A SyntaxError
    propagates as it would without the magic.
    """
    import ast

    source = shell.transform_cell(cell)
    tree = shell.compile.ast_parse(source)
    tree = shell.transform_ast(tree)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
        ast.fix_missing_locations(last)
    filename = shell.compile.cache(source, _cell_number(shell), raw_code=cell)
    # Top-level await is allowed as in a plain cell (unless %autoawait is off): such code
    # evaluates to a coroutine, run below.
    flags = getattr(ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0) if getattr(shell, "autoawait", False) else 0
    with shell.compile.extra_flags(flags):
        code = shell.compile(tree, filename, "exec")
        last_code = shell.compile(last, filename, "eval") if last is not None else None
    glob, local = shell.user_global_ns, shell.user_ns

    def body() -> Any:
        __tracebackhide__ = True
        if code.co_flags & _CO_COROUTINE:
            _run_coroutine(shell, eval(code, glob, local))
        else:
            exec(code, glob, local)
        if last_code is None:
            return None
        value = eval(last_code, glob, local)
        return _run_coroutine(shell, value) if last_code.co_flags & _CO_COROUTINE else value

    return body, source


def _run_coroutine(shell: Any, coro: Any) -> Any:
    """Run a cell's top-level-await coroutine as IPython would run the plain cell.

    IPython's own runner (``shell.loop_runner``, which ``%autoawait`` sets) when no event loop runs
    in this thread; in a kernel, whose loop is running this very cell, the runner gets a thread of
    its own, since a second loop cannot run inside the first.
    """
    import asyncio
    import threading

    runner = getattr(shell, "loop_runner", None) or asyncio.run
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return runner(coro)
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = runner(coro)
        except BaseException as exc:  # handed to the cell's thread, raised there
            outcome["error"] = exc

    worker = threading.Thread(target=run, name="oom-magic top-level await", daemon=True)
    worker.start()
    worker.join()
    if "error" in outcome:
        error = outcome.pop("error")
        try:
            raise error
        finally:
            del error
    return outcome.get("value")
