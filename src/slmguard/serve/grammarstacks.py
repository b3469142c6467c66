"""How many parse stacks llama.cpp's grammar sampler checks a candidate token against.

Owns :func:`worst_stacks`, a bounded simulation of the engine's own grammar
machinery (llama.cpp ``src/llama-grammar.cpp``, as vendored by
llama-cpp-python 0.3.36) on a GBNF text, and :func:`pattern_grammar`, the GBNF
the engine's JSON-schema converter makes of a string's ``pattern``
(``common/json-schema-to-grammar.cpp``, ``_pattern_to_rule``). Why the stacks
are the measure of an ambiguous grammar, and what the simulation does and does
not see: :func:`worst_stacks`. Pure: no I/O, no engine; it refuses nothing
itself (:mod:`slmguard.serve.bounds` does, and only for an engine build without
slmguard's grammar bound, ``engine/grammar-max-work.patch``: a simulation is a
best effort).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

# The engine's element types (llama-grammar.h, enum llama_gretype).
END, ALT, RULE_REF, CHAR, CHAR_NOT, RNG_UPPER, CHAR_ALT, CHAR_ANY, TOKEN, TOKEN_NOT = range(10)
_TERMINALS = frozenset({CHAR, CHAR_NOT, CHAR_ANY, TOKEN, TOKEN_NOT})
#: Characters a candidate text tries where a class is negated or any character goes.
_PROBES = ("a", "0", " ", "x", "\n", "é", "\u4e00")
#: Where a negated class that excludes every probe is searched for a character it takes
#: (printable ASCII, Latin-1 and Latin Extended, CJK): a class listing all of them is a
#: grammar no search of characters can see into.
_SPARE = ((0x21, 0x7F), (0xA1, 0x250), (0x4E01, 0x4E81))
#: A token's first characters followed from a state. The engine follows every path for
#: every candidate whose characters match so far, so the paths of the first characters
#: are what most of the vocabulary costs; deeper ones are followed by few candidates
#: (measured on Gemma 3: ``([a-z]+)+``, 128 paths at the 8th character but 18 at the
#: 2nd, decoded as fast as no grammar).
TOKEN_CHARS = 2
#: Characters of generated text the search follows from the start.
TEXT_CHARS = 16
#: Candidate characters tried per step, those the most stacks' tops accept first.
_CANDIDATES = 48

Stack = tuple[int, ...]  # positions in the flat element list, the top last
#: A rule's element: the engine's type and value, and the element of the grammar's text it
#: is a copy of (a repetition's copies share it: the search looks at one of them).
_Element = tuple[int, int, int]


class GrammarError(ValueError):
    """The engine's parser would refuse this grammar (it answers the request with an error)."""


class OutOfBudget(Exception):
    """The simulation's own work reached its cap."""


class _TooMany(Exception):
    """One stack alone expands to more stacks than the limit: the search is over."""

    def __init__(self, stacks: int) -> None:
        super().__init__(stacks)
        self.stacks = stacks


@dataclass(frozen=True)
class StackCount:
    """The most stacks one candidate character was checked against, and where.

    ``text``: the characters (generated text, then a token's) that led there;
    ``finished``: the search ended within its budget (else ``stacks`` is what it
    found before it stopped). Past the limit the search stops: ``stacks`` is then
    at least what the grammar makes."""

    stacks: int
    text: str
    finished: bool


# ------------------------------------------------------------------ the engine's parser


