"""The built-in probes: multiple-choice items cut from validation documents, one generator per probe, each balanced
so that a scorer with a fixed preference lands at chance (docs/internals.md#keelevalsprobes)."""

from __future__ import annotations

import bisect
import builtins
import hashlib
import keyword
import random
import re
from collections import defaultdict

K = 4  # choices per item, in every probe: chance 1/4
CONTEXT_CHARS = 3000  # text kept before each site; scoring cuts it further to the model's max_seq_len
MIN_LINE = 12  # next_line: shortest true line (characters, stripped)
IDENT_RANGE = 300  # identifiers: the name's previous occurrence lies at most this many characters back

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{3,}")
_DEFINED = re.compile(r"^[ \t]*(?:def|class)[ \t]+([A-Za-z_]\w*)|^[ \t]*([A-Za-z_]\w*)[ \t]*(?::[^=\n]*)?=(?!=)"
                      r"|\bfor[ \t]+([A-Za-z_]\w*)[ \t]+in\b|\bas[ \t]+([A-Za-z_]\w*)", re.M)
_COMMON = frozenset(keyword.kwlist) | frozenset(dir(builtins)) | {"self", "cls", "args", "kwargs", "None"}
_CLOSERS = {"(": ")", "[": "]", "{": "}"}


def _item(doc: int, text: str, cut: int, choices: list[str], answer: str, rng: random.Random) -> dict:
    start = 0
    if cut > CONTEXT_CHARS:  # from a line start, so the context does not open mid-line
        start = text.find("\n", cut - CONTEXT_CHARS, cut) + 1 or cut - CONTEXT_CHARS
    order = list(choices)
    rng.shuffle(order)
    return {"context": text[start:cut], "choices": order, "answer": order.index(answer), "doc": doc,
            "doc_sha": doc_sha(text)}


