"""One hostile grammar cannot stall the engine for everyone: the engine bounds it (real engine).

slmguard's llama-server carries ``engine/grammar-max-work.patch``: a request whose
grammar needs more parse-stack work for one token than ``--grammar-max-work`` is
stopped alone (the engine's 400 ``grammar_limit_error``), the other slots decoding on.
Each grammar of a generated family (the negated class of issue 37, overlapping
alternatives repeated, nullable repetitions, JSON-schema patterns through
``json_schema`` and ``response_format``; deterministic) is sent beside a plain
request from another client (another loopback address): the plain one answers 200,
the hostile one 400 ``grammar_too_complex`` naming its field, the plain one after it
200 again, and the engine never restarts or stalls. A client that keeps sending them
is refused for a cooldown (429), its neighbour is not. A build without the bound (a
board's own ``--llama-server``; here the real binary behind a wrapper whose ``--help``
does not list the option, since only the help is read) is reported and gets the
front's simulation of the parse stacks. The pure parts are in ``test_serve_blame.py``.
"""

from __future__ import annotations

import random
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from serveproc import (
    MODEL_ID,
    REQUEST_TIMEOUT_S,
    ServeFactory,
    ServerProcess,
    module_server,
)
from slmguard.serve.blame import STRIKES
from waiting import wait_for

pytestmark = pytest.mark.engine

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
#: Issue 37's grammar: 528 bytes, a class excluding every probe of the front's old simulation.
NEGATED = "root ::= " + " ".join(["([^a0 x\\né一] | [^a0 x\\né一] | [^a0 x\\né一])*"] * 10)
PLAIN = {"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}

srv = module_server("grammarbound", ["--n-parallel", "2", "--ctx", "512"])


def client(host: int) -> httpx.Client:
    """A client from its own loopback address (127.0.0.``host``): the front tells clients
    apart by address."""
    transport = httpx.HTTPTransport(local_address=f"127.0.0.{host}")
    return httpx.Client(transport=transport, timeout=REQUEST_TIMEOUT_S)


#: The engine checks the whole vocabulary against a grammar's stacks only when the token it
#: sampled first is refused (a token the grammar takes is checked alone): greedy, after
#: this prompt, the next token starts with a space, which every grammar below refuses.
PROMPT = "Once upon a time there was"


def completion(**fields: Any) -> tuple[str, dict[str, Any]]:
    body = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    return COMPLETIONS, {**body, **fields}


def chat(**fields: Any) -> tuple[str, dict[str, Any]]:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 4, "temperature": 0}  # fmt: skip
    return CHAT, {**body, **fields}


def schema_pattern(pattern: str) -> dict[str, Any]:
    return {"type": "string", "pattern": pattern}


def family() -> list[tuple[str, str, dict[str, Any], str]]:
    """The hostile grammars (id, path, body, the field named), generated from the shapes
    that stalled an engine without the bound: three ways to read each character, ten
    times (a negated class, a letter written twice); nullable repetitions; repetitions
    of repetitions; the same as JSON-schema patterns, through ``json_schema`` and
    ``response_format``. Seeded: the same family every run."""
    rng = random.Random(37)

    def triple(alt: str) -> str:
        return " ".join([f"({alt} | {alt} | {alt})*"] * 10)

    letter = rng.choice(("a", "t"))
    negated = rng.choice(("[^e ]", "[^a0 x\\n]"))
    nullable = rng.choice((300, 400, 500))
    pattern_nullable = rng.choice((300, 600))
    negated_pattern = "^" + "([^a0 x]|[^a0 x]|[^a0 x])*" * 10 + "$"
    nullable_pattern = f"^((a|b)?){{0,{pattern_nullable}}}$"
    fmt = {"type": "json_schema",
           "json_schema": {"name": "x", "schema": schema_pattern(nullable_pattern)}}  # fmt: skip
    return [
        ("issue-37-negated-class", *completion(grammar=NEGATED), "grammar"),
        (f"negated-{negated}", *completion(grammar="root ::= " + triple(negated)), "grammar"),
        (f"letter-{letter}-twice",
         *completion(grammar="root ::= " + " ".join([f'("{letter}" | "{letter}" | [a-z])*'] * 10)),
         "grammar"),
        (f"nullable-{nullable}",
         *completion(grammar=f'root ::= (("a" | "b")?){{0,{nullable}}}'), "grammar"),
        ("letters-30x30", *completion(grammar='root ::= ("a"{0,30} | "b"{0,30}){0,30}'),
         "grammar"),
        ("pattern-negated", *completion(json_schema=schema_pattern(negated_pattern)),
         "json_schema"),
        (f"pattern-nullable-{pattern_nullable}-response-format", *chat(response_format=fmt),
         "response_format"),
    ]  # fmt: skip


