"""Bounds on what one request may make the engine do, checked on its JSON before anything else.

Owns :class:`Bounds`, the checks every request body passes before its schema
(the route dependency :func:`slmguard.serve.routes.bounded` calls
:meth:`Bounds.check` on the parsed JSON): every string, number and container;
the numbers that size an allocation or an answer (Messages'
``thinking.budget_tokens`` too); grammars, JSON schemas and their patterns
(size, nesting, alternatives, repetitions and their products, and ambiguity
through :mod:`slmguard.serve.grammarstacks` on an engine build without
slmguard's grammar bound); ``chat_template_kwargs.messages``. Each refusal is a
400 naming the field and the limit (the settings', or this server's slot
context and vocabulary); what each limit stops, found against a running
llama-server, is in docs/serve.md, *Hostile requests*. Also
:func:`grammar_field`, the field a grammar the engine refused came from. Pure:
no I/O, no engine.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from slmguard.errors import RequestError, RequestTooLargeError
from slmguard.serve.grammarstacks import pattern_grammar, worst_stacks

if TYPE_CHECKING:
    from slmguard.settings import ServeSettings

#: Fields whose strings are text the engine tokenizes by length (a NUL is a character there).
TEXT_FIELDS = frozenset(
    {"content", "text", "prompt", "input", "arguments", "reasoning_content", "instructions",
     "query", "documents", "system"}
)  # fmt: skip
#: Keys whose object value is a JSON schema the engine compiles into a grammar.
SCHEMA_FIELDS = frozenset({"json_schema", "schema", "parameters", "input_schema"})
#: Top-level windows the engine allocates per slot (tokens): at most one slot's context.
WINDOW_FIELDS = ("repeat_last_n", "dry_penalty_last_n")
#: Top-level answer lengths (tokens): at most one slot's context.
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
#: Top-level counts of probabilities returned per token.
PROBS_FIELDS = ("n_probs", "top_logprobs")
MAX_PROBS = 20
#: JSON-schema keywords the engine expands into that many copies of a rule.
SCHEMA_COUNTS = frozenset(
    {"minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
     "minContains", "maxContains"}
)  # fmt: skip
SCHEMA_ALTERNATIVES = ("anyOf", "oneOf", "allOf", "prefixItems")
#: Products of repetition counts saturate here (a 32 KiB grammar could write 1024^8000).
_SATURATED = 1 << 64
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1
#: The work one grammar's stack simulation may do (stacks expanded, characters tried,
#: elements built): about 100 ms of the front's CPU here; the grammars llama.cpp ships
#: take at most 72,000 (c.gbnf), converted schemas at most 46,000.
CHECK_BUDGET = 200_000


@dataclass(frozen=True)
class Limits:
    """The limits one server applies: its settings (their defaults are declared there),
    the context of one slot and the vocabulary."""

    json_depth: int
    grammar_bytes: int
    grammar_nesting: int
    grammar_alternatives: int
    repetition: int
    repetition_product: int
    grammar_stacks: int
    schema_bytes: int
    schema_depth: int
    schema_enum: int
    n_ctx_slot: int  # 0: unknown, not checked
    n_vocab: int  # 0: unknown, not checked

    @classmethod
    def of(cls, s: ServeSettings, *, n_ctx_slot: int, n_vocab: int) -> Limits:
        return cls(
            json_depth=s.max_json_depth,
            grammar_bytes=s.max_grammar_bytes,
            grammar_nesting=s.max_grammar_nesting,
            grammar_alternatives=s.max_grammar_alternatives,
            repetition=s.max_repetition,
            repetition_product=s.max_repetition_product,
            grammar_stacks=s.max_grammar_stacks,
            schema_bytes=s.max_schema_bytes,
            schema_depth=s.max_schema_depth,
            schema_enum=s.max_schema_enum,
            n_ctx_slot=n_ctx_slot,
            n_vocab=n_vocab,
        )


def _name(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path) or "body"


def _refuse(path: tuple[Any, ...], message: str, code: str = "invalid_value") -> RequestError:
    name = _name(path)
    return RequestError(f"{name}: {message}", code=code, param=name)


def _walk(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any, int]]:
    """Every value with its path and depth (containers count one level each), iteratively:
    a body nested as deep as the JSON parser allows must not exhaust the stack here."""
    stack: list[tuple[tuple[Any, ...], Any, int]] = [(path, value, 0)]
    while stack:
        here, v, depth = stack.pop()
        yield here, v, depth
        if isinstance(v, dict):
            stack.extend(((*here, k), x, depth + 1) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend(((*here, i), x, depth + 1) for i, x in enumerate(v))


def grammar_field(endpoint: str, body: Any) -> str | None:
    """The field of the client's request that the grammar of ``body`` (the engine's body
    for ``endpoint``: chat, completions, responses, messages) came from, or None: a
    grammar, a JSON schema, a response format (Responses': ``text.format``), tools (the
    engine constrains tool calls with a grammar of their parameters)."""
    if not isinstance(body, dict):
        return None
    if body.get("grammar"):
        return "grammar"
    if body.get("json_schema"):
        return "json_schema"
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_schema", "json_object"):
        return "text.format" if endpoint == "responses" else "response_format"
    if body.get("tools"):
        return "tools"
    return None


class Bounds:
    """The checks of :mod:`slmguard.serve.bounds` with one server's :class:`Limits`;
    ``simulate_stacks``: the engine build has no grammar bound of its own (its parse
    stacks are simulated before it, best effort)."""

    def __init__(self, limits: Limits, *, simulate_stacks: bool = True) -> None:
        self.limits = limits
        self.simulate_stacks = simulate_stacks

    def check(self, body: Any) -> None:
        """Raise :class:`~slmguard.errors.RequestError` (400, naming the field) for the
        first bound ``body`` (a parsed JSON request) breaks."""
        self._values(body)
        if not isinstance(body, dict):
            return  # the schema refuses it
        self._numbers(body)
        for path, value, _ in _walk(body):
            if path and path[-1] == "grammar" and isinstance(value, str):
                self._grammar(path, value)
            elif path and path[-1] in SCHEMA_FIELDS and isinstance(value, dict):
                self._schema(path, value)
        kwargs = body.get("chat_template_kwargs")
        if isinstance(kwargs, dict) and "messages" in kwargs:
            raise _refuse(("chat_template_kwargs", "messages"),
                          "the messages go in the request's `messages` (this one would pass "
                          "the control-token check and the session by)")  # fmt: skip

    # ------------------------------------------------------------------ every value

    def _values(self, body: Any) -> None:
        limit = self.limits.json_depth
        for path, v, depth in _walk(body):
            if depth > limit:
                raise _refuse(path[:3], f"nested more than {limit} levels deep (the limit: "
                              "--max-json-depth)")  # fmt: skip
            if isinstance(v, dict):
                for k in v:
                    self._string(path, k, (*path, k))
            elif isinstance(v, str):
                self._string(path, v, path)
            elif isinstance(v, float) and not math.isfinite(v):
                raise _refuse(path, "not a finite number")
            elif isinstance(v, int) and not isinstance(v, bool) and not _INT_MIN <= v <= _INT_MAX:
                raise _refuse(path, "integer outside 64 bits")

    @staticmethod
    def _string(path: tuple[Any, ...], s: str, named: tuple[Any, ...]) -> None:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as err:
            raise _refuse(named, f"text that is not valid Unicode ({err.reason} at "
                          f"character {err.start}: a lone UTF-16 surrogate?)",
                          "invalid_text") from None  # fmt: skip
        if "\0" in s:
            field = next((p for p in reversed(path) if isinstance(p, str)), None)
            if named is not path or field not in TEXT_FIELDS:
                raise _refuse(named, "contains a NUL character (the engine would stop "
                              "reading there)", "invalid_text")  # fmt: skip

    # ------------------------------------------------------------------ numbers

    def _numbers(self, body: dict[str, Any]) -> None:
        lim = self.limits

        def count(name: str) -> int | None:
            v = body.get(name)
            return v if isinstance(v, int) and not isinstance(v, bool) else None

        for name in WINDOW_FIELDS + LENGTH_FIELDS:
            v = count(name)
            if v is not None and lim.n_ctx_slot and v > lim.n_ctx_slot:
                raise RequestTooLargeError(
                    f"{name}: {v} is more than this server's context per request "
                    f"({lim.n_ctx_slot} tokens)", param=name,
                )  # fmt: skip
        thinking = body.get("thinking")
        budget = thinking.get("budget_tokens") if isinstance(thinking, dict) else None
        if isinstance(budget, int) and lim.n_ctx_slot and budget > lim.n_ctx_slot:
            raise RequestTooLargeError(
                f"thinking.budget_tokens: {budget} is more than this server's context per "
                f"request ({lim.n_ctx_slot} tokens)", param="thinking.budget_tokens",
            )  # fmt: skip
        top_k = count("top_k")
        if top_k is not None and lim.n_vocab and top_k > lim.n_vocab:
            raise _refuse(("top_k",), f"{top_k} is more than this model's vocabulary "
                          f"({lim.n_vocab} tokens)")  # fmt: skip
        for name in PROBS_FIELDS:
            v = count(name)
            if v is not None and v > MAX_PROBS:
                raise _refuse((name,), f"at most {MAX_PROBS}, got {v}")
        bias = body.get("logit_bias")
        if isinstance(bias, dict) and lim.n_vocab:
            bad = next((k for k in bias if k.isdigit() and int(k) >= lim.n_vocab), None)
            if bad is not None:
                raise _refuse(("logit_bias", bad), f"token id {bad} is outside this model's "
                              f"vocabulary (0..{lim.n_vocab - 1})")  # fmt: skip

    # ------------------------------------------------------------------ constraints

    def _grammar(self, path: tuple[Any, ...], text: str) -> None:
        size = len(text.encode("utf-8"))
        if size > self.limits.grammar_bytes:
            raise _refuse(path, f"{size} bytes; at most {self.limits.grammar_bytes} "
                          "(--max-grammar-bytes)")  # fmt: skip
        self._scan(path, text, quotes=True)
        self._stacks(path, text)

    def _stacks(self, path: tuple[Any, ...], grammar: str | None) -> None:
        """The parse stacks the engine's sampler would check a token against, simulated
        (:mod:`slmguard.serve.grammarstacks`) within ``CHECK_BUDGET`` of work."""
        limit = self.limits.grammar_stacks
        if grammar is None or not limit or not self.simulate_stacks:
            return
        found = worst_stacks(grammar, limit=limit, budget=CHECK_BUDGET)
        if found is None or (found.finished and found.stacks <= limit):
            return
        if found.stacks > limit:
            raise _refuse(path, f"an ambiguous grammar: after {found.text!r} the engine would "
                          f"check a token against {found.stacks} parse stacks; at most "
                          f"{limit} (--max-grammar-stacks)")  # fmt: skip
        raise _refuse(path, f"a grammar too large or ambiguous to check within "
                      f"{CHECK_BUDGET} steps (the parse stacks of an ambiguous grammar are "
                      f"bounded by --max-grammar-stacks, {limit})")  # fmt: skip

    def _scan(self, path: tuple[Any, ...], text: str, *, quotes: bool) -> None:
        """Nesting, alternatives and repetition counts of a GBNF grammar (``quotes``: its
        string literals are skipped, its rules are named) or a regular expression.

        The copies nested repetitions make are a product: each open group keeps the
        largest product of counts its items reached so far (a :data:`_Product`, by the
        rules it refers to), ``{m,n}`` after an item multiplies that item's by ``n`` (``m``
        when open-ended) and ``*``, ``+``, ``?`` copy nothing; a rule referred to inside a
        repetition multiplies by its own product (a recursive reference by 1)."""
        lim = self.limits
        depth = deepest = alternatives = 0
        rules: dict[str, _Product] = {}
        rule = ""  # the GBNF rule being read ("": a pattern, or text before the first rule)
        frames: list[_Product] = [{}]  # the open groups, outermost first
        last: _Product = {None: 1}  # the item a repetition after it applies to
        i, n = 0, len(text)
        while i < n:
            c = text[i]
            if c == "\\":
                i += 2
                last = {None: 1}
                _merge(frames[-1], last)
                continue
            if c == "[" or (quotes and c == '"'):
                i = _skip_literal(text, i, "]" if c == "[" else '"')
                last = {None: 1}
                _merge(frames[-1], last)
                continue
            if quotes and c == "#":
                end = text.find("\n", i)
                i = n if end < 0 else end
                continue
            if quotes and c in " \t\r\n":
                i += 1
                continue
            if quotes and (c.isalnum() or c in "-_"):
                j = i
                while j < n and (text[j].isalnum() or text[j] in "-_"):
                    j += 1
                word, k = text[i:j], j
                while k < n and text[k] in " \t":
                    k += 1
                if text.startswith("::=", k):  # a rule's definition: the one before ends
                    _merge(rules.setdefault(rule, {}), _close(frames))
                    rule, frames, last = word, [{}], {None: 1}
                    i = k + 3
                    continue
                last = {word: 1}
                _merge(frames[-1], last)
                i = j
                continue
            if c == "(":
                depth += 1
                deepest = max(deepest, depth)
                frames.append({})
                last = {None: 1}
            elif c == ")":
                depth = max(0, depth - 1)
                last = (frames.pop() if len(frames) > 1 else {}) or {None: 1}
                _merge(frames[-1], last)
            elif c == "|":
                alternatives += 1
                last = {None: 1}
            elif c == "{":
                end = text.find("}", i)
                spec = text[i + 1 : end] if end > 0 else ""
                parts = [part.strip() for part in spec.split(",")]
                for part in parts:
                    if part.isdigit() and int(part) > lim.repetition:
                        raise _refuse(path, f"repetition {{{spec}}}: at most {lim.repetition} "
                                      "(--max-repetition)")  # fmt: skip
                if len(parts) <= 2 and all(p.isdigit() or not p for p in parts) and any(parts):
                    count = int(parts[-1] or parts[0])
                    last = {r: min(f * count, _SATURATED) for r, f in last.items()}
                    _merge(frames[-1], last)
                    i = end + 1
                    continue
                last = {None: 1}  # a literal brace
            elif c not in "*+?":
                last = {None: 1}
                _merge(frames[-1], last)
            i += 1
        if deepest > lim.grammar_nesting:
            raise _refuse(path, f"parentheses nested {deepest} deep; at most "
                          f"{lim.grammar_nesting} (--max-grammar-nesting)")  # fmt: skip
        if alternatives + 1 > lim.grammar_alternatives:
            raise _refuse(path, f"{alternatives + 1} alternatives; at most "
                          f"{lim.grammar_alternatives} (--max-grammar-alternatives)")  # fmt: skip
        _merge(rules.setdefault(rule, {}), _close(frames))
        name, product = _largest(rules)
        if product > lim.repetition_product:
            where = f" (rule `{name}`)" if name else ""
            raise _refuse(path, f"nested repetitions make {_copies(product)} copies{where}; "
                          f"at most {lim.repetition_product} "
                          "(--max-repetition-product)")  # fmt: skip

    def _schema(self, path: tuple[Any, ...], schema: dict[str, Any]) -> None:
        lim = self.limits
        size = len(json.dumps(schema, ensure_ascii=False).encode("utf-8"))
        if size > lim.schema_bytes:
            raise _refuse(path, f"a JSON schema of {size} bytes; at most {lim.schema_bytes} "
                          "(--max-schema-bytes)")  # fmt: skip
        for here, v, depth in _walk(schema, path):
            if depth > lim.schema_depth:
                raise _refuse(path, f"a JSON schema nested more than {lim.schema_depth} "
                              "levels deep (--max-schema-depth)")  # fmt: skip
            key = here[-1] if len(here) > len(path) else None
            if key == "enum" and isinstance(v, list) and len(v) > lim.schema_enum:
                raise _refuse(here, f"{len(v)} values; at most {lim.schema_enum} "
                              "(--max-schema-enum)")  # fmt: skip
            elif key in SCHEMA_ALTERNATIVES and isinstance(v, list):
                if len(v) > lim.grammar_alternatives:
                    raise _refuse(
                        here,
                        f"{len(v)} alternatives; at most "
                        f"{lim.grammar_alternatives} (--max-grammar-alternatives)",
                    )
            elif key in SCHEMA_COUNTS and isinstance(v, int | float) and v > lim.repetition:
                raise _refuse(here, f"{v}: at most {lim.repetition} (--max-repetition)")
            elif key == "pattern" and isinstance(v, str):
                self._scan(here, v, quotes=False)
                self._stacks(here, pattern_grammar(v))


#: The largest product of repetition counts an item reaches, by the GBNF rule it refers to
#: (``None``: none): ``{None: 4, "x": 3}`` is max(4, 3 x the product of rule ``x``).
_Product = dict[str | None, int]


def _merge(into: _Product, product: _Product) -> None:
    for ref, factor in product.items():
        if factor > into.get(ref, 0):
            into[ref] = factor


def _close(frames: list[_Product]) -> _Product:
    """The product of a rule whose text ended with ``frames`` open (unbalanced: the
    engine refuses it, but the counts in it still count)."""
    out: _Product = {}
    for frame in frames:
        _merge(out, frame)
    return out


def _largest(rules: dict[str, _Product]) -> tuple[str, int]:
    """The rule with the largest product of nested repetition counts, and that product:
    references resolved depth-first without recursion (a rule referring to itself, directly
    or not, is a loop the engine does not copy: it counts 1 there)."""
    value: dict[str, int] = {}
    visiting: set[str] = set()
    for root in rules:
        stack = [root]
        while stack:
            name = stack[-1]
            if name in value:
                stack.pop()
            elif name not in visiting:
                visiting.add(name)
                stack.extend(r for r in rules[name] if r in rules and r not in visiting)
            else:
                stack.pop()
                best = 1
                for ref, factor in rules[name].items():
                    sub = value.get(ref, 1) if ref is not None else 1
                    best = max(best, min(factor * sub, _SATURATED))
                value[name] = best
    name = max(value, key=lambda r: value[r], default="")
    return name, value.get(name, 1)


def _copies(product: int) -> str:
    return f"more than {_SATURATED - 1}" if product >= _SATURATED else str(product)


def _skip_literal(text: str, i: int, close: str) -> int:
    """The index after the literal (``"..."`` or ``[...]``) opening at ``i``."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == close:
            return j + 1
        j += 1
    return j