class _Parser:
    """``llama_grammar_parser``: rules as lists of ``(type, value)``, repetitions expanded
    into rules the way the engine expands them. ``elements`` caps the total built."""

    def __init__(self, text: str, elements: int) -> None:
        self.src = text + "\0"
        self.symbols: dict[str, int] = {}
        self.rules: dict[int, list[_Element]] = {}
        self.elements = elements
        self.serial = 0

    def el(self, kind: int, value: int) -> _Element:
        self.serial += 1
        return kind, value, self.serial

    def symbol(self, name: str) -> int:
        return self.symbols.setdefault(name, len(self.symbols))

    def generate(self, base: str) -> int:
        rid = len(self.symbols)
        self.symbols[f"{base}_{rid}"] = rid
        return rid

    def add(self, rid: int, rule: list[_Element]) -> None:
        self.elements -= len(rule)
        if self.elements < 0:
            raise OutOfBudget
        self.rules[rid] = rule

    def space(self, i: int, newline_ok: bool) -> int:
        s = self.src
        while s[i] in " \t#" or (newline_ok and s[i] in "\r\n"):
            if s[i] == "#":
                while s[i] not in "\0\r\n":
                    i += 1
            else:
                i += 1
        return i

    def name(self, i: int) -> int:
        j = i
        while _word(self.src[j]):
            j += 1
        if j == i:
            raise GrammarError(f"expecting name at {i}")
        return j

    def char(self, i: int) -> tuple[int, int]:
        s = self.src
        if s[i] == "\\":
            e = s[i + 1]
            width = {"x": 2, "u": 4, "U": 8}.get(e)
            if width is not None:
                digits = s[i + 2 : i + 2 + width]
                if len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits):
                    raise GrammarError(f"expecting {width} hex chars at {i}")
                return int(digits, 16), i + 2 + width
            escaped = {"t": "\t", "r": "\r", "n": "\n", "\\": "\\", '"': '"', "[": "[", "]": "]",
                       "-": "-"}.get(e)  # fmt: skip
            if escaped is None:
                raise GrammarError(f"unknown escape at {i}")
            return ord(escaped), i + 2
        if s[i] == "\0":
            raise GrammarError("unexpected end of input")
        return ord(s[i]), i + 1

    def parse(self) -> None:
        i = self.space(0, True)
        while self.src[i] != "\0":
            j = self.name(i)
            rid = self.symbol(self.src[i:j])
            k = self.space(j, False)
            if not self.src.startswith("::=", k):
                raise GrammarError(f"expecting ::= at {k}")
            k = self.alternates(self.space(k + 3, True), self.src[i:j], rid, nested=False)
            if self.src[k] == "\r":
                k += 2 if self.src[k + 1] == "\n" else 1
            elif self.src[k] == "\n":
                k += 1
            elif self.src[k] != "\0":
                raise GrammarError(f"expecting newline or end at {k}")
            i = self.space(k, True)
        for rid in range(len(self.symbols)):
            if not self.rules.get(rid):
                raise GrammarError("undefined rule")

    def alternates(self, i: int, name: str, rid: int, *, nested: bool) -> int:
        rule: list[_Element] = []
        i = self.sequence(i, name, rule, nested)
        while self.src[i] == "|":
            rule.append(self.el(ALT, 0))
            i = self.sequence(self.space(i + 1, True), name, rule, nested)
        rule.append(self.el(END, 0))
        self.add(rid, rule)
        return i

    def sequence(self, i: int, name: str, rule: list[_Element], nested: bool) -> int:
        s = self.src
        last = len(rule)
        while True:
            c = s[i]
            if c == '"':
                last, i = len(rule), i + 1
                while s[i] != '"':
                    value, i = self.char(i)
                    rule.append(self.el(CHAR, value))
                i = self.space(i + 1, nested)
            elif c == "[":
                last = len(rule)
                i = self.space(self.char_class(i + 1, rule), nested)
            elif c in "<!":
                last, i = len(rule), self.token(i, rule)
                i = self.space(i, nested)
            elif _word(c):
                j = self.name(i)
                last = len(rule)
                rule.append(self.el(RULE_REF, self.symbol(s[i:j])))
                i = self.space(j, nested)
            elif c == "(":
                sub = self.generate(name)
                i = self.alternates(self.space(i + 1, True), name, sub, nested=True)
                last = len(rule)
                rule.append(self.el(RULE_REF, sub))
                if s[i] != ")":
                    raise GrammarError(f"expecting ')' at {i}")
                i = self.space(i + 1, nested)
            elif c == ".":
                last = len(rule)
                rule.append(self.el(CHAR_ANY, 0))
                i = self.space(i + 1, nested)
            elif c in "*+?{":
                i, low, high = self.counts(i, nested)
                self.repeat(rule, last, name, low, high)
            else:
                return i

    def char_class(self, i: int, rule: list[_Element]) -> int:
        s = self.src
        first = CHAR
        if s[i] == "^":
            first, i = CHAR_NOT, i + 1
        start = len(rule)
        while s[i] != "]":
            value, i = self.char(i)
            rule.append(self.el(CHAR_ALT if len(rule) > start else first, value))
            if s[i] == "-" and s[i + 1] != "]":
                if s[i + 1] == "\0":
                    raise GrammarError("unexpected end of input")
                upper, i = self.char(i + 1)
                rule.append(self.el(RNG_UPPER, upper))
        return i + 1

    def token(self, i: int, rule: list[_Element]) -> int:
        s = self.src
        kind = TOKEN
        if s[i] == "!":
            kind, i = TOKEN_NOT, i + 1
        if s[i] != "<":
            raise GrammarError(f"expecting '<' at {i}")
        end = s.find(">", i)
        if end < 0:
            raise GrammarError(f"expecting '>' at {i}")
        rule.append(self.el(kind, hash(s[i : end + 1]) & 0xFFFFFFFF))  # which one: no matter
        return end + 1

    def counts(self, i: int, nested: bool) -> tuple[int, int, int | None]:
        s = self.src
        if s[i] in "*+?":
            low, most = {"*": (0, None), "+": (1, None), "?": (0, 1)}[s[i]]
            return self.space(i + 1, nested), low, most
        i = self.space(i + 1, nested)
        j = i
        while s[j].isdigit() and s[j].isascii():
            j += 1
        if j == i:
            raise GrammarError(f"expecting an int at {i}")
        low = int(s[i:j])
        high: int | None = low
        i = self.space(j, nested)
        if s[i] == ",":
            i = self.space(i + 1, nested)
            j = i
            while s[j].isdigit() and s[j].isascii():
                j += 1
            high = int(s[i:j]) if j > i else None
            i = self.space(j, nested)
        if s[i] != "}":
            raise GrammarError(f"expecting '}}' at {i}")
        if low > 2000:  # the engine's MAX_REPETITION_THRESHOLD
            raise GrammarError("number of repetitions exceeds sane defaults")
        if high is not None and high > 2000:
            high = None
        return self.space(i + 1, nested), low, high

    def repeat(
        self, rule: list[_Element], last: int, name: str, low: int, high: int | None
    ) -> None:
        """``handle_repetitions``: ``S{m,n}`` -> ``S`` m times, then ``S'(n-m)``, each
        ``S'(x) ::= S S'(x-1) |``; ``S{m,}`` -> ``S`` m times, then ``S' ::= S S' |``."""
        if last == len(rule):
            raise GrammarError("expecting preceding item to */+/?/{")
        item = rule[last:]
        self.elements -= len(item) * max(low - 1, 0)
        if self.elements < 0:
            raise OutOfBudget
        del rule[last:]
        rule.extend(item * low)
        optional = 1 if high is None else high - low
        previous = 0
        chained, alt, end = self.el(RULE_REF, 0), self.el(ALT, 0), self.el(END, 0)
        for k in range(optional):
            rid = self.generate(name)
            body = list(item)
            if high is None:
                body.append((RULE_REF, rid, chained[2]))
            elif k > 0:
                body.append((RULE_REF, previous, chained[2]))
            self.add(rid, [*body, alt, end])
            previous = rid
        if optional > 0:
            rule.append(self.el(RULE_REF, previous))


