"""Free stale memory safely: output-cache entries, stored tracebacks and garbage, never a user variable.

With names, delete exactly those variables (and the output cache's references to them), then say
what still holds their memory. Nothing the user did not name is deleted, moved or changed.
"""
from __future__ import annotations

import gc
import sys
from typing import Any
from collections.abc import Iterable

from ..common._torch import loaded_torch
from ..device.reading import read_device, resolve_device
from ..common.errors import OomMagicError
from .holders import Attribution, attribute
from ..device.nvml import Nvml
from ..records.cleanup import FreeReport, StillHeld
from ..device.mapped import file_mappings, mapped_bytes
from ..records.snapshot import OTHER, STALE_KINDS, TRACEBACK, HolderKind, StorageRecord
from .release import clear_frames, empty_cache, forget_last_exception, trim_c_heap
from .roots import Roots, collect_roots, current_shell, is_user_name, user_owned_unders, variable_path
from .storages import LiveTensors, tensor_types
from .tracker import find_tensors

__all__ = ["FreeReport", "StillHeld", "free_stale"]


def free_stale(device: str | None = None, *, names: Iterable[str] = (), dry_run: bool = False,
               shell: Any | None = None, namespace: dict | None = None, nvml: Nvml | None = None) -> FreeReport:
    """Give back stale memory on ``device``; with ``names``, delete those variables first."""
    if shell is None and namespace is None:
        shell = current_shell()
    if namespace is None:
        namespace = getattr(shell, "user_ns", None) or sys.modules["__main__"].__dict__
    names = _named_variables(names, namespace)
    ipython_own = [n for n in names if _ipython_own(n, shell, namespace)]
    if ipython_own:
        raise OomMagicError(f"{', '.join(map(repr, ipython_own))}: IPython's own name, not a variable of yours; "
                            "nothing was deleted (%freeall without names frees what the output cache holds)")
    missing = [n for n in names if n not in namespace]
    if missing:
        raise OomMagicError(f"no variable named {', '.join(map(repr, missing))}: nothing was deleted "
                            f"(check the spelling; %who lists your variables)")
    where = resolve_device(device, nvml)
    torch = loaded_torch()
    if where == "cpu":
        trim_c_heap()  # pages earlier cells freed go back first: the resident figure below is this cleanup's
    before = read_device(where, nvml)
    if torch is None:
        if not dry_run:
            _delete_names(namespace, shell, names)
        deleted = () if dry_run else names
        return FreeReport(where, 0, (), before, before, deleted, (), dry_run,
                          ("torch is not imported in this process: there are no tensors to free",))
    types = tensor_types(torch)
    # Every reference to the user's objects lives inside _act and is gone when it returns.
    # cpu: the file mappings as they were, to tell which freed bytes were file pages (unmapped once freed).
    maps_before = file_mappings() if where == "cpu" else None
    storages, kind_before, named, survivors = _act(torch, types, where, shell, namespace, names, dry_run)
    notes: list[str] = []
    still: tuple[StillHeld, ...]
    if dry_run:
        gone = set(storages) - survivors
        after, deleted, still = before, (), ()
    else:
        # The cleanup is done (names deleted, stale references dropped): a failure from here on is in
        # measuring it, so it becomes a note; raising now would hide that the names are gone.
        deleted, after, gone, still = names, before, set(), ()
        # Nothing named and nothing stale (garbage included: the scan found none): no collection and
        # no second scan, which a guarded cell would pay for on every run; the caches still empty.
        freeing = bool(names) or any(kind in STALE_KINDS for kind in kind_before.values())
        after_live = None
        try:
            if freeing:
                after_live = _until_stale_gone(torch, types, where, shell, namespace, kind_before)
            if freeing or where != "cpu":  # trimming the C heap walks it: only once something was freed
                empty_cache(torch, where)
            after = read_device(where, nvml)
        except Exception as exc:
            after_live = None
            notes.append(f"the cleanup ran, but measuring what it gave back failed ({_why(exc)}): "
                         "%gpumem shows the device now")
        if after_live is not None:
            try:
                gone = set(storages) - after_live.sizes.keys()
                try:
                    still = _still_held(after_live, names, named, storages, torch, types, shell, namespace)
                except Exception as exc:
                    notes.append(f"could not tell what still holds the deleted variables' memory ({_why(exc)})")
            finally:
                after_live.release()
    if not dry_run and TRACEBACK in kind_before.values():  # a later round may have cleared one too
        notes.insert(0, "the stored exception's frames were cleared: its printed traceback stays on screen, "
                        "but %debug of that error is gone")
    by_kind: dict[HolderKind, int] = {}
    for key in gone:
        by_kind[kind_before[key]] = by_kind.get(kind_before[key], 0) + storages[key].bytes
    freed_mapped = None
    if maps_before is not None:
        freed_mapped = mapped_bytes(((storages[k].address, storages[k].bytes) for k in gone if storages[k].address),
                                    maps_before)
    return FreeReport(where, sum(by_kind.values()), tuple(sorted(by_kind.items())), before, after,
                      deleted, still, dry_run, tuple(notes), freed_mapped)


