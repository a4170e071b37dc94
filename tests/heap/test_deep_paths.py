"""A long path says how deep it is: ``head(.next ×4,000).value``, not a row of identical ``.next``.

Named through ``%gpumem -o`` in a real shell, walked on the first scan and re-read from the
remembered run on the next; a chain whose middle is not one repeated attribute says how many links
it leaves out.
"""
from __future__ import annotations

from oom_magic.heap.holders import forget_paths

LIST = """
import torch
class Node:
    def __init__(self, value, next):
        self.value = value
        self.next = next
head = None
for i in range(5000, -1, -1):
    head = Node(torch.ones(1 + i // 1000) if i % 1000 == 0 and i else i, head)
"""


def _user_paths(snap) -> dict[str, int]:
    return {r.holder_path: r.bytes for r in snap.storages if r.holder_kind == "user"}


def test_a_linked_lists_tensors_are_named_by_their_depth(ip):
    assert ip.run_cell(LIST, store_history=True).success
    forget_paths()
    want = {"head(.next ×1,000).value": 8, "head(.next ×2,000).value": 12, "head(.next ×3,000).value": 16,
            "head(.next ×4,000).value": 20, "head(.next ×5,000).value": 24}
    for _ in range(2):  # walked, then the remembered run re-read
        assert _user_paths(ip.run_line_magic("gpumem", "-o --device cpu --all")) == want
    # The list changes: a node goes, so every path past it is one link shorter.
    assert ip.run_cell("head.next.next = head.next.next.next", store_history=True).success
    shorter = {p.replace(f"×{n:,}", f"×{n - 1:,}"): b for (p, b), n in zip(want.items(), range(1000, 6000, 1000))}
    assert _user_paths(ip.run_line_magic("gpumem", "-o --device cpu --all")) == shorter


def test_a_deep_chain_of_mixed_links_says_how_many_it_leaves_out(ip):
    assert ip.run_cell("import torch\nclass A:\n    pass\nroot = A()\nnode = root\n"
                       "for i in range(300):\n"
                       "    child = A()\n"
                       "    setattr(node, 'left' if i % 2 else 'right', child)\n"
                       "    node = child\n"
                       "node.t = torch.ones(7)\ndel node, child", store_history=True).success
    forget_paths()
    (path,) = _user_paths(ip.run_line_magic("gpumem", "-o --device cpu --all"))
    assert path.startswith("root.right.left.right.left") and path.endswith(".right.left.t")
    shown = path.count(".left") + path.count(".right")
    assert f" …{300 - shown:,} more… " in path


def test_the_quick_view_names_a_linked_lists_tensors_by_their_depth_too(ip):
    """The after-cell hook's quick view (no heap pass) collects tensors as its walk meets them; one that
    a node alone holds is met on a followed chain, and is named as %gpumem names it."""
    import oom_magic
    from oom_magic.heap.roots import collect_roots

    assert ip.run_cell(LIST, store_history=True).success
    forget_paths()
    snap = oom_magic.snapshot("cpu", roots=collect_roots(namespace=ip.user_ns), heap_scan=False, budget_seconds=60)
    assert not snap.heap_scan and snap.attribution_complete
    assert _user_paths(snap) == {f"head(.next ×{n:,}).value": 4 * (1 + n // 1000) for n in range(1000, 6000, 1000)}
