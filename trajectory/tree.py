"""The per-session message tree and its delta-encoded token store.

Each :class:`Node` is one message.  Prompt messages nobody generated here are *routing*
nodes; every answered turn adds a *generated* leaf that carries a :class:`StoredTurn`.

Token storage: a turn's prompt is stored as ``keep`` tokens borrowed from its *source*
turn plus its own ``suffix``.  The source is its *base* (the nearest generated ancestor,
i.e. the previous turn on the same path) or, for a turn without one, the latest turn of
the main line.  A 200-turn session whose prompts share a 100k-token prefix therefore
stores that prefix once, and so does a foreign history re-sent with every retry.  The
common prefix with the base (``shared``) is exactly what the linearizer needs, so it is
computed once, at record time, and the turn's link to its base (clean, replace, break)
is fixed then.

Suffixes and outputs live in append-only int32 arenas.  The *main* arena is laid out
so that, along the latest clean line of turns, arena position == sequence position:
``main[:tip.full_len]`` *is* the tip turn's whole sequence, so comparing the next
prompt with it and linearizing a clean chain need no second copy of the tokens.  Turns
off that line (forks, retries) go to a side arena, and a scratch buffer materializes
their sequences on demand.

Everything here is iterative: no recursion over the tree or the base chain.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import compress
from typing import Any

import numpy as np

from ._tokens import LogprobArray, TokenArray, common_prefix_len
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


class _Arena:
    """Append-only growable int32 storage; turns keep (arena, offset), never views, so growth frees the old
    array."""

    __slots__ = ("data", "size")

    def __init__(self, capacity: int = 0) -> None:
        self.data: TokenArray = np.empty(capacity, dtype=np.int32)
        self.size = 0

    def reserve(self, n: int) -> None:
        if self.data.shape[0] < n:
            # 1/8 slack: geometric growth (amortized O(1) per token) with little idle memory.
            new = np.empty(n + (n >> 3) + 1024, dtype=np.int32)
            new[: self.size] = self.data[: self.size]
            self.data = new

    def append(self, *parts: TokenArray) -> int:
        """Append ``parts`` back to back; returns the offset of the first."""
        off = self.size
        end = off + sum(int(p.shape[0]) for p in parts)
        self.reserve(end)
        pos = off
        for p in parts:
            n = int(p.shape[0])
            self.data[pos : pos + n] = p
            pos += n
        self.size = end
        return off


class StoredTurn:
    """A recorded generation, delta-encoded against its base turn.

    Its own tokens (prompt suffix, then output) are ``arena.data[off : off + own_len]``.
    """

    __slots__ = (
        "arena",
        "base",
        "depth",
        "finish_reason",
        "foreign",
        "ill_formed",
        "keep",
        "link",
        "logprobs",
        "node",
        "off",
        "output_len",
        "policy_version",
        "prompt_len",
        "seq",
        "shared",
        "src",
        "tools",
    )

    def __init__(
        self,
        *,
        seq: int,
        base: StoredTurn | None,
        shared: int,
        src: StoredTurn | None,
        keep: int,
        prompt_len: int,
        output_len: int,
        logprobs: LogprobArray | None,
        finish_reason: str,
        ill_formed: bool,
        link: int,
        tools: tuple[str, ...],
        policy_version: int | None = None,
    ) -> None:
        self.seq = seq
        self.base = base
        self.shared = shared  # common prefix with full(base): decides the link
        self.src = src
        self.keep = keep  # tokens taken from full(src): decides storage
        self.depth: int = 0 if src is None else src.depth + 1  # along src links
        self.prompt_len = prompt_len
        self.output_len = output_len
        self.logprobs = logprobs
        self.finish_reason = finish_reason
        self.ill_formed = ill_formed
        self.link = link
        self.tools = tools
        #: The version of the weights that sampled its output (``None``: none known).
        self.policy_version = policy_version
        #: Its prompt does not extend the tree's first request (see :attr:`Tree.first_mount`).
        self.foreign = False
        self.node: Node | None = None
        self.arena: _Arena | None = None
        self.off = 0

    @property
    def full_len(self) -> int:
        """Length of prompt + output."""
        return self.prompt_len + self.output_len

    def own_tokens(self) -> TokenArray:
        """Prompt suffix followed by output (a view into the arena)."""
        assert self.arena is not None
        return self.arena.data[self.off : self.off + self.full_len - self.keep]

    @property
    def suffix(self) -> TokenArray:
        return self.own_tokens()[: self.prompt_len - self.keep]

    @property
    def output(self) -> TokenArray:
        return self.own_tokens()[self.prompt_len - self.keep :]


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
    if type(message) is dict:
        top: Any = message.copy()
    elif isinstance(message, Mapping):
        top = dict(message)
    elif isinstance(message, list):
        top = list(message)
    else:
        return message
    stack = [top]
    while stack:
        container = stack.pop()
        items = container.items() if type(container) is dict else enumerate(container)
        for k, v in list(items):
            tv = type(v)
            if tv is str or tv is int or tv is float or tv is bool or v is None:
                continue  # the common case first: immutable leaves are shared
            if tv is dict or (tv is not list and isinstance(v, Mapping)):
                v = dict(v)
            elif tv is list:
                v = list(v)
            else:
                continue
            container[k] = v
            stack.append(v)
    return top


def _common_valid(a: StoredTurn | None, b: StoredTurn) -> int:
    """Length of a prefix known to be equal in full(a) and full(b), from the base links alone.

    Walks both base chains up to their common ancestor; every step up keeps only the
    ``keep`` tokens the lower turn has in common with its source.
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
            va = min(va, x.keep)
            x = x.src
        else:
            vb = min(vb, y.keep)
            y = y.src
    return min(va, vb)