def doc_sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _interleave(groups: list[list[dict]], cap: int) -> list[dict]:
    """Equal numbers from each group (the smallest non-empty group's size, up to cap / len(groups)), in
    round-robin order, so every prefix that max_items keeps stays balanced."""
    groups = [g for g in groups if g]
    if not groups:
        return []
    per = min(min(len(g) for g in groups), cap // len(groups))
    return [g[i] for i in range(per) for g in groups]


# ---- brackets --------------------------------------------------------------------------------------

def _closing_sites(text: str):
    """(position, closer, opener-quote) of every character that closes a bracket or a one-line string, read
    with a small Python-like lexer: comments and triple-quoted strings skipped, escapes honoured."""
    stack, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c == "#":
            i = text.find("\n", i)
            i = n if i < 0 else i
        elif text.startswith(('"""', "'''"), i):
            end = text.find(text[i:i + 3], i + 3)
            i = n if end < 0 else end + 3
            continue
        elif c in "'\"":
            j = i + 1
            while j < n and text[j] not in (c, "\n"):
                j += 2 if text[j] == "\\" else 1
            if j < n and text[j] == c:
                yield j, c
            i = j
        elif c in _CLOSERS:
            stack.append(_CLOSERS[c])
        elif c in ")]}":
            if stack and stack[-1] == c:
                stack.pop()
                yield i, c
            else:
                stack.clear()  # unbalanced (or not code): start over
        i += 1


def brackets(docs: list[str], rng: random.Random, cap: int) -> list[dict]:
    by_closer = defaultdict(list)
    for d, text in enumerate(docs):
        for pos, closer in _closing_sites(text):
            by_closer[closer if closer in ")]}" else "quote"].append((d, pos, closer))
    groups = []
    for kind in (")", "]", "}", "quote"):
        sites = rng.sample(by_closer[kind], min(len(by_closer[kind]), cap))
        groups.append([_item(d, docs[d], pos, [")", "]", "}", closer if kind == "quote" else '"'], closer, rng)
                       for d, pos, closer in sites])
    return _interleave(groups, cap)


# ---- indent ----------------------------------------------------------------------------------------

def indent(docs: list[str], rng: random.Random, cap: int) -> list[dict]:
    """After a line ending in ':', the next non-blank line with K candidate indents 4 spaces apart; the true
    one's rank among them (0 = shortest) is balanced over the items."""
    sites = []
    for d, text in enumerate(docs):
        lines = text.splitlines(keepends=True)
        offset = 0
        for i, line in enumerate(lines[:-1]):
            offset += len(line)
            code = line.split("#", 1)[0].rstrip()
            following = lines[i + 1].rstrip("\r\n")
            if code.endswith(":") and following.strip() and "\t" not in following[:-len(following.lstrip())]:
                sites.append((d, offset, following))
    rng.shuffle(sites)
    by_rank = [[] for _ in range(K)]
    for d, offset, line in sites:
        width = len(line) - len(line.lstrip(" "))
        feasible = [r for r in range(K) if width - 4 * r >= 0]
        rank = min(feasible, key=lambda r: len(by_rank[r]))
        if len(by_rank[rank]) < cap:
            choices = [" " * (width + 4 * (j - rank)) + line.lstrip(" ") for j in range(K)]
            by_rank[rank].append(_item(d, docs[d], offset, choices, line, rng))
    return _interleave(by_rank, cap)


# ---- identifiers -----------------------------------------------------------------------------------

def identifiers(docs: list[str], rng: random.Random, cap: int) -> list[dict]:
    """A name the file defined, at a later use at most IDENT_RANGE characters after its previous occurrence;
    the other choices are names defined in other validation documents, of the same length, absent from this
    one; every choice is followed by the character that follows the true name."""
    defined = []
    for text in docs:
        names = {n for m in _DEFINED.finditer(text) for n in m.groups() if n}
        defined.append({n for n in names if len(n) >= 4 and n not in _COMMON})
    by_length = defaultdict(set)
    for names in defined:
        for n in names:
            by_length[len(n)].add(n)
    by_length = {k: sorted(v) for k, v in by_length.items()}
    used = [set(_IDENT.findall(text)) for text in docs]
    sites = []
    for d, text in enumerate(docs):
        first_definition = {}
        for m in _DEFINED.finditer(text):
            for n in m.groups():
                if n in defined[d]:
                    first_definition.setdefault(n, m.end())
        last = {}
        for m in _IDENT.finditer(text):
            name, pos = m.group(), m.start()
            if name in first_definition and name in last and first_definition[name] <= pos and m.end() < len(text) \
                    and pos - last[name] <= IDENT_RANGE:
                sites.append((d, pos, name, text[m.end()]))
            last[name] = m.end()
    rng.shuffle(sites)
    items = []
    for d, pos, name, after in sites:
        pool = by_length[len(name)]
        others = _draw(pool, 0, len(pool), K - 1, rng, lambda n, here=used[d]: n not in here)
        if others:
            choices = [name, *others]
            items.append(_item(d, docs[d], pos, [c + after for c in choices], name + after, rng))
            if len(items) == cap:
                break
    return items


# ---- next_line -------------------------------------------------------------------------------------

def next_line(docs: list[str], rng: random.Random, cap: int) -> list[dict]:
    """The true next non-blank line against K - 1 lines from other validation documents, chosen so that the
    true line's rank by length (0 = shortest) is balanced over the items; each choice ends in a newline."""
    lines = []  # (doc, offset of the line, line)
    for d, text in enumerate(docs):
        offset = 0
        for line in text.splitlines(keepends=True):
            if line.strip():
                lines.append((d, offset, line.rstrip("\r\n")))
            offset += len(line)
    pool = sorted({(len(line), line, d) for d, _, line in lines})  # by length, for ranks by bisection
    sites = [s for s in lines if len(s[2].strip()) >= MIN_LINE and s[1] > 0]
    rng.shuffle(sites)
    by_rank = [[] for _ in range(K)]
    for i, (d, offset, line) in enumerate(sites):
        rank = i % K
        if len(by_rank[rank]) >= cap:
            continue
        lo, hi = bisect.bisect_left(pool, (len(line),)), bisect.bisect_left(pool, (len(line) + 1,))
        elsewhere = lambda p, here=d: p[2] != here  # noqa: E731
        shorter = _draw(pool, 0, lo, rank, rng, elsewhere)
        longer = _draw(pool, hi, len(pool), K - 1 - rank, rng, elsewhere)
        if shorter is None or longer is None:
            continue
        others = [p[1] for p in shorter + longer]
        if len({line, *others}) == K:
            by_rank[rank].append(_item(d, docs[d], offset, [c + "\n" for c in [line, *others]], line + "\n", rng))
    return _interleave(by_rank, cap)


def _draw(population: list, lo: int, hi: int, k: int, rng: random.Random, keep, tries: int = 50) -> list | None:
    """k distinct entries of `population[lo:hi]` that `keep` accepts, drawn at random; None when `tries`
    draws do not find them."""
    if k == 0:
        return []
    picked = set()
    for _ in range(tries):
        if hi - lo < k:
            return None
        i = rng.randrange(lo, hi)
        if i not in picked and keep(population[i]):
            picked.add(i)
            if len(picked) == k:
                return [population[j] for j in sorted(picked)]
    return None