def _word(c: str) -> bool:
    return c.isascii() and (c.isalnum() or c == "-")


# ------------------------------------------------------------------ the engine's stacks


class _Machine:
    """The rules laid out flat (a stack holds positions in it, as the engine holds pointers)
    and the engine's stack operations on them, memoized; ``work`` counts down the budget."""

    def __init__(self, parser: _Parser, budget: int, limit: int) -> None:
        self.limit = limit
        self.types: list[int] = []
        self.values: list[int] = []
        self.keys: list[int] = []  # the element of the text each is a copy of
        self.start: dict[int, int] = {}
        for rid in sorted(parser.rules):
            self.start[rid] = len(self.types)
            for kind, value, key in parser.rules[rid]:
                self.types.append(kind)
                self.values.append(value)
                self.keys.append(key)
        self.n_rules = len(parser.rules)
        self.work = budget
        self._advanced: dict[Stack, tuple[Stack, ...]] = {}
        self._next: dict[tuple[Stack, str], tuple[Stack, ...]] = {}
        self._negated: dict[int, str] = {}

    def spend(self, units: int) -> None:
        self.work -= units
        if self.work < 0:
            raise OutOfBudget

    def ends(self, pos: int) -> bool:
        return self.types[pos] in (END, ALT)

    def alternatives(self, rid: int) -> Iterable[int]:
        pos = self.start[rid]
        while True:
            yield pos
            while not self.ends(pos):
                pos += 1
            if self.types[pos] != ALT:
                return
            pos += 1

    def advance(self, stack: Stack) -> tuple[Stack, ...]:
        """``llama_grammar_advance_stack``: the stacks ``stack`` expands to, each topped by
        a terminal (or empty: the grammar may end). A stack that grows by more rules than
        the grammar has without a character is left recursion, which the engine refuses."""
        done = self._advanced.get(stack)
        if done is not None:
            return done
        out: dict[Stack, None] = {}
        seen: set[Stack] = set()
        todo = [stack]
        while todo:
            cur = todo.pop()
            self.spend(1)
            if cur in seen:
                continue
            seen.add(cur)
            if not cur or self.types[cur[-1]] in _TERMINALS:
                out[cur] = None
                if len(out) > self.limit:
                    raise _TooMany(len(out))
                continue
            if len(cur) > len(stack) + self.n_rules:
                raise GrammarError("left recursion")
            pos = cur[-1]
            base = cur[:-1] if self.ends(pos + 1) else (*cur[:-1], pos + 1)
            for sub in self.alternatives(self.values[pos]):
                todo.append(base if self.ends(sub) else (*base, sub))
        result = tuple(out)
        self._advanced[stack] = result
        return result

    def initial(self, root: int) -> tuple[Stack, ...]:
        out: dict[Stack, None] = {}
        for pos in self.alternatives(root):
            out.update(dict.fromkeys(self.advance(() if self.ends(pos) else (pos,))))
            if len(out) > self.limit:
                raise _TooMany(len(out))
        return tuple(out)

    def matches(self, pos: int, ch: int) -> tuple[bool, int]:
        """``llama_grammar_match_char``: does ``ch`` match the class at ``pos``, and the
        position after the class."""
        types, values = self.types, self.values
        positive = types[pos] in (CHAR, CHAR_ANY)
        found = False
        while True:
            if types[pos + 1] == RNG_UPPER:
                found = found or values[pos] <= ch <= values[pos + 1]
                pos += 2
            elif types[pos] == CHAR_ANY:
                found, pos = True, pos + 1
            else:
                found = found or values[pos] == ch
                pos += 1
            if types[pos] != CHAR_ALT:
                return found == positive, pos

    def after(self, stack: Stack, ch: str) -> tuple[Stack, ...]:
        """``llama_grammar_accept_chr``: the stacks ``stack`` leads to after ``ch``."""
        key = (stack, ch)
        done = self._next.get(key)
        if done is not None:
            return done
        self.spend(1)
        result: tuple[Stack, ...] = ()
        if stack and self.types[stack[-1]] not in (TOKEN, TOKEN_NOT):
            ok, pos = self.matches(stack[-1], ord(ch))
            if ok:
                rest = stack[:-1] if self.ends(pos) else (*stack[:-1], pos)
                result = self.advance(rest)
        self._next[key] = result
        return result

    def candidates(self, stacks: Iterable[Stack]) -> list[str]:
        """Characters to try next: one per range, character and negated class the tops
        accept (the most stacks overlap at some range's first character), those
        accepted by the most tops first."""
        counted: dict[str, int] = {}
        tops: dict[int, int] = {}
        for stack in stacks:
            self.spend(1)
            if stack and self.types[stack[-1]] not in (TOKEN, TOKEN_NOT):
                tops[stack[-1]] = tops.get(stack[-1], 0) + 1
        for pos, n in tops.items():
            for ch in self._firsts(pos):
                counted[ch] = counted.get(ch, 0) + n
        ranked = sorted(counted, key=lambda ch: -counted[ch])
        return ranked[:_CANDIDATES]

    def _firsts(self, pos: int) -> list[str]:
        types, values = self.types, self.values
        if types[pos] in (CHAR_NOT, CHAR_ANY):
            return self._negated_first(pos)
        out = []
        while True:
            out.append(chr(values[pos]))
            pos += 2 if types[pos + 1] == RNG_UPPER else 1
            if types[pos] != CHAR_ALT:
                return out

    def _negated_first(self, pos: int) -> list[str]:
        """A character a negated class (or ``.``) accepts: a probe first, else the first
        of :data:`_SPARE` it does not exclude (a class excluding every probe,
        ``[^a0 x\\né一]``, hid its paths from the search). Memoized per position."""
        found = self._negated.get(pos)
        if found is None:
            found = next((p for p in _PROBES if self.matches(pos, ord(p))[0]), "")
            for lo, hi in _SPARE if not found else ():
                self.spend(1)
                found = next((chr(c) for c in range(lo, hi) if self.matches(pos, c)[0]), "")
                if found:
                    break
            self._negated[pos] = found
        return [found] if found else []


