"""The simulation of llama.cpp's grammar stacks (:mod:`slmguard.serve.grammarstacks`), pure.

What bounds.py refuses with it is in ``test_serve_bounds.py``; the same grammars
against the real engine in ``test_serve_hostile.py``. The patterns' expected GBNF is
llama.cpp's own (``tests/test-json-schema-to-grammar.cpp`` in the vendored 0.3.36
source, its rule ``root-1`` named ``p-1`` here).
"""

from __future__ import annotations

import pytest

from slmguard.serve.grammarstacks import pattern_grammar, worst_stacks

#: llama.cpp's grammars/json.gbnf (MIT), as the engine ships it.
JSON_GBNF = r"""root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
"""

STAR = '("a" | "a" | [a-z])*'


def stacks(grammar: str, limit: int = 10**9) -> int:
    found = worst_stacks(grammar, limit=limit, budget=200_000)
    assert found is not None and found.finished, found
    return found.stacks


# fmt: off
PATTERNS = [
    ("^abc?d*efg+(hij)?kl$", '"ab" "c"? "d"* "ef" "g"+ ("hij")? "kl"'),
    ("^\\[\\]\\{\\}\\(\\)\\|\\+\\*\\?$", '"[]{}()|+*?"'),
    ('^"$', '"\\""'),
    ("^A|B|C|D$", '"A" | "B" | "C" | "D"'),
    ("^(\\([0-9]{1,3}\\))?[0-9]{3}-[0-9]{4} a{3,5}nd...$",
     '("(" p-1{1,3} ")")? p-1{3,3} "-" p-1{4,4} " " "a"{3,5} "nd" dot dot dot'),
    ("^(?:foo|bar)baz$", '("foo" | "bar") "baz"'),
    ("^(?:(?:ab)+c)?d$", '(("ab")+ "c")? "d"'),
    ("^[a-z\\-]+$", "[a-z\\-]+"),
    ("^a\\-b$", '"a\\-b"'),
]
# fmt: on


@pytest.mark.parametrize(("pattern", "body"), PATTERNS)
def test_a_pattern_becomes_the_grammar_llama_cpp_makes_of_it(pattern: str, body: str) -> None:
    grammar = pattern_grammar(pattern)
    assert grammar is not None
    assert grammar.splitlines()[0] == f'root ::= "\\"" ({body}) "\\""'
    assert worst_stacks(grammar, limit=256, budget=200_000) is not None  # the engine parses it


@pytest.mark.parametrize("pattern", ["[0-9]+", "^[0-9]{3}\\w$", "^(a$", "^(?=a)a$", "^a{x}$"])
def test_a_pattern_the_converter_does_not_convert_has_no_grammar(pattern: str) -> None:
    # Unanchored or unsupported: the engine accepts any string there; invalid: it refuses.
    assert pattern_grammar(pattern) is None


@pytest.mark.parametrize("grammar", [
    'root ::= x',  # an undefined rule
    'root ::= root "a" | "b"',  # left recursion
    'root ::= "a',  # an unterminated literal
    'root ::= "a" \\q',
    'other ::= "a"',  # no root
    'root ::= "a"{2001}',  # beyond the engine's own repetition threshold
])  # fmt: skip
def test_a_grammar_the_engine_refuses_itself_is_not_simulated(grammar: str) -> None:
    assert worst_stacks(grammar, limit=256, budget=200_000) is None


def test_unambiguous_grammars_keep_few_stacks() -> None:
    assert stacks('root ::= "yes" | "no"') == 2
    assert stacks(JSON_GBNF) <= 16  # a number: [0-9] and [1-9] [0-9]{0,15} both take a 1
    assert stacks('root ::= (word " ")* word\nword ::= [a-zA-Z]+') <= 4


def test_ambiguity_is_counted_in_paths_not_distinct_stacks() -> None:
    # One star of three alternatives that all take an "a": 3 paths, then 3 x 3 ...
    one = stacks(f"root ::= {STAR}")
    two = stacks(f"root ::= {STAR} {STAR}")
    ten = stacks("root ::= " + " ".join([STAR] * 10))
    assert one < two < ten
    assert ten > 256
    # The alternatives told apart: one path per character.
    assert stacks('root ::= ("a" | "b" | [c-z])*') == 4  # "a", "b", [c-z] or the end
    assert one > 4


def test_nullable_repetitions_are_counted_before_the_first_character() -> None:
    # ((a|b)?){0,n} as the engine expands it: each of the n optional copies may be the one
    # that takes the first character.
    grammar = pattern_grammar("^((a|b){0,1}){0,1000}$")
    assert grammar is not None
    found = worst_stacks(grammar, limit=256, budget=200_000)
    assert found is not None and found.stacks > 256 and found.text == '"'


def test_an_ambiguous_part_behind_a_plain_one_is_found() -> None:
    # The text that keeps the most paths alive goes to the four x's first; the ambiguous
    # part after "yzzzz" is found by the search from every stack.
    grammar = ('root ::= ("x" | "x" | "x" | "x") [a-z]* | "y" "zzzz" ' + "(" + STAR + ")" * 1
               + " " + " ".join([STAR] * 10))  # fmt: skip
    found = worst_stacks(grammar, limit=256, budget=200_000)
    assert found is not None and found.stacks > 256
    assert found.text.startswith("yzzzz")


def test_the_search_stops_at_the_limit_and_says_where() -> None:
    grammar = "root ::= " + " ".join([STAR] * 40)
    found = worst_stacks(grammar, limit=200, budget=200_000)
    assert found is not None and found.finished
    assert found.stacks > 200 and found.text == "a"
    before = worst_stacks(grammar, limit=100, budget=200_000)  # 121 before any character
    assert before is not None and before.stacks > 100 and before.text == ""


def test_the_search_within_its_budget_says_it_did_not_finish() -> None:
    # 25 x 1,000 copies of 10 characters: 250,000 elements built before any search.
    grammar = "root ::= " + " ".join(['"abcdefghij"{1000}'] * 25)
    found = worst_stacks(grammar, limit=256, budget=200_000)
    assert found is not None and not found.finished
    assert worst_stacks(grammar, limit=256, budget=400_000) is not None


#: Issue 37's grammar: a class that excludes every character the search tried as a probe,
#: three ways to read each character, ten times: 528 bytes past the probes unseen (31
#: stacks counted), and on a build without the grammar bound decoding stalled.
NEGATED = "root ::= " + " ".join(["([^a0 x\\né一] | [^a0 x\\né一] | [^a0 x\\né一])*"] * 10)


def test_a_negated_class_that_excludes_every_probe_is_still_searched() -> None:
    assert len(NEGATED.encode()) == 528
    assert stacks(NEGATED, limit=256) > 256
    # A class that takes nothing the search can find (every character it tries) has no
    # character: its paths stay unseen, as before, without an error.
    assert stacks('root ::= [^\\x00-\\U0010FFFF] "a"') == 1