FAMILY = family()


def answer(c: httpx.Client, s: ServerProcess, path: str, body: Any) -> httpx.Response:
    return c.post(s.url + path, json=body)


def unharmed(s: ServerProcess, pid: int) -> None:
    health = s.health() or {}
    assert health.get("state") == "ready", health
    engine = health["engine"]
    assert (engine["pid"], engine["restarts"], engine["stalls"]) == (pid, 0, 0), engine
    assert engine["grammar_bound"] is True


@pytest.mark.parametrize(
    ("host", "path", "body", "field"),
    [pytest.param(10 + i, *c[1:], id=c[0]) for i, c in enumerate(FAMILY)],
)
def test_a_hostile_grammar_is_refused_alone_beside_a_plain_request(
    srv: ServerProcess, host: int, path: str, body: dict[str, Any], field: str
) -> None:
    pid = srv.engine_pid()  # each attacker its own address: one strike each
    beside: list[httpx.Response] = []
    with client(host) as attacker, client(200) as neighbour:
        plain = threading.Thread(
            target=lambda: beside.append(answer(neighbour, srv, COMPLETIONS, PLAIN))
        )
        plain.start()
        hostile = answer(attacker, srv, path, body)
        plain.join(REQUEST_TIMEOUT_S)
        assert hostile.status_code == 400, hostile.text
        err = hostile.json()["error"]
        assert (err["code"], err["param"]) == ("grammar_too_complex", field), err
        assert "--grammar-max-work" in err["message"]
        assert [r.status_code for r in beside] == [200], [r.text for r in beside]
        after = answer(neighbour, srv, COMPLETIONS, PLAIN)
        assert after.status_code == 200, after.text
        # The same request again is refused by the front, before the engine spends on it.
        again = answer(attacker, srv, path, body)
        assert again.status_code == 400 and again.json()["error"]["param"] == field
    unharmed(srv, pid)


def test_a_client_that_keeps_sending_them_cools_down_alone(srv: ServerProcess) -> None:
    pid = srv.engine_pid()
    with client(99) as attacker, client(201) as neighbour:
        statuses = []
        for i in range(STRIKES + 1):
            grammar = NEGATED + f' "{i}"'  # one character changed each time
            statuses.append(answer(attacker, srv, *completion(grammar=grammar)).status_code)
        assert statuses == [400] * STRIKES + [429], statuses
        refused = answer(attacker, srv, COMPLETIONS, PLAIN)
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) > 0
        assert refused.json()["error"]["code"] == "client_cooldown"
        assert answer(neighbour, srv, COMPLETIONS, PLAIN).status_code == 200
    unharmed(srv, pid)


def test_an_idle_slot_is_shown_idle(srv: ServerProcess) -> None:
    # /slots was asked only while requests ran: its last answer, taken mid-request, showed
    # a busy slot in /health for as long as the server idled (issue 37).
    with client(202) as c:
        assert answer(c, srv, COMPLETIONS, {**PLAIN, "stream": False}).status_code == 200

    def idle() -> bool:
        slots = (srv.health() or {}).get("slots") or []
        return bool(slots) and not any(s["is_processing"] for s in slots)

    wait_for(idle, 30, "every slot shown idle in /health")


# ------------------------------------------------------------------ a build without the bound


@pytest.fixture
def foreign_build(tmp_path: Path) -> Iterator[Path]:
    """The real engine behind a wrapper whose ``--help`` does not list the option, as a
    board's own build of the same llama.cpp (the front reads only the help)."""
    from slmguard.serve.llamaserver import find_llama_server

    real = find_llama_server()
    wrapper = tmp_path / "llama-server"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'for a in "$@"; do [ "$a" = --help ] && {{ "{real}" --help | grep -v -- '
        "--grammar-max-work; exit 0; }; done\n"
        f'exec "{real}" "$@"\n'
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    yield wrapper


def test_a_build_without_the_bound_is_reported_and_its_grammars_simulated(
    serve_factory: ServeFactory, foreign_build: Path
) -> None:
    s = serve_factory("--llama-server", str(foreign_build))
    health = s.health() or {}
    assert health["engine"]["grammar_bound"] is False
    assert "has no grammar bound" in s.log()
    # The front's simulation of the parse stacks, best effort, refuses issue 37's grammar
    # before the engine (it tried no character that class takes before).
    resp = httpx.post(s.url + COMPLETIONS, json=completion(grammar=NEGATED)[1],
                      timeout=REQUEST_TIMEOUT_S)  # fmt: skip
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "grammar" and "--max-grammar-stacks" in err["message"], err
