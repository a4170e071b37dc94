"""Name the way to an object the walk reached: the steps from its root (``Namer``); the text a user
would type for them is ``path_text.render``.

Each parent-to-child link is found with C-level reads (dict items, sequence indexes, member
descriptors, a frame's locals) and kept as *steps* (plain strings and ints, no references), which
``resolve.resolve`` re-reads later to check a remembered path still reaches the same object.
"""
from __future__ import annotations

import gc
import sys
import types
from itertools import chain, compress, count
from typing import Any
from collections.abc import Callable, Iterable

from .path_text import MAX_SHOWN_STEPS, Step
from .walk import Root, Walk
from .reads import (MISSING, array_items, attribute_getter, deque_iter, deque_type, find_referent,
                    instance_attributes, instance_dict_if_present, is_plain_key, links_named, mapping_items, mro_has,
                    plain_dict_slot, qualname, type_mro, type_name)

# A suspended generator's (coroutine's) frame, read through its type's own getter.
_GEN_FRAME = {types.GeneratorType: "gi_frame", types.CoroutineType: "cr_frame", types.AsyncGeneratorType: "ag_frame"}
_GEN_FRAME_OF = {cls: cls.__dict__[name].__get__ for cls, name in _GEN_FRAME.items()}
# How many links at each end of a long path are read (8 visible steps are shown of each).
_ENDS = 24
# A long path's depth and runs are memoised every this many links (a climb stops at the nearest).
_MEMO_EVERY = 64
# A run of one attribute is climbed this many links at a time (their owners read in one pass).
_RUN_BLOCK = 4096
# A dict this small is searched for the one child asked about, with nothing cached for its siblings.
_SMALL = 16


# -- naming ------------------------------------------------------------------------------------