# ------------------------------------------------------------------ the search


class _Search:
    def __init__(self, machine: _Machine, limit: int) -> None:
        self.m = machine
        self.limit = limit
        self.worst = StackCount(0, "", True)
        self.trying = ""  # the text whose stacks are being expanded

    def note(self, stacks: int, text: str) -> bool:
        """Record a count; True when it is over the limit (the search can stop)."""
        if stacks > self.worst.stacks:
            self.worst = StackCount(stacks, text, True)
        return stacks > self.limit

    def token(self, start: Iterable[Stack], text: str) -> str | None:
        """Follow one token's characters from ``start`` (each stack once), the character
        that leads to the most paths each time; the first character, or None."""
        paths: dict[Stack, int] = dict.fromkeys(start, 1)
        first = None
        for _ in range(TOKEN_CHARS):
            best, best_paths, best_n = "", {}, 0
            for ch in self.m.candidates(paths):
                self.trying = text + ch
                nxt: dict[Stack, int] = {}
                total = 0
                for stack, n in paths.items():
                    after = self.m.after(stack, ch)
                    self.m.spend(1 + len(after))
                    for s in after:
                        nxt[s] = nxt.get(s, 0) + n
                    total += n * len(after)
                    if total > self.limit:  # no need to look further
                        self.note(total, text + ch)
                        return first or ch
                if total > best_n:
                    best, best_paths, best_n = ch, nxt, total
            if not best_n:
                return first
            first = first or best
            text += best
            if self.note(best_n, text):
                return first
            paths = best_paths
        return first

    def run(self, root: int) -> None:
        start = self.m.initial(root)
        if self.note(len(start), ""):
            return
        self.text(start)
        if self.worst.stacks <= self.limit:
            self.everywhere(start)

    def text(self, start: tuple[Stack, ...]) -> None:
        """The generated text that keeps the most paths alive, a token's worth at each point."""
        stacks, text = start, ""
        for _ in range(TEXT_CHARS):
            ch = self.token(stacks, text)
            if ch is None or self.worst.stacks > self.limit:
                return
            merged: dict[Stack, None] = {}
            for stack in stacks:
                after = self.m.after(stack, ch)
                self.m.spend(1 + len(after))
                merged.update(dict.fromkeys(after))
            stacks, text = tuple(merged), text + ch
            if self.note(len(stacks), text):
                return

    def everywhere(self, start: Iterable[Stack]) -> None:
        """A token from each stack the grammar can reach alone (breadth first, each element
        of the text once: one of a repetition's copies, the nearest): an ambiguous part
        behind a plain one is found too."""
        queue = deque((s, "") for s in start)
        done: set[int] = set()
        while queue:
            stack, text = queue.popleft()
            if not stack or self.m.keys[stack[-1]] in done:
                continue
            done.add(self.m.keys[stack[-1]])
            nexts = [(ch, self.m.after(stack, ch)) for ch in self.m.candidates((stack,))]
            if any(len(after) > 1 for _, after in nexts):  # paths may multiply from here
                self.token((stack,), text)
                if self.worst.stacks > self.limit:
                    return
            for ch, after in nexts:
                queue.extend((s, text + ch) for s in after)


