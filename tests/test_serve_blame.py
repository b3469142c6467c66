"""Who made the engine fail (:mod:`slmguard.serve.blame`), as pure bookkeeping (no engine).

The same against the real server (a grammar refused by the engine's bound, a plain
request beside it never blamed) is in ``tests/test_serve_grammarbound.py``.
"""

from __future__ import annotations

import signal
from typing import Any

import pytest

from slmguard.errors import ClientCooldownError, GrammarLimitError, RequestError, envelope
from slmguard.serve.blame import COOLDOWN_S, STRIKE_WINDOW_S, STRIKES, CrashMemory, crashed


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_only_the_engines_own_faults_are_crashes() -> None:
    for sig in (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE):
        assert crashed(-sig)
    # Killed from outside (the OOM killer, the stall kill), a build for another CPU, an
    # exit status: nothing the requests did.
    for rc in (-signal.SIGKILL, -signal.SIGILL, -signal.SIGTERM, 1, 0, None):
        assert not crashed(rc)


@pytest.mark.parametrize("exit_first", [False, True], ids=["death-seen-first", "exit-first"])
def test_a_crash_blames_the_last_request_the_engine_got_not_its_neighbours(
    exit_first: bool,
) -> None:
    memory = CrashMemory()
    hi, long_, last = chat(prompt="hi"), chat(prompt="long"), chat(prompt="last")
    memory.sent(101, 1, long_, "10.0.0.1")
    memory.sent(101, 2, hi, "10.0.0.2")
    memory.finished(101, 2)  # answered before the crash
    memory.sent(101, 3, last, "10.0.0.3")
    if exit_first:
        memory.settle(101, -signal.SIGSEGV)
        memory.finished(101, 1)  # the relay sees its stream end after the exit: no matter
    else:
        memory.settle(101, -signal.SIGSEGV)
    with pytest.raises(RequestError) as info:
        memory.check(dict(reversed(list(last.items()))))  # the same request, keys reordered
    assert info.value.code == "request_crashed_engine"
    assert envelope(info.value).status == 400
    memory.check(long_)  # running beside it: not blamed
    memory.check(hi)
    assert len(memory) == 1


def test_an_engine_killed_from_outside_blames_nothing() -> None:
    memory = CrashMemory()
    body = chat(prompt="killed")
    memory.sent(202, 1, body, "10.0.0.1")
    memory.settle(202, -signal.SIGKILL)  # the OOM killer, the liveness check's stall kill
    memory.check(body)
    memory.sent(202, 2, body, "10.0.0.1")  # it had died already: it never ran there
    memory.check(body)
    assert len(memory) == 0


def test_a_stall_blames_no_request_on_an_engine_with_the_grammar_bound() -> None:
    memory = CrashMemory()
    wedging = chat(grammar='root ::= ("a" | "a" | [a-z])*')
    assert memory.stalled([(wedging, "10.0.0.1", "grammar"), (chat(), "10.0.0.2", None)]) == 0
    memory.check(wedging)


def test_a_stall_on_a_build_without_the_bound_blames_only_requests_with_a_grammar() -> None:
    memory = CrashMemory()
    memory.grammar_bound = False
    wedging, hi = chat(grammar='root ::= ("a" | "a" | [a-z])*'), chat()
    assert memory.stalled([(wedging, "10.0.0.1", "grammar"), (hi, "10.0.0.2", None)]) == 1
    with pytest.raises(RequestError) as info:
        memory.check(wedging)
    assert info.value.code == "request_crashed_engine" and info.value.param == "grammar"
    memory.check(hi, "10.0.0.2")


def test_a_grammar_the_engine_refused_is_refused_again_naming_its_field() -> None:
    memory = CrashMemory()
    body = chat(response_format={"type": "json_schema", "json_schema": {"schema": {}}})
    memory.grammar_refused(body, "10.0.0.1", "response_format")
    with pytest.raises(GrammarLimitError) as info:
        memory.check(body)
    env = envelope(info.value)
    assert (env.status, env.code, env.param) == (400, "grammar_too_complex", "response_format")


def test_a_client_that_keeps_making_the_engine_fail_cools_down_alone() -> None:
    clock = Clock()
    memory = CrashMemory(clock=clock)
    for i in range(STRIKES - 1):
        memory.grammar_refused(chat(grammar=f"root ::= x{i}"), "10.0.0.9", "grammar")
    memory.check(chat(prompt="fine"), "10.0.0.9")  # not yet
    memory.grammar_refused(chat(grammar="root ::= last"), "10.0.0.9", "grammar")
    with pytest.raises(ClientCooldownError) as info:
        memory.check(chat(prompt="fine"), "10.0.0.9")
    env = envelope(info.value)
    assert (env.status, env.code) == (429, "client_cooldown")
    assert env.headers()["Retry-After"] == str(int(COOLDOWN_S))
    memory.check(chat(prompt="fine"), "10.0.0.10")  # its neighbour is served
    memory.check(chat(prompt="fine"))  # and a request whose client is unknown
    clock.now += COOLDOWN_S / 2
    with pytest.raises(ClientCooldownError) as info:
        memory.check(chat(prompt="fine"), "10.0.0.9")
    assert info.value.retry_after_s == int(COOLDOWN_S / 2)
    clock.now += COOLDOWN_S / 2
    memory.check(chat(prompt="fine"), "10.0.0.9")  # the cooldown is over


def test_strikes_older_than_the_window_are_forgotten() -> None:
    clock = Clock()
    memory = CrashMemory(clock=clock)
    for i in range(STRIKES * 2):
        memory.grammar_refused(chat(grammar=f"root ::= x{i}"), "10.0.0.9", "grammar")
        clock.now += STRIKE_WINDOW_S / (STRIKES - 1) + 1
    memory.check(chat(prompt="fine"), "10.0.0.9")


def test_the_memory_holds_the_last_requests_only() -> None:
    memory = CrashMemory(size=2)
    first = chat(prompt="first")
    memory.remember(first)
    memory.remember(chat(a=1))
    memory.remember(chat(a=2))
    assert len(memory) == 2
    memory.check(first)  # the oldest is forgotten
