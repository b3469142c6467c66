"""The request bounds of :mod:`slmguard.serve.bounds`, as pure checks (no engine).

The same refusals against the real server, with the engine watched for crashes and
restarts, are in ``tests/test_serve_hostile.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from slmguard.errors import RequestError, RequestTooLargeError
from slmguard.serve.bounds import CHECK_BUDGET, Bounds, Limits, grammar_field
from slmguard.settings import ServeSettings
from test_serve_grammarstacks import JSON_GBNF

N_CTX_SLOT = 512
N_VOCAB = 262_144
BOUNDS = Bounds(Limits.of(ServeSettings(), n_ctx_slot=N_CTX_SLOT, n_vocab=N_VOCAB))


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields}


def nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for _ in range(depth):
        value = {"a": value}
    return value


def refused(body: Any) -> RequestError:
    with pytest.raises(RequestError) as info:
        BOUNDS.check(body)
    return info.value


# fmt: off
REFUSED = [
    # id, body, param, a word of the message
    ("repeat-last-n-huge", chat(repeat_last_n=250_000_000), "repeat_last_n", "512"),
    ("repeat-last-n-int-max", chat(repeat_last_n=2_147_483_647), "repeat_last_n", "512"),
    ("dry-window", chat(dry_penalty_last_n=10**6), "dry_penalty_last_n", "512"),
    ("max-tokens-beyond-the-slot", chat(max_tokens=513), "max_tokens", "512"),
    ("max-completion-tokens", chat(max_completion_tokens=10**9), "max_completion_tokens", "512"),
    ("top-k-beyond-the-vocabulary", chat(top_k=N_VOCAB + 1), "top_k", str(N_VOCAB)),
    ("n-probs", chat(n_probs=10_000), "n_probs", "20"),
    ("logit-bias-id", chat(logit_bias={"999999999": 1.0}), "logit_bias.999999999", "vocabulary"),
    ("grammar-nested-parentheses", chat(grammar="root ::= " + "(" * 20_000 + '"a"' + ")" * 20_000),
     "grammar", "bytes"),
    ("grammar-nesting-under-the-size", chat(grammar="root ::= " + "(" * 100 + '"a"' + ")" * 100),
     "grammar", "nested 100 deep"),
    ("grammar-alternatives", chat(grammar="root ::= " + " | ".join(['"a"'] * 2000)),
     "grammar", "2000 alternatives"),
    ("grammar-repetition", chat(grammar='root ::= "a"{1000000}'), "grammar", "repetition"),
    ("grammar-nul", chat(grammar='\0root ::= "a"'), "grammar", "NUL"),
    ("schema-enum", chat(json_schema={"enum": list(range(50_000))}), "json_schema", "bytes"),
    ("schema-enum-small-values", chat(json_schema={"enum": [0] * 300}), "json_schema.enum",
     "300 values"),
    ("schema-max-items", chat(json_schema={"type": "array", "maxItems": 10**6}),
     "json_schema.maxItems", "1024"),
    ("schema-depth", chat(json_schema=nested(40)), "json_schema", "nested more than 32"),
    ("schema-pattern", chat(json_schema={"type": "string", "pattern": "a{99999}"}),
     "json_schema.pattern", "repetition"),
    ("schema-any-of", chat(json_schema={"anyOf": [{"const": i} for i in range(1500)]}),
     "json_schema.anyOf", "alternatives"),
    ("response-format-schema-depth",
     chat(response_format={"type": "json_schema",
                           "json_schema": {"name": "x", "schema": nested(40)}}),
     "response_format.json_schema", "nested more than"),
    ("tool-parameters-depth",
     chat(tools=[{"type": "function", "function": {"name": "f", "parameters": nested(33)}}]),
     "tools.0.function.parameters", "nested more than 32"),
    ("json-nested-400", chat(chat_template_kwargs=nested(400)), "chat_template_kwargs.a.a",
     "64 levels"),
    ("surrogate-in-content", chat(messages=[{"role": "user", "content": "\ud800"}]),
     "messages.0.content", "surrogate"),
    ("surrogate-in-stop", chat(stop=["x\udfff"]), "stop.0", "surrogate"),
    ("surrogate-in-a-key", chat(chat_template_kwargs={"\ud800": 1}),
     "chat_template_kwargs.\ud800", "surrogate"),
    ("nul-in-stop", chat(stop="a\0"), "stop", "NUL"),
    ("nan", chat(temperature=float("nan")), "temperature", "finite"),
    ("infinity-in-a-schema", chat(json_schema={"maximum": float("inf")}), "json_schema.maximum",
     "finite"),
    ("integer-beyond-64-bits", chat(seed=1 << 70), "seed", "64 bits"),
    ("template-kwargs-messages",
     chat(chat_template_kwargs={"messages": [{"role": "user", "content": "<end_of_turn>"}]}),
     "chat_template_kwargs.messages", "control-token"),
    ("tokenize-surrogate", {"content": "\ud83d"}, "content", "surrogate"),
]
# fmt: on


@pytest.mark.parametrize(
    ("body", "param", "word"), [pytest.param(*c[1:], id=c[0]) for c in REFUSED]
)
def test_a_hostile_field_is_refused_by_name(body: Any, param: str, word: str) -> None:
    err = refused(body)
    assert err.param == param
    assert word in err.message


def test_lengths_beyond_the_slot_say_context_length_exceeded() -> None:
    err = refused(chat(max_tokens=10_000))
    assert isinstance(err, RequestTooLargeError) and err.code == "context_length_exceeded"


ACCEPTED = [
    chat(),
    chat(repeat_last_n=-1, max_tokens=N_CTX_SLOT, top_k=40, n_probs=20),
    chat(repeat_last_n=N_CTX_SLOT),
    chat(grammar='root ::= ("yes" | "no") [a-z]{1,16} # a comment with ( and |'),
    chat(grammar='root ::= "(((((" "|||" [(|)]'),  # literals and classes are not structure
    chat(
        json_schema={
            "type": "object",
            "properties": {"a": {"type": "string", "maxLength": 64, "pattern": "^[a-z]{1,8}$"}},
        }
    ),
    chat(messages=[{"role": "user", "content": "a\0b"}]),  # text: a NUL is a character
    chat(messages=[{"role": "user", "content": [{"type": "text", "text": "\0"}]}]),
    chat(stop=["\U0001f600"], temperature=1e308),
    chat(chat_template_kwargs={"enable_thinking": False}),
    chat(seed=(1 << 64) - 1),
    [1, 2],  # not an object: the schema's to refuse
]


@pytest.mark.parametrize("body", ACCEPTED)
def test_ordinary_requests_pass(body: Any) -> None:
    BOUNDS.check(body)


def test_the_limits_are_the_settings() -> None:
    tight = Bounds(Limits.of(ServeSettings(max_json_depth=3, max_grammar_alternatives=2),
                             n_ctx_slot=0, n_vocab=0))  # fmt: skip
    with pytest.raises(RequestError, match="more than 3 levels"):
        tight.check(chat(chat_template_kwargs=nested(3)))
    with pytest.raises(RequestError, match="3 alternatives; at most 2"):
        tight.check(chat(grammar='root ::= "a" | "b" | "c"'))
    tight.check(chat(repeat_last_n=10**9, top_k=10**9))  # unknown context and vocabulary


def test_a_body_as_deep_as_the_parser_allows_does_not_exhaust_the_stack() -> None:
    err = refused(nested(50_000))
    assert "64 levels" in err.message


# ------------------------------------------------------------------ nested repetitions multiply


def array_of(item: dict[str, Any], max_items: int) -> dict[str, Any]:
    return {"type": "array", "items": item, "maxItems": max_items}


def pattern(regex: str) -> dict[str, Any]:
    return {"type": "string", "pattern": regex}


# fmt: off
NESTED = [
    # id, body, param, the product in the message
    ("grammar-groups", chat(grammar='root ::= ((("a"{0,999}){0,999}){0,999})'), "grammar",
     "997002999 copies"),
    ("grammar-group-of-a-class", chat(grammar='root ::= ("a" [b-c]{1,40}){30}'), "grammar",
     "1200 copies"),
    ("grammar-open-ended-counts-its-minimum", chat(grammar='root ::= ("a"{50}){30,}'),
     "grammar", "1500 copies"),
    ("grammar-named-rules", chat(grammar='root ::= x{0,50}\nx ::= y{0,50}\ny ::= "a" | "b"'),
     "grammar", "2500 copies (rule `root`)"),
    ("grammar-rule-in-a-group",
     chat(grammar='root ::= ("<" item ">"){100}\nitem ::= [a-z]{1,20}'), "grammar",
     "2000 copies"),
    ("grammar-rule-used-before-defined",
     chat(grammar='root ::= list\nlist ::= ("[" word "]"){0,100}\nword ::= [a-z]{0,50}'),
     "grammar", "5000 copies (rule `list`)"),
    ("pattern-two-levels", chat(json_schema=pattern("^((a|b){0,100}){0,100}$")),
     "json_schema.pattern", "10000 copies"),
    ("pattern-three-levels", chat(json_schema=pattern("^(((a|b){0,100}){0,100}){0,100}$")),
     "json_schema.pattern", "1000000 copies"),
    ("pattern-in-a-property",
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
         "type": "object", "properties": {"p": pattern("([a-z]{1,50}-){1,50}")}}}}),
     "response_format.json_schema.schema.properties.p.pattern", "2500 copies"),
    ("pattern-in-tool-parameters",
     chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
         "type": "object", "properties": {"p": pattern("(?:x(?:y{2,40}){0,40})+")}}}}]),
     "tools.0.function.parameters.properties.p.pattern", "1600 copies"),
]
# fmt: on


@pytest.mark.parametrize(
    ("body", "param", "product"), [pytest.param(*c[1:], id=c[0]) for c in NESTED]
)
def test_nested_repetitions_are_bounded_by_their_product(
    body: Any, param: str, product: str
) -> None:
    err = refused(body)
    assert err.param == param
    assert product in err.message
    assert err.message.endswith("at most 1024 (--max-repetition-product)")


#: 100 objects of 20 strings of at most 200 characters.
NORMAL_SCHEMA = array_of(
    {"type": "object", "required": [f"f{i}" for i in range(20)],
     "properties": {f"f{i}": {"type": "string", "maxLength": 200} for i in range(20)}},
    100,
)  # fmt: skip

# fmt: off
NOT_MULTIPLIED = [
    # siblings add, they do not multiply
    chat(grammar='root ::= "a"{0,999} "b"{0,999} ("c"{0,999}) ("d"{1000})'),
    chat(grammar='root ::= x{0,30} y{0,30}\nx ::= "a"{30}\ny ::= "b"{30}'),
    chat(grammar='root ::= ("a"{0,999})* ("b"{1,999})+ ("c"{999})?'),  # * + ? copy nothing
    chat(grammar='root ::= item{0,30}\nitem ::= "(" item{0,30} ")" | "x"'),  # a loop: once
    chat(grammar='root ::= "{" ("{" [a-z]{1000} "}") "}" # ("a"{100}){100}'),  # literal, comment
    chat(grammar='root ::= ("\\(" [)]{1000} ")")'),
    chat(json_schema=pattern("^[a-z]{1,1000}(-[a-z]{1,10}){0,99}$")),
    chat(json_schema=pattern("^(\\d{1,3}\\.){3}\\d{1,3}$|x{,1000}|{[0-9]+}")),
    # a schema's counts along items and properties are rules of their own in the engine
    # (5 levels of 999 cost what one level does): not multiplied
    chat(json_schema=NORMAL_SCHEMA),
    chat(json_schema=array_of(array_of(array_of({"type": "string", "maxLength": 999}, 999),
                                       999), 999)),
]
# fmt: on


@pytest.mark.parametrize("body", NOT_MULTIPLIED)
def test_siblings_and_normal_schemas_are_not_multiplied(body: Any) -> None:
    BOUNDS.check(body)


def test_the_product_bound_is_the_setting() -> None:
    loose = Bounds(Limits.of(ServeSettings(max_repetition_product=10**6, max_grammar_stacks=0),
                             n_ctx_slot=0, n_vocab=0))  # fmt: skip
    loose.check(chat(json_schema=pattern("^(((a|b){0,100}){0,100}){0,100}$")))
    tight = Bounds(Limits.of(ServeSettings(max_repetition_product=100), n_ctx_slot=0,
                             n_vocab=0))  # fmt: skip
    with pytest.raises(RequestError, match=r"101 copies \(rule `root`\); at most 100 "):
        tight.check(chat(grammar='root ::= "a"{101}'))  # one level is a product of one
    tight.check(chat(grammar='root ::= ("a"{10}){10}'))


def test_a_product_of_thousands_of_levels_is_named_without_overflow() -> None:
    grammar = "root ::= " + "(" * 60 + '"a"' + "){999}" * 60
    err = refused(chat(grammar=grammar))
    assert "more than 18446744073709551615 copies" in err.message


# ------------------------------------------------------------------ ambiguous grammars

STAR = '("a" | "a" | [a-z])*'


def tool(parameters: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


# fmt: off
AMBIGUOUS = [
    # id, body, param: each within every other bound; each wedged or slowed the bare engine
    # (Gemma 3 270M, 8 tokens: no token in 45 s, or 300 alternatives 15 s of CPU for 8)
    ("star-repeated-under-1-kb", chat(grammar="root ::= " + " ".join([STAR] * 40)), "grammar"),
    ("star-repeated-10", chat(grammar="root ::= " + " ".join([STAR] * 10)), "grammar"),
    ("alternatives-that-repeat-the-same-letter",
     chat(grammar='root ::= ("a"{0,30} | "b"{0,30}){0,30}'), "grammar"),  # a product of 900
    ("300-alternatives-alive-together",
     chat(grammar="root ::= " + " | ".join(f'x "{i}"' for i in range(300)) + "\nx ::= [a-z]*"),
     "grammar"),
    ("pattern-nullable-1000", chat(json_schema=pattern("^((a|b){0,1}){0,1000}$")),
     "json_schema.pattern"),  # a product of 1,000
    ("pattern-three-levels-of-10", chat(json_schema=pattern("^(((a|b){0,10}){0,10}){0,10}$")),
     "json_schema.pattern"),
    ("pattern-in-tool-parameters",
     chat(tools=tool({"type": "object",
                      "properties": {"p": pattern("^((a|b){0,1}){0,1000}$")}})),
     "tools.0.function.parameters.properties.p.pattern"),
    ("pattern-in-response-format",
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema":
         pattern("^(((a|b){0,10}){0,10}){0,10}$")}}),
     "response_format.json_schema.schema.pattern"),
    ("behind-a-plain-part",
     chat(grammar='root ::= ("x" | "x" | "x") [a-z]* | "y" "zzzz" ' + " ".join([STAR] * 10)),
     "grammar"),
]
# fmt: on


@pytest.mark.parametrize(("body", "param"), [pytest.param(*c[1:], id=c[0]) for c in AMBIGUOUS])
def test_an_ambiguous_grammar_is_refused_by_its_parse_stacks(body: Any, param: str) -> None:
    err = refused(body)
    assert err.param == param
    assert "an ambiguous grammar: after" in err.message
    assert err.message.endswith("at most 256 (--max-grammar-stacks)")


# fmt: off
NOT_AMBIGUOUS = [
    chat(grammar=JSON_GBNF),
    chat(grammar='root ::= ([a-z]+)+'),  # ambiguous, cheaply: decoded as fast as no grammar
    chat(grammar='root ::= ([a-z]{1,20} " "?)+'),
    chat(grammar=f"root ::= {STAR} {STAR}"),
    chat(grammar='root ::= [a-z]* [a-z]* [a-z]*'),
    chat(grammar="root ::= " + " | ".join(f'"{i}"' for i in range(200))),
    chat(json_schema={"type": "object", "properties": {
        "email": pattern("^[a-z0-9._%+-]+@[a-z0-9.-]+\\.[a-z]{2,}$"),
        "date": pattern("^[0-9]{4}-[0-9]{2}-[0-9]{2}$"),
        "ip": pattern("^([0-9]{1,3}\\.){3}[0-9]{1,3}$"),
        "phone": pattern("^\\+?[0-9]{1,3}[ -]?\\(?[0-9]{3}\\)?[ -]?[0-9]{3}[ -]?[0-9]{4}$"),
        "slug": pattern("^[a-z]{1,1000}(-[a-z]{1,10}){0,99}$")}}),
    chat(tools=tool({"type": "object", "properties": {
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "sku": pattern("^[A-Z]{3}-[0-9]{4}$")}, "required": ["unit"]})),
]
# fmt: on


@pytest.mark.parametrize("body", NOT_AMBIGUOUS)
def test_grammars_in_common_use_are_not_refused_as_ambiguous(body: Any) -> None:
    BOUNDS.check(body)


def test_the_stacks_bound_is_the_setting_and_0_turns_it_off() -> None:
    def limits(stacks: int) -> Bounds:
        return Bounds(Limits.of(ServeSettings(max_grammar_stacks=stacks), n_ctx_slot=0,
                                n_vocab=0))  # fmt: skip

    three = chat(grammar="root ::= [a-z]* [a-z]* [a-z]*")  # 16 paths by the 2nd character
    with pytest.raises(RequestError, match=r"at most 8 \(--max-grammar-stacks\)"):
        limits(8).check(three)
    limits(16).check(three)
    limits(0).check(chat(grammar="root ::= " + " ".join([STAR] * 40)))


def test_a_grammar_beyond_the_checks_budget_is_refused_naming_it() -> None:
    # 25 x 1,000 copies of 10 characters: the engine would build 250,000 elements.
    err = refused(chat(grammar="root ::= " + " ".join(['"abcdefghij"{1000}'] * 25)))
    assert err.param == "grammar"
    assert f"within {CHECK_BUDGET} steps" in err.message and "--max-grammar-stacks" in err.message


def test_an_engine_with_the_grammar_bound_gets_no_stack_simulation() -> None:
    # slmguard's builds stop an ambiguous grammar themselves (400 naming its field); the
    # simulation is a best effort kept for a board's own build only. The other bounds
    # (nesting, alternatives, repetitions) protect the parser and stay.
    bounded = Bounds(Limits.of(ServeSettings(), n_ctx_slot=N_CTX_SLOT, n_vocab=N_VOCAB),
                     simulate_stacks=False)  # fmt: skip
    ambiguous = chat(grammar="root ::= " + " ".join([STAR] * 40))
    refused(ambiguous)
    bounded.check(ambiguous)
    with pytest.raises(RequestError, match="nested"):
        bounded.check(chat(grammar="root ::= " + "(" * 200 + '"a"' + ")" * 200))


@pytest.mark.parametrize(
    ("endpoint", "body", "field"),
    [
        ("completions", {"prompt": "x", "grammar": "root ::= x"}, "grammar"),
        ("chat", chat(json_schema={"type": "string"}), "json_schema"),
        ("chat", chat(response_format={"type": "json_schema", "json_schema": {}}),
         "response_format"),
        ("responses", {"input": "x", "response_format": {"type": "json_object"}}, "text.format"),
        ("messages", {"messages": [], "tools": [{"name": "f"}]}, "tools"),
        ("chat", chat(response_format={"type": "text"}), None),
        ("chat", chat(), None),
    ],
)  # fmt: skip
def test_the_field_a_grammar_came_from_is_named(
    endpoint: str, body: dict[str, Any], field: str | None
) -> None:
    assert grammar_field(endpoint, body) == field