def worst_stacks(grammar: str, *, limit: int, budget: int) -> StackCount | None:
    """The most stacks the engine would check one candidate character against, for
    ``grammar`` (GBNF, rule ``root``), searched until over ``limit`` or ``budget`` (units
    of the simulation's work: elements built, stacks expanded, characters tried) is spent.
    None when the engine's parser refuses the grammar itself (no decoding happens).

    Why it is the stacks: the engine keeps one *stack* per way the text generated so
    far can be read (``llama_grammar_advance_stack`` expands rule references until
    each stack's top is a character; duplicates are dropped). Before each token it
    checks every candidate of the vocabulary (262,144 on Gemma 3) against each stack,
    and a candidate whose first character matches is checked, character by
    character, against the stacks that character leads to, one stack at a time and
    without merging the paths (``llama_grammar_reject_candidates_for_stack`` calls
    itself per stack). So a token is checked against as many stacks as there are
    *paths* through the grammar for its characters: ``("a" | "a" | [a-z])*``
    repeated makes that count grow as a power of the token's length with few
    distinct stacks, and ``((a|b)?){0,1000}`` has 2,001 distinct stacks before the
    first character. Both wedged decoding.

    The simulation builds the rules as the engine's parser does (``S{m,n}`` is ``m``
    copies and a chain of ``n - m`` optional rules, ``S*`` a rule ``S' ::= S S' |``,
    each group a rule), expands stacks exactly as the engine does, and counts paths
    for a token's first :data:`TOKEN_CHARS` characters (the character, one per range,
    character and negated class the stacks' tops accept, that leads to the most paths
    each time): before the first character, at each point of the :data:`TEXT_CHARS`
    characters of generated text that keep the most paths alive, and from each element
    of the grammar the search reaches alone where paths may fan out. It stops past the
    limit. Its own work is capped (``budget``: rule elements built, stacks expanded,
    characters tried); a grammar whose check does not end within it is reported as
    such, never as harmless. What it does not see: stacks that grow with a text longer
    than :data:`TEXT_CHARS`, paths deeper than a token's first characters, a worse text
    than the greedy one.
    """
    parser = _Parser(grammar, budget)
    try:
        parser.parse()
        if "root" not in parser.symbols:
            return None
        machine = _Machine(parser, parser.elements, limit)
    except GrammarError:
        return None
    except OutOfBudget:
        return StackCount(0, "", finished=False)
    search = _Search(machine, limit)
    try:
        search.run(parser.symbols["root"])
    except GrammarError:
        return None
    except _TooMany as many:
        return StackCount(many.stacks, search.trying, finished=True)
    except OutOfBudget:
        w = search.worst
        return StackCount(w.stacks, w.text, finished=w.stacks > limit)
    return search.worst