def _named_variables(names: Iterable[str], namespace: dict) -> tuple[str, ...]:
    """The names as the user meant them: each once, in order; a quoted name (`'a b'` on the magic
    line, which IPython passes on with its quotes) without its quotes unless a variable is so named."""
    result: list[str] = []
    for name in names:
        if (isinstance(name, str) and len(name) >= 2 and name[0] == name[-1] and name[0] in "'\""
                and name not in namespace):
            name = name[1:-1]
        if name not in result:
            result.append(name)
    return tuple(result)


def _ipython_own(name: str, shell: Any, namespace: dict) -> bool:
    """Whether a name is IPython's rather than the user's (its history, `_exit_code`, what it put in
    the namespace itself and the user has not rebound); a `_` the user assigned is the user's."""
    if name in user_owned_unders(shell, namespace):
        return False
    if not is_user_name(name):
        return True
    hidden = getattr(shell, "user_ns_hidden", None) if shell is not None else None
    return (type(hidden) is dict and name in hidden and name in namespace
            and dict.get(hidden, name) is dict.get(namespace, name))


def _why(exc: BaseException) -> str:
    """``TypeName: first line`` of an error, safe even when its message cannot be printed."""
    try:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    except Exception:
        text = ""
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def _act(torch: Any, types: frozenset[type], where: str, shell: Any, namespace: dict,
         names: tuple[str, ...], dry_run: bool
         ) -> tuple[dict[int, StorageRecord], dict[int, HolderKind], dict[str, set[int]], set[int]]:
    """Attribute, then (unless a dry run) delete the names and drop stale references.

    Returns plain data only: storages before, their holder kinds, the keys each name reached,
    and (dry run) the keys that would survive.
    """
    roots = collect_roots(shell, namespace)
    live = find_tensors(torch, where)
    try:
        attribution = attribute(live, roots, torch, types, trace_other=False)
        stale = {k: h for k, h in attribution.holders.items() if h.kind in STALE_KINDS}
        named = _reachable_from_names(live, roots, names, torch, types)
        kinds: dict[int, HolderKind] = {k: attribution.holders[k].kind if k in attribution.holders else OTHER
                                        for k in live.sizes}
        survivors: set[int] = set()
        if dry_run:
            survivors = _dry_run_survivors(live, roots, names, torch, types, named, stale)
        else:
            _give_back(roots, stale, attribution, shell, namespace, names)
        return dict(live.storages), kinds, named, survivors
    finally:
        live.release()


