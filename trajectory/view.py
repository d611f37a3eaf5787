"""A message tree as plain data for display (the trajectory viewer draws it): no tokens, no arrays."""

from __future__ import annotations

from typing import Any

from .tree import LINK_NAMES, Node, Tree

#: Characters of a message kept as its preview.
PREVIEW_CHARS = 160


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for block in content:
            if isinstance(block, dict):
                text = block.get("text")
                parts.append(text if isinstance(text, str) else f"[{block.get('type', 'block')}]")
        return " ".join(parts)
    return "" if content is None else str(content)


def preview(message: Any, limit: int = PREVIEW_CHARS) -> str:
    """One line summing up a chat message: its text, else its tool calls' names."""
    if not isinstance(message, dict):
        return str(message)[:limit]
    text = " ".join(_text(message.get("content")).split())
    calls = message.get("tool_calls") or []
    names = [str((c.get("function") or {}).get("name") or c.get("name") or "?") for c in calls
             if isinstance(c, dict)]
    if names:
        text = (text + " " if text else "") + "→ " + ", ".join(names)
    return text[:limit] + ("…" if len(text) > limit else "")


def tree_view(tree: Tree, *, max_nodes: int = 20000) -> dict[str, Any]:
    """Every node of ``tree`` in depth-first order (children in insertion order, as the linearizer
    visits them): ``id``, ``parent`` (``None`` for the root's children), ``role``, ``preview``, and for
    a generated node its ``turn`` id, ``output_tokens``, ``policy_version`` (``None``: none known), ``link``
    (``first``/``clean``/``replace``: its
    tokens realigned and masked/``break``: a new sample starts) and ``rewrites`` (replays merged into
    it); ``leaf`` is the leaf's index, which samples name as ``metadata["branch"]``; ``forks`` counts
    the children of a node with more than one. Past ``max_nodes`` the rest is cut (``truncated``)."""
    nodes: list[dict[str, Any]] = []
    ids: dict[int, int] = {}
    leaf = 0
    truncated = False
    stack: list[Node] = list(reversed(tree.root.children or []))
    while stack:
        node = stack.pop()
        if len(nodes) >= max_nodes:
            truncated = True
            break
        ids[id(node)] = len(nodes)
        msg = node.message if isinstance(node.message, dict) else {}
        entry: dict[str, Any] = {
            "id": len(nodes),
            "parent": None if node.parent is None or node.parent is tree.root else ids.get(id(node.parent)),
            "role": str(msg.get("role", "?")),
            "preview": preview(node.message),
        }
        if node.children and len(node.children) > 1:
            entry["forks"] = len(node.children)
        turn = node.turn
        if turn is not None:
            entry["turn"] = turn.seq
            entry["output_tokens"] = turn.output_len
            entry["link"] = LINK_NAMES.get(turn.link, str(turn.link))
            entry["policy_version"] = turn.policy_version
        meta = node.metadata or {}
        if meta.get("rewrites"):
            entry["rewrites"] = [{"turn_id": r.get("turn_id"), "replaced": preview(r.get("replaced_message"))}
                                 for r in meta["rewrites"]]
        if meta.get("empty_turns"):
            entry["empty_turns"] = [e.get("turn_id") for e in meta["empty_turns"]]
        if not node.children:
            entry["leaf"] = leaf
            leaf += 1
        nodes.append(entry)
        if node.children:
            stack.extend(reversed(node.children))
    return {"nodes": nodes, "leaves": leaf, "truncated": truncated}