def _fill(buf: TokenArray, turn: StoredTurn, lo: int) -> None:
    """Write full(turn)[lo:] (prompt + output) into ``buf[lo:]`` by walking the base chain back."""
    hi = turn.full_len
    cur: StoredTurn | None = turn
    while hi > lo and cur is not None:
        # full(cur) = full(cur.src)[:keep] + own tokens (suffix, output) at [keep, full_len).
        s = cur.keep
        if hi > s:
            a = max(lo, s)
            own = cur.own_tokens()
            buf[a:hi] = own[a - s : hi - s]
            hi = a
        cur = cur.src  # hi <= s now: the rest comes from the source


class Tree:
    """One message tree (a session has a main tree and a side-call tree)."""

    def __init__(self, fork_threshold_tokens: int) -> None:
        self.threshold = fork_threshold_tokens
        self.root = Node(None, None, None)
        self.turns_recorded = 0
        self.generated_turns = 0
        # The most recently recorded root path and, per position, the last message object
        # seen there: the next request usually repeats it, and a C-level list comparison
        # against it replaces a per-message Python walk.  These are the caller's objects:
        # messages must not be mutated after being recorded (the gateway parses fresh
        # dicts per request, so it never does).
        self._path_nodes: list[Node] = []
        self._path_raws: list[Any] = []
        # Token arenas (see the module docstring): main[:tip.full_len] == full(tip).
        self._main = _Arena()
        self._side = _Arena()
        self._tip: StoredTurn | None = None
        # full(scratch_turn), materialized for turns off the main line.
        self._scratch: TokenArray = np.zeros(0, dtype=np.int32)
        self._scratch_turn: StoredTurn | None = None
        #: The turn stored last (what a continuing prompt extends).
        self.last: StoredTurn | None = None
        #: Where the tree's first request mounted (its last prompt message), and that node's index
        #: in a root path. A turn whose prompt does not pass through it is *foreign*: it is not a
        #: continuation of the conversation the first request started.
        self.first_mount: Node | None = None
        self._first_at = -1

    # ----------------------------------------------------------------- tokens
    def load(self, turn: StoredTurn) -> TokenArray:
        """full(turn) (prompt + output) as a read-only-by-convention view; valid until the next call."""
        if turn is self._tip:
            return self._main.data[: turn.full_len]
        if self._scratch_turn is not turn:
            n = turn.full_len
            if self._scratch_turn is None and self._tip is not None:
                # Start from the main line: usually only the tail after a fork differs.
                lo = _common_valid(self._tip, turn)
                src: TokenArray | None = self._main.data
            else:
                lo = _common_valid(self._scratch_turn, turn)
                src = None
            if self._scratch.shape[0] < n:
                new = np.empty(n + (n >> 3) + 1024, dtype=np.int32)
                keep = lo if src is None else 0
                new[:keep] = self._scratch[:keep]
                self._scratch = new
            if src is not None:
                self._scratch[:lo] = src[:lo]
            _fill(self._scratch, turn, lo)
            self._scratch_turn = turn
        return self._scratch[: turn.full_len]

    def prompt_ids(self, turn: StoredTurn) -> TokenArray:
        """A fresh copy of a stored turn's whole prompt."""
        return self.load(turn)[: turn.prompt_len].copy()

    def token_bytes(self) -> int:
        """Bytes held for tokens and logprobs (arenas, scratch buffer, logprob arrays)."""
        lp = sum(0 if t.logprobs is None else int(t.logprobs.nbytes) for t in self.iter_turns())
        return (
            int(self._main.data.nbytes + self._side.data.nbytes + self._scratch.nbytes)
            + lp
            + sum(int(a.data.nbytes) for a in self._old_arenas())
        )

    def _old_arenas(self) -> list[_Arena]:
        seen = {id(self._main), id(self._side)}
        out = []
        for t in self.iter_turns():
            a = t.arena
            if a is not None and id(a) not in seen:
                seen.add(id(a))
                out.append(a)
        return out

    def _store(
        self, record: TurnRecord, base: StoredTurn | None, seq: int, tools: tuple[str, ...]
    ) -> StoredTurn:
        prompt = record.prompt_ids
        output = record.output_ids
        plen = int(prompt.shape[0])
        if base is None:
            shared, link = 0, FIRST
        else:
            shared = common_prefix_len(prompt, self.load(base))
            if shared == base.full_len:
                link = CLEAN
            elif shared >= base.prompt_len and base.output_len < self.threshold:
                link = REPLACE
            else:
                link = BREAK
        # Storage source: the base, or for a turn without one the main line's tip (a
        # retried or re-sent foreign history then costs only its new tokens).
        src, keep = base, shared
        if base is None and self._tip is not None:
            k = common_prefix_len(prompt, self.load(self._tip))
            if k:
                src, keep = self._tip, k
        turn = StoredTurn(
            seq=seq,
            base=base,
            shared=shared,
            src=src,
            keep=keep,
            prompt_len=plen,
            output_len=int(output.shape[0]),
            logprobs=None if record.output_logprobs is None else record.output_logprobs.copy(),
            finish_reason=record.finish_reason,
            ill_formed=record.ill_formed,
            link=link,
            tools=tools,
            policy_version=record.policy_version,
        )
        suffix = prompt[keep:]
        own_len = turn.full_len - keep
        main = self._main
        if src is self._tip and keep == main.size:
            # Extends the main line exactly (or starts it): arena position == sequence position.
            turn.arena, turn.off = main, main.append(suffix, output)
            self._tip = turn
        elif (src is None or src is self._tip) and keep <= own_len:
            # Drift (or a new root) on the main line with a short shared prefix: start a new
            # main arena; copying the prefix costs no more than the new tokens themselves.
            prefix = self.load(src)[:keep] if src is not None else prompt[:0]
            arena = _Arena(turn.full_len + (turn.full_len >> 3) + 1024)
            arena.append(prefix)
            turn.arena, turn.off = arena, arena.append(suffix, output)
            self._main = arena
            self._tip = turn
        else:
            # Off the main line (a fork, a retry, a replaced response): side arena.
            turn.arena, turn.off = self._side, self._side.append(suffix, output)
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
        msgs = prompt if isinstance(prompt, list) else list(prompt)
        n_old = len(raws)
        m = min(len(msgs), n_old)
        if m:
            if len(msgs) >= n_old:
                # Compare without slicing the (long) history: pad the reference with the
                # prompt's own new messages, so one C-level list comparison covers the prefix
                # (identity short-cut for re-sent objects, dict equality for fresh ones).
                raws.extend(msgs[n_old:])
                same = raws == msgs
                del raws[n_old:]
            else:
                same = raws[:m] == msgs
            if not same:
                # Normalize only the positions whose dicts differ (a volatile system header,
                # a re-serialized echo of a generated message) and compare their keys.
                # Usually those are the first message and the last few: check the middle
                # with one C-level comparison before looking at positions one by one.
                hi = m - 4
                if hi > 1 and raws[1:hi] == msgs[1:hi]:
                    differs: Iterable[int] = [i for i in (0, *range(hi, m)) if raws[i] != msgs[i]]
                else:
                    differs = compress(range(m), map(operator.ne, msgs, raws))
                for i in differs:
                    msg = msgs[i]
                    if key_of(msg) != nodes[i].key:
                        m = i
                        break
                    raws[i] = msg  # the newest form: the next request likely repeats it
            # Adopt the caller's objects for the whole matched path (one C-level slice
            # assignment): a caller that re-sends the same objects next time (the gateway's
            # recorder does) is then compared by identity everywhere, and one that sends fresh
            # dicts differs from the held ones mostly at the echo of the last response.
            raws[:m] = msgs[:m]
        del nodes[m:]
        del raws[m:]
        cur = nodes[m - 1] if m else self.root
        for msg in msgs[m:]:
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
            raws.append(msg)
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
    ) -> int | None:
        """Mount one answered turn (``response is None``: an empty generation, no sample).

        Returns how many leading prompt ids it shares with the prompt + output of the turn stored
        before it (0 for the first), or ``None`` when it stored no tokens (an empty generation)."""
        mount = self._walk(prompt, key_of)
        self.turns_recorded += 1
        nodes = self._path_nodes  # the root path to ``mount``: the check is one index, not a walk
        if self.first_mount is None:
            self.first_mount, self._first_at = mount, len(nodes) - 1
        at = self._first_at
        foreign = not (at < len(nodes) and nodes[at] is self.first_mount)
        if response is None:
            mount.meta().setdefault("empty_turns", []).append(
                {
                    "turn_id": seq,
                    "finish_reason": record.finish_reason,
                    "prompt_tokens": int(record.prompt_ids.shape[0]),
                    "output_tokens": int(record.output_ids.shape[0]),
                }
            )
            return None
        key = key_of(response)
        before = self.last
        turn = self._store(record, mount.turn_anc, seq, tool_names(key))
        turn.foreign = foreign
        node = Node(key, copy_message(response), mount)
        node.turn = turn
        node.turn_anc = turn
        turn.node = node
        mount.add_child(node)
        self.generated_turns += 1
        self._path_nodes.append(node)
        self._path_raws.append(response)
        self.last = turn
        if before is None:
            return 0
        if turn.base is before:
            return turn.shared  # counted against it just now
        return common_prefix_len(record.prompt_ids, self.load(before))

    def dispose(self) -> None:
        """Break the tree's reference cycles (parent <-> children, node <-> turn), iteratively.

        A dropped session's memory (its token arenas above all) is then freed at once by
        reference counting instead of waiting for a cyclic garbage collection.
        """
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children)
            node.children = None
            node._index = None
            node.parent = None
            if node.turn is not None:
                node.turn.node = None
        self._path_nodes.clear()
        self._path_raws.clear()
        self._scratch_turn = None
        self._tip = None
        self.last = None
        self.first_mount = None

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
