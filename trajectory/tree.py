"""The per-session message tree and its delta-encoded token store.

Each :class:`Node` is one message.  Prompt messages nobody generated here are *routing*
nodes; every answered turn adds a *generated* leaf that carries a :class:`StoredTurn`.

Token storage: a turn's prompt is stored as ``shared`` tokens borrowed from its *base*
(the nearest generated ancestor, i.e. the previous turn on the same path) plus its own
``suffix``.  A 200-turn session whose prompts share a 100k-token prefix therefore stores
that prefix once.  ``shared`` is also exactly the common-prefix length the linearizer needs,
so it is computed once, at record time, and the turn's link to its base (clean, replace,
break) is fixed then.

Everything here is iterative: no recursion over the tree or the base chain.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from itertools import compress, islice
from typing import Any

import numpy as np

from ._tokens import LogprobArray, TokenArray, common_prefix_len, owned_copy
from .normalize import MessageKey, tool_names
from .types import TurnRecord

# How a turn's prompt relates to the tokens of its base (the previous turn on its path).
FIRST = 0  # no previous turn
CLEAN = 1  # prompt starts with base prompt + base output
REPLACE = 2  # prompt drifts only inside the base's output, which is short: replace it, mask it
BREAK = 3  # any other drift: start a new sample with this prompt

LINK_NAMES = {FIRST: "first", CLEAN: "clean", REPLACE: "replace", BREAK: "break"}

# Children are scanned linearly (most nodes have one or two); past this many a dict index is built.
_INDEX_AT = 8


class StoredTurn:
    """A recorded generation, delta-encoded against its base turn."""

    __slots__ = (
        "base",
        "depth",
        "finish_reason",
        "ill_formed",
        "link",
        "logprobs",
        "node",
        "output",
        "prompt_len",
        "seq",
        "shared",
        "suffix",
        "tools",
    )

    def __init__(
        self,
        *,
        seq: int,
        base: StoredTurn | None,
        shared: int,
        prompt_len: int,
        suffix: TokenArray,
        output: TokenArray,
        logprobs: LogprobArray | None,
        finish_reason: str,
        ill_formed: bool,
        link: int,
        tools: tuple[str, ...],
    ) -> None:
        self.seq = seq
        self.base = base
        self.depth: int = 0 if base is None else base.depth + 1
        self.shared = shared
        self.prompt_len = prompt_len
        self.suffix = suffix
        self.output = output
        self.logprobs = logprobs
        self.finish_reason = finish_reason
        self.ill_formed = ill_formed
        self.link = link
        self.tools = tools
        self.node: Node | None = None

    @property
    def output_len(self) -> int:
        return int(self.output.shape[0])

    @property
    def full_len(self) -> int:
        """Length of prompt + output."""
        return self.prompt_len + int(self.output.shape[0])

    def nbytes(self) -> int:
        """Bytes of token/logprob payload held by this turn."""
        return int(
            self.suffix.nbytes + self.output.nbytes + (0 if self.logprobs is None else self.logprobs.nbytes)
        )


class Node:
    """One message in the tree."""

    __slots__ = ("_index", "children", "key", "khash", "message", "metadata", "parent", "turn", "turn_anc")

    def __init__(self, key: MessageKey | None, message: Any, parent: Node | None) -> None:
        self.key = key
        self.khash = hash(key)
        self.message = message
        self.parent = parent
        self.children: list[Node] | None = None
        self._index: dict[MessageKey | None, Node] | None = None
        self.turn: StoredTurn | None = None
        # Nearest generated turn at or above this node: the base for turns mounted below.
        self.turn_anc: StoredTurn | None = None if parent is None else parent.turn_anc
        self.metadata: dict[str, Any] | None = None

    @property
    def is_generated(self) -> bool:
        return self.turn is not None

    def meta(self) -> dict[str, Any]:
        if self.metadata is None:
            self.metadata = {}
        return self.metadata

    def find_child(self, key: MessageKey, khash: int) -> Node | None:
        """The most recently added child with this key, if any."""
        if self._index is not None:
            return self._index.get(key)
        children = self.children
        if children:
            for i in range(len(children) - 1, -1, -1):
                c = children[i]
                if c.khash == khash and c.key == key:
                    return c
        return None

    def add_child(self, child: Node) -> None:
        if self.children is None:
            self.children = [child]
        else:
            self.children.append(child)
        if self._index is not None:
            self._index[child.key] = child
        elif len(self.children) > _INDEX_AT:
            # Later children overwrite earlier ones: the index holds the most recent per key.
            self._index = {c.key: c for c in self.children}

    def rekey_child(self, child: Node, new_key: MessageKey) -> None:
        old_key = child.key
        child.key = new_key
        child.khash = hash(new_key)
        if self._index is not None:
            if self._index.get(old_key) is child:
                del self._index[old_key]
                for c in reversed(self.children or ()):
                    if c.key == old_key:
                        self._index[old_key] = c
                        break
            self._index[new_key] = child


def copy_message(message: Any) -> Any:
    """Private deep copy of a JSON-like message (dicts and lists; scalars shared), iteratively."""
    if not isinstance(message, Mapping | list):
        return message
    top: Any = dict(message) if isinstance(message, Mapping) else list(message)
    stack = [top]
    while stack:
        container = stack.pop()
        items = container.items() if isinstance(container, dict) else enumerate(container)
        for k, v in list(items):
            if isinstance(v, Mapping):
                v = dict(v)
                container[k] = v
                stack.append(v)
            elif isinstance(v, list):
                v = list(v)
                container[k] = v
                stack.append(v)
    return top


def _common_valid(a: StoredTurn | None, b: StoredTurn) -> int:
    """Length of a prefix known to be equal in full(a) and full(b), from the base links alone.

    Walks both base chains up to their common ancestor; every step up keeps only the
    ``shared`` tokens the lower turn has in common with its base.
    """
    if a is None:
        return 0
    if a is b:
        return a.full_len
    va = a.full_len
    vb = b.full_len
    x: StoredTurn | None = a
    y: StoredTurn | None = b
    while x is not y:
        if x is None or y is None:
            return 0
        if x.depth >= y.depth:
            va = min(va, x.shared)
            x = x.base
        else:
            vb = min(vb, y.shared)
            y = y.base
    return min(va, vb)


def _fill(buf: TokenArray, turn: StoredTurn, lo: int) -> None:
    """Write full(turn)[lo:] (prompt + output) into ``buf[lo:]`` by walking the base chain back."""
    hi = turn.full_len
    cur: StoredTurn | None = turn
    while hi > lo and cur is not None:
        p = cur.prompt_len
        if hi > p:
            a = max(lo, p)
            buf[a:hi] = cur.output[a - p : hi - p]
            hi = a
            if hi <= lo:
                break
        s = cur.shared
        if hi > s:
            a = max(lo, s)
            buf[a:hi] = cur.suffix[a - s : hi - s]
            hi = a
        cur = cur.base  # hi <= s now: the rest comes from the base


class Tree:
    """One message tree (a session has a main tree and a side-call tree)."""

    def __init__(self, fork_threshold_tokens: int) -> None:
        self.threshold = fork_threshold_tokens
        self.root = Node(None, None, None)
        self.turns_recorded = 0
        self.generated_turns = 0
        # The most recently recorded root path and, per position, the last message object
        # seen there: the next request usually repeats it, and a C-level list comparison
        # against it replaces a per-message Python walk.
        self._path_nodes: list[Node] = []
        self._path_raws: list[Any] = []
        # full(buf_turn) materialized: the base of the next turn is almost always the last
        # turn, so its common prefix is one vectorized compare against this buffer.
        self._buf: TokenArray = np.zeros(0, dtype=np.int32)
        self._buf_turn: StoredTurn | None = None

    # ----------------------------------------------------------------- tokens
    def _ensure_capacity(self, n: int, keep: int) -> None:
        if self._buf.shape[0] < n:
            # 1/8 slack keeps growth geometric (amortized O(1) per token) with little waste.
            new = np.empty(n + (n >> 3) + 64, dtype=np.int32)
            new[:keep] = self._buf[:keep]
            self._buf = new

    def load(self, turn: StoredTurn) -> TokenArray:
        """Make the buffer hold full(turn); returns a view of exactly those tokens."""
        if self._buf_turn is not turn:
            valid = _common_valid(self._buf_turn, turn)
            self._ensure_capacity(turn.full_len, keep=valid)
            _fill(self._buf, turn, valid)
            self._buf_turn = turn
        return self._buf[: turn.full_len]

    def take_buffer(self) -> TokenArray:
        """Hand the buffer over (the caller owns it now); the tree starts a new one when needed."""
        buf = self._buf
        self._buf = np.zeros(0, dtype=np.int32)
        self._buf_turn = None
        return buf

    def prompt_ids(self, turn: StoredTurn) -> TokenArray:
        """A fresh copy of a stored turn's whole prompt."""
        return self.load(turn)[: turn.prompt_len].copy()

    def _store(
        self, record: TurnRecord, base: StoredTurn | None, seq: int, tools: tuple[str, ...]
    ) -> StoredTurn:
        prompt = record.prompt_ids
        plen = int(prompt.shape[0])
        if base is None:
            shared, link = 0, FIRST
        else:
            base_full = self.load(base)
            shared = common_prefix_len(prompt, base_full)
            if shared == base.full_len:
                link = CLEAN
            elif shared >= base.prompt_len and base.output_len < self.threshold:
                link = REPLACE
            else:
                link = BREAK
        turn = StoredTurn(
            seq=seq,
            base=base,
            shared=shared,
            prompt_len=plen,
            suffix=owned_copy(prompt[shared:]),
            output=owned_copy(record.output_ids),
            logprobs=None if record.output_logprobs is None else record.output_logprobs.copy(),
            finish_reason=record.finish_reason,
            ill_formed=record.ill_formed,
            link=link,
            tools=tools,
        )
        # Advance the buffer from full(base) (loaded above) to full(turn): only the new
        # tokens are written.
        self._ensure_capacity(turn.full_len, keep=shared)
        self._buf[shared:plen] = turn.suffix
        self._buf[plen : turn.full_len] = turn.output
        self._buf_turn = turn
        return turn

    # --------------------------------------------------------------- messages
    def _walk(
        self,
        prompt: Sequence[Any],
        key_of: Callable[[Any], MessageKey],
    ) -> Node:
        """Match ``prompt`` from the root, mounting unmatched messages; returns the mount point."""
        nodes = self._path_nodes
        raws = self._path_raws
        m = min(len(prompt), len(raws))
        if m:
            # Fast path: one C-level comparison (identity short-cut, then dict equality).
            same = (prompt[:m] if len(prompt) != m else prompt) == (raws if len(raws) == m else raws[:m])
            if not same:
                # Positions whose raw dict differs: normalize just those and compare keys.
                differs = list(map(operator.ne, prompt, raws))
                for i in compress(range(m), differs):
                    msg = prompt[i]
                    if key_of(msg) == nodes[i].key:
                        raws[i] = copy_message(msg)
                    else:
                        m = i
                        break
        del nodes[m:]
        del raws[m:]
        cur = nodes[m - 1] if m else self.root
        for msg in islice(prompt, m, None):
            key = key_of(msg)
            khash = hash(key)
            child = cur.find_child(key, khash)
            if child is None:
                child = self._merge_target(cur, key)
                if child is not None:
                    self._merge(cur, child, key, msg)
            if child is None:
                child = Node(key, copy_message(msg), cur)
                cur.add_child(child)
            nodes.append(child)
            raws.append(child.message)
            cur = child
        return cur

    def _merge_target(self, parent: Node, key: MessageKey) -> Node | None:
        """The generated turn a replayed, rewritten assistant message may replace, if any.

        Only when it is the only assistant child, a leaf, and shorter than the threshold:
        anything else is a real fork, and merging would misplace history.
        """
        if self.threshold <= 0 or key[0] != "assistant" or not parent.children:
            return None
        assistants = [c for c in parent.children if c.key is not None and c.key[0] == "assistant"]
        if len(assistants) != 1:
            return None
        cand = assistants[0]
        turn = cand.turn
        if turn is None or cand.children or turn.output_len >= self.threshold:
            return None
        return cand

    def _merge(self, parent: Node, node: Node, key: MessageKey, message: Any) -> None:
        assert node.turn is not None
        rewrites = node.meta().setdefault("rewrites", [])
        rewrites.append({"turn_id": node.turn.seq, "replaced_message": node.message})
        node.message = copy_message(message)
        parent.rekey_child(node, key)

    def record(
        self,
        prompt: Sequence[Any],
        response: Mapping[str, Any] | None,
        record: TurnRecord,
        key_of: Callable[[Any], MessageKey],
        seq: int,
    ) -> None:
        """Mount one answered turn (``response is None``: an empty generation, no sample)."""
        mount = self._walk(prompt, key_of)
        self.turns_recorded += 1
        if response is None:
            mount.meta().setdefault("empty_turns", []).append(
                {
                    "turn_id": seq,
                    "finish_reason": record.finish_reason,
                    "prompt_tokens": int(record.prompt_ids.shape[0]),
                    "output_tokens": int(record.output_ids.shape[0]),
                }
            )
            return
        key = key_of(response)
        turn = self._store(record, mount.turn_anc, seq, tool_names(key))
        node = Node(key, copy_message(response), mount)
        node.turn = turn
        node.turn_anc = turn
        turn.node = node
        mount.add_child(node)
        self.generated_turns += 1
        self._path_nodes.append(node)
        self._path_raws.append(node.message)

    # ------------------------------------------------------------------ views
    def leaves(self) -> list[Node]:
        """Leaves in depth-first order, children in insertion order (iterative)."""
        out: list[Node] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(reversed(node.children))
            elif node is not self.root:
                out.append(node)
        return out

    def iter_turns(self) -> list[StoredTurn]:
        """All generated turns, in depth-first order."""
        out: list[StoredTurn] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.turn is not None:
                out.append(node.turn)
            if node.children:
                stack.extend(reversed(node.children))
        return out

    def token_bytes(self) -> int:
        """Bytes of token payload stored in this tree (excluding the working buffer)."""
        return sum(t.nbytes() for t in self.iter_turns())
