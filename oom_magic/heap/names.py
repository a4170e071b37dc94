"""Name the way to an object the walk reached: the steps from its root (``Namer``); the text a user
would type for them is ``path_text.render``.

Each parent-to-child link is read by ``links.Links`` and kept as *steps* (plain strings and ints, no
references), which ``resolve.resolve`` re-reads later to check a remembered path still reaches the
same object. Here: the climbs from an object to its root, a long path's depth and its runs of one
attribute (``head(.next ×199,600).value``), memoised so that many paths along one chain climb it once.
"""
from __future__ import annotations

import sys
from itertools import chain, compress, count, islice
from typing import Any
from collections.abc import Iterable

from .links import Links
from .path_text import MAX_SHOWN_STEPS, Step
from .reads import MISSING, links_named, plain_dict_slot
from .walk import Root, Walk

# How many links at each end of a long path are read (8 visible steps are shown of each).
_ENDS = 24
# A long path's depth and runs are memoised every this many links (a climb stops at the nearest).
_MEMO_EVERY = 64
# A run of one attribute is climbed this many links at a time (their owners read in one pass).
_RUN_BLOCK = 4096


# -- naming ------------------------------------------------------------------------------------


class Namer:
    """Turns the walk's parent links into steps, for the objects asked about, with memoised prefixes."""

    def __init__(self, walk: Walk, module_type: type | None) -> None:
        self.walk = walk
        self.module_type = module_type
        self._links: dict[int, tuple[Step, ...]] = {}  # id(child) -> the steps from its parent
        self.parent_of: dict[int, Any] = {}  # id -> parent (or Root), for the objects asked about
        self.links = Links(walk, self.parent_of)  # how each parent refers to its child
        self.key_paths = self.links.key_paths  # ids of the keys a ("keypath", id) step names by their own path
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
        on_chain = self.walk.chain_above(obj_id)  # deeper on a chain than a path shown whole: no short climb
        forward, root = (None, None) if on_chain is not None and len(on_chain[0]) > MAX_SHOWN_STEPS \
            else self._short_climb(obj_id)
        if forward is not None and root is not None:
            steps: list[Step] = []
            at = 0
            frame_type = self._data_frame
            while at < len(forward):
                column = self.links.pandas_column(forward, at) if frame_type is not None and at + 4 < len(forward) \
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
                while cut := _name_steps(head, name, at_end=True):
                    del head[-cut:]
                    middle += 1
                while cut := _name_steps(tail, name, at_end=False):
                    del tail[:cut]
                    middle += 1
                return root, tuple(head + [("run", name, middle)] + tail)
        return root, tuple(head + [("elide", hidden)] + tail)

    def _link_of(self, child_id: int) -> tuple[Step, ...]:
        link = self._links.get(child_id)
        if link is None:
            link = self._links[child_id] = tuple(self.links.link(self.parent_of[child_id], child_id))
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
        memo, parent, chain_above = self._depth, self.parent_of, self.walk.chain_above
        climbed: list[int] = []
        owners: list[Any] = []  # each climbed node's parent: the run check reads them (_run_length)
        starts: list[int] = []  # where in ``climbed`` each segment taken whole starts: memoised too
        node = obj_id
        while node not in memo:
            above = chain_above(node)
            if above is not None and len(above[0]) > 1:  # a linked list's segment in one step
                starts.append(len(climbed))
                climbed.extend(above[0])
                owners.extend(above[1])
                node = above[2]
                continue
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
        for at in chain(range(depth % _MEMO_EVERY, len(climbed), _MEMO_EVERY), starts):
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
        runs = self._runs
        # Read up to the first node whose run is known (a climb may go on past it, a segment at a time).
        end = next(compress(count(at), map(runs.__contains__, islice(below, at, None))), len(below))
        known = runs[below[end]] if end < len(below) else None
        if known is not None and known[0] != name:
            end, known = len(below), None
        named = links_named(owners, below, name, at, end)
        if named < end - at:  # a link that is not .name ends the run below the known one
            above = 0
        elif known is not None:
            above = known[1]
        else:
            above = self._attribute_run(id(owners[-1]), name)
        return self._memo_run(runs, name, below, above, at, at + named)

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

    def prepare(self, ids: Iterable[int]) -> None:
        """Read the parents of these objects and their ancestors back from the walk, in one pass."""
        wanted = [i for i in ids if i not in self.parent_of]
        if wanted:
            self.parent_of.update(self.walk.parents_of(wanted))

    def clear(self) -> None:
        self._links.clear()
        self._depth.clear()
        self._last_climb = ([], [])
        self._runs.clear()
        self._mixed_runs.clear()
        self.parent_of.clear()
        self.links.clear()


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


def _name_steps(steps: list[Step], name: str, at_end: bool) -> int:
    """How many steps one ``.name`` takes at the end (``at_end``) or start of ``steps``: 1 (an attribute),
    2 (an instance's ``__dict__``, then its key), 0 (it is not there)."""
    if (steps[-1:] if at_end else steps[:1]) == [("attr", name)]:
        return 1
    return 2 if (steps[-2:] if at_end else steps[:2]) == [("",), ("key", name)] else 0


def _visible(step: Step) -> bool:
    return not (step[0] in ("", "tb", "cell") and len(step) == 1)
