"""The tree(s) a tree schedule uses: which ranks, each rank's role, and a layout for drawing them.

n ranks; x a rank's in-order position in a tree (its column in a drawing), d its depth (its row).
"""

from __future__ import annotations

from dataclasses import dataclass

from ringtree.schedules.tree import Tree, double_trees, inorder_tree, rooted_tree

TREE_ALGORITHMS = {
    ("all_reduce", "tree"),
    ("all_reduce", "double_tree"),
    ("broadcast", "tree"),
    ("reduce", "tree"),
}


@dataclass(frozen=True)
class Shown:
    """One tree and what it carries, e.g. 'the first half of the buffer'."""

    tree: Tree
    carries: str


def trees_of(collective: str, algorithm: str, p: int, root: int = 0) -> list[Shown]:
    """The trees the schedule for (collective, algorithm) builds over p ranks ([] for non-tree schedules)."""
    if (collective, algorithm) not in TREE_ALGORITHMS:
        return []
    if algorithm == "double_tree":
        first, second = double_trees(p)
        return [Shown(first, "the first half of the buffer"), Shown(second, "the second half")]
    if collective == "all_reduce":
        return [Shown(inorder_tree(list(range(p))), "the whole buffer")]
    return [Shown(rooted_tree(p, root), "the whole buffer")]


def role(tree: Tree, r: int) -> str:
    """'root', 'interior' or 'leaf'."""
    if tree.parent[r] < 0:
        return "root"
    return "interior" if tree.children[r] else "leaf"


def interior_in_all(trees: list[Shown]) -> set[int]:
    """Ranks that forward data (have children) in every tree: empty for a proper double binary tree."""
    sets = [t.tree.interior() for t in trees]
    return set.intersection(*sets) if sets else set()


def positions(tree: Tree) -> dict[int, int]:
    """Each rank's in-order position: the first child is the left one (ringtree's trees are in-order)."""
    out: dict[int, int] = {}
    stack: list[tuple[int, bool]] = [(tree.root, False)]
    while stack:
        r, expanded = stack.pop()
        kids = tree.children[r]
        if expanded or not kids:
            out[r] = len(out)
            continue
        for c in reversed(kids[1:]):
            stack.append((c, False))
        stack.append((r, True))
        stack.append((kids[0], False))
    return out


def ascii_lines(tree: Tree) -> list[str]:
    """The tree top-down: a row per depth, each rank in its in-order column, '/' and '\\' to its children."""
    x, d = positions(tree), tree.depths()
    width = max(len(str(r)) for r in x) + 1
    depth = max(d.values())
    rows: list[list[str]] = [[" "] * (width * len(x)) for _ in range(2 * depth + 1)]
    for r, col in x.items():
        label = str(r)
        start = col * width
        rows[2 * d[r]][start : start + len(label)] = list(label)
        for c in tree.children[r]:
            mid = (col + x[c]) * width // 2
            rows[2 * d[r] + 1][mid] = "/" if x[c] < col else "\\"
    return ["".join(row).rstrip() for row in rows]