# ------------------------------------------------------------------ a schema's pattern

_NON_LITERAL = frozenset("|.()[]{}*+?^$")
_GBNF_ESCAPES = {"x": 2, "u": 4, "U": 8, "t": 0, "r": 0, "n": 0, "\\": 0, '"': 0, "[": 0, "]": 0,
                 "-": 0}  # fmt: skip


class _Unsupported(Exception):
    """A pattern the engine's converter does not convert (it accepts any string, or
    refuses the schema): no grammar of its own."""


def pattern_grammar(pattern: str) -> str | None:
    """The GBNF (rule ``root``) llama.cpp's JSON-schema converter makes of a string
    schema's ``pattern``, as ``_pattern_to_rule`` builds it: only a pattern anchored with
    ``^`` and ``$`` is converted (the engine accepts any string for the others); groups stay
    groups, a repeated group or class becomes a rule of its own. None where the converter
    would not convert it."""
    if len(pattern) < 2 or pattern[0] != "^" or pattern[-1] != "$":
        return None
    converter = _PatternConverter(pattern[1:-1])
    try:
        body = converter.transform()
        if converter.depth:
            return None
    except _Unsupported:
        return None
    rules = "".join(f"{name} ::= {rule}\n" for name, rule in converter.rules.items())
    return f'root ::= "\\"" ({body}) "\\""\n{rules}'