def _until_stale_gone(torch: Any, types: frozenset[type], where: str, shell: Any, namespace: dict,
                      kinds: dict[int, HolderKind], rounds: int = 3) -> LiveTensors:
    """Collect and look again; while stale storages survive, give back what holds them now.

    A stale tensor is named by one holder, the first found: one an exception in the output cache
    also reaches through the stored traceback is still held once the output cache lets go. Each
    further round (only then, and only while the last one freed some) attributes again; ``kinds``
    is updated to what held a storage last.
    """
    gc.collect()
    live = find_tensors(torch, where)
    before: list[int] | None = None
    for _ in range(rounds - 1):
        left = [k for k, kind in kinds.items() if kind in STALE_KINDS and k in live.sizes]
        if not left or (before is not None and len(left) >= len(before)):  # the last round freed none of them
            break
        before = left
        live.release()
        _, again, _, _ = _act(torch, types, where, shell, namespace, (), False)
        kinds.update((k, again[k]) for k in left if k in again)
        gc.collect()
        live = find_tensors(torch, where)
    return live


def _reachable_from_names(live: LiveTensors, roots: Roots, names: tuple[str, ...], torch: Any,
                          types: frozenset[type]) -> dict[str, set[int]]:
    """Storage keys each named variable reaches."""
    result: dict[str, set[int]] = {}
    user = dict(roots.user)
    for name in names:
        only = Roots(user=((variable_path(name), user.get(variable_path(name))),), containers=roots.containers)
        result[name] = set(attribute(live, only, torch, types, find_garbage=False, trace_other=False).holders)
    return result


def _dry_run_survivors(live: LiveTensors, roots: Roots, names: tuple[str, ...], torch: Any,
                       types: frozenset[type], named: dict[str, set[int]], stale: dict) -> set[int]:
    """Storages that would stay: everything except stale ones and those only the names reach."""
    paths = {variable_path(n) for n in names}
    remaining = Roots(user=tuple((p, o) for p, o in roots.user if p not in paths), containers=roots.containers)
    kept = set(attribute(live, remaining, torch, types, find_garbage=False, trace_other=False).holders)
    named_keys = set().union(*named.values()) if named else set()
    return {k for k in live.sizes if k not in stale and (k in kept or k not in named_keys)}


def _give_back(roots: Roots, stale: dict, attribution: Attribution, shell: Any,
               namespace: dict, names: tuple[str, ...]) -> None:
    """Delete the named variables, drop stale output-cache entries, clear stale tracebacks."""
    removed = _delete_names(namespace, shell, names)
    try:
        stale_roots = {h.root for h in stale.values()}
        cached = [obj for name, obj in roots.output_cache if name in stale_roots
                  and id(obj) not in attribution.user_reachable]
        _drop_output_refs(cached, shell, namespace)
        for name, obj in roots.traceback:
            if name in stale_roots and id(obj) not in attribution.user_reachable:
                clear_frames(obj, attribution.user_reachable)
        if any(h.kind == TRACEBACK for h in stale.values()):
            forget_last_exception()
    except Exception:
        namespace.update(zip(names, removed))  # a part-way failure leaves every user variable in place
        raise


def _delete_names(namespace: dict, shell: Any, names: tuple[str, ...]) -> list[object]:
    """Delete exactly these variables and the output cache's references to them (as %xdel does)."""
    removed: list[object] = []
    try:
        for name in names:
            removed.append(namespace.pop(name))
        _drop_output_refs(removed, shell, namespace)
    except Exception:
        namespace.update(zip(names, removed))
        raise
    return removed