class Namer:
    """Turns the walk's parent links into steps, for the objects asked about, with memoised prefixes."""

    def __init__(self, walk: Walk, module_type: type | None) -> None:
        self.walk = walk
        self.module_type = module_type
        self._links: dict[int, tuple[Step, ...]] = {}  # id(child) -> the steps from its parent
        self.parent_of: dict[int, Any] = {}  # id -> parent (or Root), for the objects asked about
        self._reverse: dict[int, dict[int, Any]] = {}  # id(container) -> id(child) -> its key/index
        self._shapes: dict[int, str] = {}
        self._shape_types: list[type] = []  # keeps the types whose ids key _shapes alive
        self._member_cache: dict[int, list[tuple[str, Any]]] = {}
        self.key_paths: set[int] = set()  # ids of the keys a ("keypath", id) step names by their own path
        self._last_member: dict[int, int] = {}  # id(type) -> the member that named a child last
        self._by_parent: dict[int, set[int]] = {}
        self._by_parent_size = -1
        self._candidates: dict[int, list[str]] = {}
        self._getters: dict[tuple[int, str], Callable[[Any], Any]] = {}  # the MRO read once per type and name
        self._depth: dict[int, tuple[int, int, Root]] = {}  # id -> (depth, anchor id, root)
        self._last_climb: tuple[list[int], list[Any]] = ([], [])  # _depth_of's last: node ids, their parents
        self._runs: dict[int, tuple[str, int]] = {}  # id -> (attribute, links of it ending here)
        self._mixed_runs: dict[int, tuple[str, int, int]] = {}  # id -> (attribute, links, steps): a mixed run
        self._data_frame = _loaded_data_frame()  # a path through one is shown df['col'].iloc[i]

    def steps(self, obj_id: int) -> tuple[Root | None, tuple[Step, ...]]:
        """The root and the steps from it to the object with this id (None root: not reached).

        Each link is read once and kept per object (memory linear in the path's length), never a
        whole path per level. A path's depth is memoised per object on the way up, so naming 500
        tensors along a 200,000-node linked list climbs the list once, not once per tensor; a long
        path reads only its two ends and says how deep its middle is.
        """
        parent = self.parent_of
        if obj_id not in parent:
            self.prepare((obj_id,))
        link_of = self._link_of
        forward, root = self._short_climb(obj_id)
        if forward is not None and root is not None:
            steps: list[Step] = []
            at = 0
            frame_type = self._data_frame
            while at < len(forward):
                column = self._pandas_column(forward, at) if frame_type is not None and at + 4 < len(forward) \
                    and type(parent.get(forward[at])) is frame_type else None
                if column is not None:  # df -> _mgr -> blocks -> block -> values -> item: df['emb'].iloc[i]
                    steps.append(column)
                    at += 5
                    continue
                steps.extend(link_of(forward[at]))
                at += 1
            return root, tuple(steps)
        found = self._depth_of(obj_id)  # longer than a path shown whole, or not reached
        if found is None:
            return None, ()
        depth, anchor, root = found
        # Only the ends are shown (8 visible steps each): the middle is never read, only counted.
        head_ids = self._climb(anchor, _ENDS)
        tail_ids = self._climb(obj_id, _ENDS)
        head: list[Step] = []
        used_head = 0
        while used_head < len(head_ids) and sum(map(_visible, head)) < 8:
            head.extend(link_of(head_ids[used_head]))
            used_head += 1
        tail: list[Step] = []
        used_tail = 0
        while used_tail < len(tail_ids) and sum(map(_visible, tail)) < 8:
            used_tail += 1
            tail[:0] = link_of(tail_ids[-used_tail])
        # A key read through an instance's __dict__ (3.10) keeps the dict's step: `.next`, not `['next']`.
        if tail and tail[0][0] == "key" and used_tail < len(tail_ids) and link_of(tail_ids[-used_tail - 1]) == (("",),):
            used_tail += 1
            tail.insert(0, ("",))
        hidden = depth - used_head - used_tail
        last_hidden = tail_ids[-used_tail - 1] if used_tail < len(tail_ids) else None
        same = link_of(last_hidden) if last_hidden is not None else ()
        if last_hidden is not None and len(same) == 1 and same[0][0] in ("attr", "key") and type(same[0][1]) is str \
                and (same[0][0] == "attr" or tail[:1] == [("",)]):
            name = same[0][1]
            if same[0][0] == "attr" and self._run_length(last_hidden, name) >= hidden:
                middle = hidden  # the middle repeats one attribute, each one link (a linked list's .next)
            else:  # each .name one link (a slot, an inline value) or two (the instance's __dict__, then its key)
                dangling = head[-1:] == [("",)]  # the head may end between a dict and its key
                top = head_ids[used_head - 1 - dangling] if used_head > dangling else None
                middle = self._mixed_middle(last_hidden, top, name, hidden + dangling)
                if middle >= 0 and dangling:
                    head.pop()
            if middle >= 0:  # one run with the ends' repeats
                single, pair = [("attr", name)], [("",), ("key", name)]
                while head[-1:] == single or head[-2:] == pair:
                    del head[-len(single if head[-1:] == single else pair):]
                    middle += 1
                while tail[:1] == single or tail[:2] == pair:
                    del tail[:len(single if tail[:1] == single else pair)]
                    middle += 1
                return root, tuple(head + [("run", name, middle)] + tail)
        return root, tuple(head + [("elide", hidden)] + tail)

    def _link_of(self, child_id: int) -> tuple[Step, ...]:
        link = self._links.get(child_id)
        if link is None:
            link = self._links[child_id] = tuple(self._link(self.parent_of[child_id], child_id))
        return link

    def _short_climb(self, obj_id: int) -> tuple[list[int] | None, Root | None]:
        """(the ids from the root down to the object, its root) for a path of at most
        MAX_SHOWN_STEPS links, in one climb; (None, None) for a longer one or one not reached."""
        parent = self.parent_of
        ids: list[int] = []
        node = obj_id
        while len(ids) <= MAX_SHOWN_STEPS:
            up = parent.get(node)
            if up is None:
                return None, None
            if type(up) is Root:
                ids.reverse()
                return ids, up
            ids.append(node)
            node = id(up)
        return None, None

    def _depth_of(self, obj_id: int) -> tuple[int, int, Root] | None:
        """(links from the root, id of the ancestor _ENDS links down, the root), memoised on the way up."""
        memo, parent = self._depth, self.parent_of
        climbed: list[int] = []
        owners: list[Any] = []  # each climbed node's parent: the run check reads them (_run_length)
        node = obj_id
        while node not in memo:
            up = parent.get(node)
            if up is None:
                return None
            if type(up) is Root:
                memo[node] = (0, -1, up)
                break
            climbed.append(node)
            owners.append(up)
            node = id(up)
        self._last_climb = (climbed, owners)
        top, anchor, root = memo[node]
        # climbed[i] lies top + len(climbed) - i links down: the anchor and the memos are picked by
        # index (sparse: memory stays a fraction of the walk's own), with no step per link.
        depth = top + len(climbed)
        if top < _ENDS <= depth:
            anchor = climbed[depth - _ENDS]
        for at in range(depth % _MEMO_EVERY, len(climbed), _MEMO_EVERY):
            memo[climbed[at]] = (depth - at, anchor if depth - at >= _ENDS else -1, root)
        return depth, anchor, root

    def _climb(self, obj_id: int, links: int) -> list[int]:
        """The ids of the last ``links`` objects on the way down to ``obj_id`` (it included), root side first."""
        parent = self.parent_of
        ids: list[int] = []
        node = obj_id
        while len(ids) < links:
            up = parent.get(node)
            if up is None or type(up) is Root:
                break
            ids.append(node)
            node = id(up)
        ids.reverse()
        return ids

    def _run_length(self, obj_id: int, name: str) -> int:
        """How many links up to ``obj_id`` are all ``.name`` (memoised: a list is climbed once)."""
        below, owners = self._last_climb
        # The depth's climb just passed here (the list's nodes below the last path named): its
        # owners are read again, not climbed again.
        at = below.index(obj_id) if obj_id in below[:_ENDS * 2] else -1
        if at < 0 or not owners:
            return self._attribute_run(obj_id, name)
        named = links_named(owners, below, name, at)
        above = self._attribute_run(id(owners[-1]), name) if named == len(below) - at else 0
        return self._memo_run(self._runs, name, below, above, at, at + named)

    def _mixed_middle(self, bottom: int, top: int | None, name: str, links: int) -> int:
        """How many ``.name`` the ``links`` links above ``bottom`` up to ``top`` are, or -1 where they are
        not all ``.name`` (each one link, or two through an instance's ``__dict__``, as 3.10 keeps them)."""
        if top is None:
            return -1
        below_links, below_names = self._mixed_run(bottom, name)
        above_links, above_names = self._mixed_run(top, name)
        # A run through ``top`` climbs on as one from ``top`` does; one stopping short is under ``links`` long.
        return below_names - above_names if below_links - above_links == links else -1

    def _mixed_run(self, obj_id: int, name: str) -> tuple[int, int]:
        """(links, ``.name`` steps) of the run of ``.name`` up to ``obj_id``, each step one link (a slot,
        an inline value) or two (the owner's own ``__dict__``, then its key); memoised as ``_memo_run``."""
        runs, parent = self._mixed_runs, self.parent_of
        climbed: list[int] = []
        marks: list[tuple[int, int]] = []  # (links, steps) from obj_id up to climbed[i]
        node, links, names = obj_id, 0, 0
        above_links = above_names = 0
        while True:
            known = runs.get(node)
            if known is not None and known[0] == name:
                above_links, above_names = known[1], known[2]
                break
            up = parent.get(node)
            if up is None or type(up) is Root:
                break
            if type(up) is dict:  # the node is a value of its owner's own __dict__: the owner is one link further
                owner = parent.get(id(up)) if id(dict.get(up, name, MISSING)) == node else None
                if not _has_own_dict(owner, up):
                    break
                up, width = owner, 2
            elif links_named([up], [node], name):
                width = 1
            else:
                break
            climbed.append(node)
            marks.append((links, names))
            links += width
            names += 1
            node = id(up)
        links += above_links
        names += above_names
        for at in range(len(climbed) % _MEMO_EVERY, len(climbed), _MEMO_EVERY):
            runs[climbed[at]] = (name, links - marks[at][0], names - marks[at][1])
        return links, names

    def _attribute_run(self, obj_id: int, name: str) -> int:
        """``_run_length`` of plain ``.name`` links: climbed a block at a time, each block's owners read
        in one C-level pass per class (a 200,000-node list: no call per node)."""
        runs, parent = self._runs, self.parent_of
        climbed: list[int] = []
        node = obj_id
        length = 0
        while True:
            start = len(climbed)
            owners: list[Any] = []
            while len(owners) < _RUN_BLOCK:
                known = runs.get(node)
                if known is not None and known[0] == name:
                    length = known[1]
                    break
                up = parent.get(node)
                if up is None or type(up) is Root:
                    break
                climbed.append(node)
                owners.append(up)
                node = id(up)
            named = start + links_named(owners, climbed[start:], name)
            if named < len(climbed):  # a link that is not .name ends the run there
                del climbed[named:]
                length = 0
                break
            if len(owners) < _RUN_BLOCK:
                break
        return self._memo_run(runs, name, climbed, length)

    @staticmethod
    def _memo_run(runs: dict[int, tuple[str, int]], name: str, climbed: list[int], length: int, start: int = 0,
                  end: int | None = None) -> int:
        """The run's length at ``climbed[start]``, the run being ``climbed[start:end]`` then ``length`` links
        above; memoised by index, as in ``_depth_of`` (climbed[i] ends a run of ``total - i + start``)."""
        end = len(climbed) if end is None else end
        total = length + end - start
        for at in range(start + total % _MEMO_EVERY, end, _MEMO_EVERY):
            runs[climbed[at]] = (name, total - at + start)
        return total

    def _link(self, parent: Any, child_id: int) -> list[Step]:
        """How ``parent`` refers to the object with id ``child_id``, read at C level."""
        try:
            return self._link_unsafe(parent, child_id)
        except Exception:
            return [("via", qualname(type(parent)))]

    def _shape_of(self, cls: type) -> str:
        """Which kind of link reading applies to instances of ``cls`` (decided once per type)."""
        known = self._shapes.get(id(cls))
        if known is not None:
            return known
        shape = "inst"
        exact = {types.FunctionType: "func", types.FrameType: "frame", types.TracebackType: "tb",
                 types.CellType: "cell", types.GeneratorType: "gen", types.CoroutineType: "gen",
                 types.AsyncGeneratorType: "gen"}
        for t, name in exact.items():
            if cls is t:
                shape = name
                break
        else:
            ndarray = self.walk.ndarray
            for base, name in ((dict, "dict"), (list, "list"), (tuple, "tuple"), (deque_type(), "deque"),
                               (set, "set"), (frozenset, "frozenset"), (ndarray, "ndarray"),
                               (BaseException, "exc")):
                if base is not None and mro_has(cls, base):
                    shape = name
                    break
            if shape == "inst" and type_name(cls) == "_lru_cache_wrapper":
                shape = "lru"
        self._shapes[id(cls)] = shape
        self._shape_types.append(cls)
        return shape

    def _members(self, cls: type) -> list[tuple[str, Any]]:
        """The slots and C members along ``cls``'s MRO, read from the class dicts (no user code)."""
        known = self._member_cache.get(id(cls))
        if known is None:
            known = [(name, value) for klass in type_mro(cls) for name, value in mapping_items(klass)
                     if type(value) is types.MemberDescriptorType and type(name) is str]
            self._member_cache[id(cls)] = known
        return known

    def _inline_name(self, obj: Any, cls: type, child_id: int) -> str | None:
        """The attribute holding the child, tried by the names the class's methods assign
        (``self.x = ...``), read without making the instance's ``__dict__``."""
        names = self._candidates.get(id(cls))
        if names is None:
            names = self._candidates[id(cls)] = _assigned_names(cls) if plain_dict_slot(cls) else []
        getters = self._getters
        for name in names:
            read = getters.get((id(cls), name))
            if read is None:
                read = getters[(id(cls), name)] = attribute_getter(cls, name)
            value = read(obj)
            if value is not MISSING and id(value) == child_id:
                return name
        return None

    def _link_unsafe(self, parent: Any, child_id: int) -> list[Step]:
        cls = type(parent)
        shape = self._shape_of(cls)
        if shape == "inst":  # the most common link first (records, modules)
            return self._instance_link(parent, cls, child_id)
        if shape == "list":
            return [("index", self._index_of(parent, child_id, list.__iter__))]
        if shape == "func":
            closure = parent.__closure__
            if closure is not None and id(closure) == child_id:
                return [("", "__closure__")]
            if id(parent.__defaults__) == child_id:
                return [("attr", "__defaults__")]
            if id(parent.__kwdefaults__) == child_id:
                return [("attr", "__kwdefaults__")]
            return [("",)]  # its __dict__: the next step is an attribute
        if shape == "frame":
            local = parent.f_locals
            names = self._reverse_map(parent, local, child_id) if type(local) is dict else {}
            return [("local", parent.f_code.co_name, names.get(child_id, "?"))]
        if shape == "gen":  # a suspended generator holds its frame's locals: name the local
            attr = _GEN_FRAME[type(parent)]
            frame = _GEN_FRAME_OF[type(parent)](parent)
            local = frame.f_locals if frame is not None else None
            names = self._reverse_map(parent, local, child_id) if type(local) is dict else {}
            if child_id in names and type(names[child_id]) is str:
                return [("genlocal", attr, names[child_id])]
            return [("via", qualname(cls))]
        if shape == "tb":
            return [("tb",)]
        if shape == "cell":
            return [("cell",)]
        if shape == "dict":
            values = self._reverse_map(parent, parent, child_id)
            if child_id in values:
                return [self._key_step(values[child_id])]
            for key in dict.keys(parent):
                if id(key) == child_id:
                    return [("iskey", qualname(type(key)))]
            if cls is not dict:  # a dict subclass's own attribute
                return self._instance_link(parent, cls, child_id)
            return [("via", qualname(cls))]
        if shape == "tuple" and self._is_closure_of_parent(parent):
            return [("closure", self._index_of(parent, child_id, tuple.__iter__))]
        if shape == "list" or shape == "tuple" or shape == "deque":
            it = list.__iter__ if shape == "list" else tuple.__iter__ if shape == "tuple" else deque_iter()
            return [("index", self._index_of(parent, child_id, it))]
        if shape == "set" or shape == "frozenset":
            it = set.__iter__ if shape == "set" else frozenset.__iter__
            return [("member", self._index_of(parent, child_id, it))]
        if shape == "ndarray":
            ndarray = self.walk.ndarray
            index = self._index_of(parent, child_id, lambda a: iter(array_items(a, ndarray)))
            return [("flat", index, ndarray.ndim.__get__(parent))]
        if shape == "lru":
            d = instance_dict_if_present(parent)
            if d is not None and id(d) == child_id:
                return [("",)]
            if type(find_referent(gc.get_referents(parent), child_id)) is dict:
                return [("", "cache")]
            return [("cache",)]
        if shape == "exc":
            for name in ("args", "__traceback__", "__cause__", "__context__"):
                value = BaseException.__dict__[name].__get__(parent)
                if id(value) == child_id:
                    return [("",)] if name == "__traceback__" else [("attr", name)]
        return self._instance_link(parent, cls, child_id)

    def _instance_link(self, parent: Any, cls: type, child_id: int) -> list[Step]:
        """An instance's link: a slot or C member, its __dict__ (already there), or an inline attribute."""
        members = self._members(cls)
        last = self._last_member.get(id(cls), 0)  # the slot that held the child last time, tried first
        for at in chain((last,), range(len(members))) if members else ():
            name, member = members[at]
            try:
                if id(member.__get__(parent, cls)) == child_id:
                    self._last_member[id(cls)] = at
                    return [("attr", name)]
            except Exception:
                continue
        d = instance_dict_if_present(parent)
        if d is not None and id(d) == child_id:
            return [("",)]
        inline = self._inline_name(parent, cls, child_id)
        if inline is not None:
            return [("attr", inline)]
        # Last resort: the instance's dict (made now on 3.11+ if its attributes were inline; only
        # for an object on a path being shown, whose attribute no method of its class names).
        d = instance_attributes(parent)
        if d:
            for name, value in dict.items(d):
                if id(value) == child_id and type(name) is str:
                    return [("attr", name)]
        return [("via", qualname(cls))]

    def _pandas_column(self, forward: list[int], at: int) -> Step | None:
        """``('pandas', column, row)`` where the path goes from a DataFrame through a block's values.

        Asked by ``steps`` only where ``forward[at]``'s parent is exactly pandas' DataFrame and four more
        links follow. Read through pandas' own attributes (library code); any doubt and the path is
        shown link by link instead.
        """
        frame: Any = self.parent_of.get(forward[at])
        try:
            parent_of = self.parent_of
            block, array = parent_of[forward[at + 3]], parent_of[forward[at + 4]]
            ndarray = self.walk.ndarray
            if ndarray is None or type(array) is not ndarray or array.ndim != 2 or array is not block.values:
                return None
            index = self._index_of(array, forward[at + 4], lambda a: iter(array_items(a, ndarray)))
            rows = array.shape[1]
            position = int(block.mgr_locs.as_array[index // rows])
            label = frame.columns[position]
            if not is_plain_key(label):
                return None
            return ("pandas", label, index % rows)
        except Exception:
            return None

    def prepare(self, ids: Iterable[int]) -> None:
        """Read the parents of these objects and their ancestors back from the walk, in one pass."""
        wanted = [i for i in ids if i not in self.parent_of]
        if wanted:
            self.parent_of.update(self.walk.parents_of(wanted))

    def _is_closure_of_parent(self, tup: Any) -> bool:
        up = self.parent_of.get(id(tup))
        return type(up) is types.FunctionType and up.__closure__ is tup

    def _key_step(self, key: Any) -> Step:
        if is_plain_key(key):
            return ("key", key)
        if self.walk.reached(id(key)) or id(key) in self.walk.roots:
            self.key_paths.add(id(key))
            return ("keypath", id(key), qualname(type(key)))
        return ("keytype", qualname(type(key)))

    def _needed(self, container: Any, child_id: int) -> set[int]:
        """Ids of the children of ``container`` on the paths being named (so a huge container is
        searched once, in a C-level pass, for just those)."""
        if self._by_parent_size != len(self.parent_of):
            by_parent: dict[int, set[int]] = {}
            for cid, up in self.parent_of.items():
                by_parent.setdefault(id(up), set()).add(cid)
            self._by_parent, self._by_parent_size = by_parent, len(self.parent_of)
        return self._by_parent.get(id(container), set()) | {child_id}

    def _reverse_map(self, container: Any, mapping: dict, child_id: int) -> dict[int, Any]:
        """id(value) -> its key in ``mapping`` for the children being named (the first key wins)."""
        if dict.__len__(mapping) <= _SMALL:  # a record-like dict (one per tensor): its first match, nothing kept
            key = next(compress(dict.keys(mapping), map(child_id.__eq__, map(id, dict.values(mapping)))), MISSING)
            return {} if key is MISSING else {child_id: key}
        cached = self._reverse.get(id(container))
        if cached is None or child_id not in cached:
            needed = self._needed(container, child_id)
            mask = list(map(needed.__contains__, map(id, dict.values(mapping))))
            keys = list(compress(dict.keys(mapping), mask))
            values = list(compress(dict.values(mapping), mask))
            cached = dict(zip(map(id, reversed(values)), reversed(keys)))
            self._reverse[id(container)] = cached
        return cached

    def _index_of(self, container: Any, child_id: int, iterate: Callable[[Any], Any]) -> int:
        """The position of a child in a sequence, set or array (found with those of its siblings being named).

        A list's or tuple's child the walk read as its item has its index from the walk: checked by one
        read, never searched for (naming 1,000 items of a 280,000-item list reads 1,000 items, not all)."""
        at = self.walk.indexes.get(child_id)
        item_at = list.__getitem__ if iterate is list.__iter__ else tuple.__getitem__ if iterate is tuple.__iter__ \
            else None
        if at is not None and item_at is not None:
            try:
                if id(item_at(container, at)) == child_id:
                    return at
            except IndexError:
                pass
        cached = self._reverse.get(id(container))
        if cached is None or child_id not in cached:
            needed = self._needed(container, child_id)
            items = list(iterate(container))
            cached = {}
            for at in reversed(list(compress(count(), map(needed.__contains__, map(id, items))))):
                cached[id(items[at])] = at  # reversed: the first position wins
            del items
            self._reverse[id(container)] = cached
        return cached.get(child_id, -1)

    def clear(self) -> None:
        self._links.clear()
        self._depth.clear()
        self._last_climb = ([], [])
        self._runs.clear()
        self._mixed_runs.clear()
        self.parent_of.clear()
        self._reverse.clear()
        self._shapes.clear()
        self._shape_types.clear()
        self._member_cache.clear()
        self.key_paths.clear()
        self._last_member.clear()
        self._candidates.clear()
        self._getters.clear()


def _loaded_data_frame() -> type | None:
    """pandas' DataFrame where pandas is loaded (looked up once per naming, not once per link)."""
    try:
        found = getattr(sys.modules.get("pandas"), "DataFrame", None)
    except Exception:
        return None
    return found if type(found) is type else None


def _has_own_dict(owner: Any, attributes: dict) -> bool:
    """Whether ``attributes`` is ``owner``'s own ``__dict__``, read through CPython's slot (no code runs)."""
    if owner is None or type(owner) is Root or not plain_dict_slot(type(owner)):
        return False
    try:
        return object.__getattribute__(owner, "__dict__") is attributes
    except Exception:
        return False


def _visible(step: Step) -> bool:
    return not (step[0] in ("", "tb", "cell") and len(step) == 1)


def _assigned_names(cls: type) -> list[str]:
    """Names the functions in ``cls``'s MRO dicts use as attributes (``co_names``), in order, once each."""
    seen: dict[str, None] = {}
    try:
        for klass in type_mro(cls):
            if klass is object:
                continue
            for _, value in mapping_items(klass):
                if type(value) is types.FunctionType:
                    code = value.__code__
                    for name in code.co_names:
                        if type(name) is str:
                            seen.setdefault(name)
    except Exception:
        pass
    return list(seen)