class _PatternConverter:
    def __init__(self, sub: str) -> None:
        self.sub = sub
        self.i = 0
        self.depth = 0
        self.rules: dict[str, str] = {}
        self.repeated: dict[str, str] = {}

    def transform(self) -> str:
        sub, n = self.sub, len(self.sub)
        seq: list[tuple[str, bool]] = []
        while self.i < n:
            c = sub[self.i]
            if c == ".":
                self.rules["dot"] = "[^\\x0A\\x0D]"
                seq.append(("dot", False))
                self.i += 1
            elif c == "(":
                self.i += 1
                if sub.startswith("?", self.i):
                    if not sub.startswith("?:", self.i):
                        raise _Unsupported
                    self.i += 2
                self.depth += 1
                if self.depth > 100:
                    raise _Unsupported
                seq.append((f"({self.transform()})", False))
            elif c == ")":
                self.i += 1
                if not self.depth:
                    raise _Unsupported
                self.depth -= 1
                return _join(seq)
            elif c in "^$":
                raise _Unsupported
            elif c == "[":
                seq.append((self.char_class(), False))
            elif c == "|":
                seq.append(("|", False))
                self.i += 1
            elif c in "*+?":
                if not seq:
                    raise _Unsupported
                seq[-1] = (_rule(seq[-1]) + c, False)
                self.i += 1
            elif c == "{":
                self.counts(seq)
            else:
                seq.append((self.literal(), True))
        return _join(seq)

    def char_class(self) -> str:
        sub, n = self.sub, len(self.sub)
        out = "["
        self.i += 1
        while self.i < n and sub[self.i] != "]":
            if sub[self.i] == "\\":
                width = _escape_length(sub, self.i)
                out += sub[self.i : self.i + width]
                self.i += width
            else:
                out += sub[self.i]
                self.i += 1
        if self.i >= n:
            raise _Unsupported
        self.i += 1
        return out + "]"

    def counts(self, seq: list[tuple[str, bool]]) -> None:
        end = self.sub.find("}", self.i)
        if end < 0 or not seq:
            raise _Unsupported
        nums = self.sub[self.i + 1 : end].split(",")
        self.i = end + 1
        try:
            if len(nums) == 1:
                low = high = int(nums[0])
            elif len(nums) == 2:
                low = int(nums[0]) if nums[0] else 0
                high = int(nums[1]) if nums[1] else -1
            else:
                raise _Unsupported
        except ValueError:
            raise _Unsupported from None
        item, literal = seq[-1]
        if literal:
            item = f'"{item}"'
        else:
            name = self.repeated.get(item)
            if name is None:
                name = f"p-{len(self.repeated) + 1}"
                self.repeated[item] = name
                self.rules[name] = item
            item = name
        seq[-1] = (_repetition(item, low, high), False)

    def literal(self) -> str:
        sub, n = self.sub, len(self.sub)
        out = ""
        while self.i < n:
            c = sub[self.i]
            if c == "\\":
                if self.i == n - 1:
                    raise _Unsupported
                if sub[self.i + 1] in _NON_LITERAL:
                    out += sub[self.i + 1]
                    self.i += 2
                else:
                    width = _escape_length(sub, self.i)
                    out += sub[self.i : self.i + width]
                    self.i += width
            elif c == '"':
                out += '\\"'
                self.i += 1
            elif c not in _NON_LITERAL and (
                self.i == n - 1 or not out or sub[self.i + 1] == "."
                or sub[self.i + 1] not in _NON_LITERAL
            ):  # fmt: skip
                out += c
                self.i += 1
            else:
                break
        if not out:
            raise _Unsupported
        return out


def _escape_length(text: str, i: int) -> int:
    """``gbnf_escape_length``: the escapes a GBNF literal keeps as they are (else the
    converter gives up on the pattern)."""
    width = _GBNF_ESCAPES.get(text[i + 1 : i + 2])
    if width is None:
        raise _Unsupported
    digits = text[i + 2 : i + 2 + width]
    if len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits):
        raise _Unsupported
    return 2 + width


def _rule(item: tuple[str, bool]) -> str:
    return f'"{item[0]}"' if item[1] else item[0]


def _join(seq: list[tuple[str, bool]]) -> str:
    """``join_seq``: consecutive literals merged into one."""
    out: list[str] = []
    literal = ""
    for text, is_literal in seq:
        if is_literal:
            literal += text
            continue
        if literal:
            out.append(f'"{literal}"')
            literal = ""
        out.append(text)
    if literal:
        out.append(f'"{literal}"')
    return " ".join(out)


def _repetition(item: str, low: int, high: int) -> str:
    """``build_repetition`` without a separator (``high`` -1: no maximum)."""
    if high == 0:
        return ""
    if (low, high) == (0, 1):
        return item + "?"
    if high < 0:
        return item + ("+" if low == 1 else "*" if low == 0 else f"{{{low},}}")
    return f"{item}{{{low},{high}}}"