def _drop_output_refs(objects: list[object], shell: Any, namespace: dict) -> None:
    """Remove IPython's output-history references (Out[N], _N, _, __, ___) to these objects only."""
    if not objects:
        return
    ids = {id(o) for o in objects}
    out = namespace.get("Out")
    if type(out) is dict:
        for n in [n for n, v in out.items() if id(v) in ids]:
            del out[n]
    hidden = getattr(shell, "user_ns_hidden", {}) if shell is not None else {}
    owned = user_owned_unders(shell, namespace)  # a `_` the user assigned is theirs: never rewritten
    for ns in (namespace, hidden):
        for key in [k for k, v in list(ns.items()) if isinstance(k, str) and id(v) in ids
                    and not (ns is namespace and k in owned)
                    and (k in ("_", "__", "___") or (k[:1] == "_" and k[1:].isdigit()))]:
            if key in ("_", "__", "___"):
                ns[key] = ""
            else:
                del ns[key]
    hook = getattr(shell, "displayhook", None)
    for attr in ("_", "__", "___"):
        if id(getattr(hook, attr, None)) in ids:
            setattr(hook, attr, "")
    last = getattr(shell, "last_execution_result", None)
    if last is not None and id(getattr(last, "result", None)) in ids:
        last.result = None


def _still_held(after_live: LiveTensors, names: tuple[str, ...], named: dict[str, set[int]],
                storages: dict[int, StorageRecord], torch: Any, types: frozenset[type], shell: Any,
                namespace: dict) -> tuple[StillHeld, ...]:
    """For each deleted name: which of its storages are still alive, and what holds them."""
    if not names:
        return ()
    alive_keys = {k for name in names for k in named.get(name, ()) if k in after_live.sizes}
    paths_of = _every_holder(after_live, alive_keys, collect_roots(shell, namespace), torch, types)
    result = []
    for name in names:
        alive = [k for k in named.get(name, ()) if k in after_live.sizes]
        if not alive:
            continue
        paths = [p for k in alive for p in paths_of.get(k, ())]
        result.append(StillHeld(name, sum(storages[k].bytes for k in alive), _holder_names(paths)))
    return tuple(result)


def _every_holder(live: LiveTensors, keys: set[int], roots: Roots, torch: Any, types: frozenset[type],
                  rounds: int = 8) -> dict[int, list[str]]:
    """Every root that still reaches each storage (``b`` and ``d['k']``, not only the first found):
    walk again without the roots already named, until no storage is reached (at most ``rounds``)."""
    paths: dict[int, list[str]] = {}
    named_roots: set[str] = set()
    for number in range(rounds):
        def keep(pairs: tuple[tuple[str, object], ...]) -> tuple[tuple[str, object], ...]:
            return tuple((n, o) for n, o in pairs if n not in named_roots)

        left = Roots(keep(roots.user), keep(roots.output_cache), keep(roots.traceback), roots.containers)
        holders = attribute(live, left, torch, types, find_garbage=False, trace_other=number == 0).holders
        found = {k: holders[k] for k in keys if k in holders}
        new_roots = {h.root for h in found.values()} - named_roots
        for key, holder in found.items():
            if holder.root not in named_roots:
                paths.setdefault(key, []).append(holder.path)
        if not new_roots or all(h.kind == OTHER for h in found.values()):  # referrer chains: no root to drop
            break
        named_roots |= new_roots
    return paths


def _holder_names(paths: list[str]) -> tuple[str, ...]:
    """Group holder paths by root variable and shorten each group to its common prefix."""
    by_root: dict[str, list[str]] = {}
    for p in paths:
        root = p.split(".", 1)[0].split("[", 1)[0].split(" ", 1)[0]
        by_root.setdefault(root, []).append(p)
    names = []
    for root, group in by_root.items():
        prefix = group[0] if len(group) == 1 else _common_prefix(group)
        names.append(prefix if prefix.startswith(root) else root)
    return tuple(names) or ("something the walk could not name",)


def _common_prefix(paths: list[str]) -> str:
    """Longest common prefix cut back to a whole segment (before a '.' or '[')."""
    first, last = min(paths), max(paths)
    n = 0
    while n < len(first) and n < len(last) and first[n] == last[n]:
        n += 1
    prefix = first[:n]
    cut = max(prefix.rfind("."), prefix.rfind("["))
    if n == len(first) or (n < len(first) and first[n] in ".["):
        return prefix
    return prefix[:cut] if cut > 0 else prefix
