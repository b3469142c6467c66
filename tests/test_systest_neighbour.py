"""The innocent neighbour's pure parts (issue 39): the systest step's parsers and verdicts,
its selection (only when named) and the benchmark's rows; no VM needed."""

from __future__ import annotations

import http.server
import json
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the systest package
sys.path.insert(0, str(REPO / "benchmarks"))

import systest_neighbour as bench  # noqa: E402
from systest import report  # noqa: E402
from systest.guest import scenario as sc  # noqa: E402

from waiting import scaled  # noqa: E402

MIB = 1 << 20
DECLARED = 192 * MIB

GOV = "WARNING slmguard.governor: governor."
JOURNAL = "\n".join(
    [
        "Dec 06 07:40:01 slmguard[312]: INFO uvicorn: started",
        GOV + 'transition {"from_level": "normal", "pressure_pct": 86.1, "to_level": "shed"}',
        GOV + 'transition {"from_level": "shed", "pressure_pct": 93.0, "to_level": "degrade"}',
        GOV + 'max_tokens_cap {"cap": 128}',
        GOV + 'transition {"from_level": "degrade", "to_level": "critical"}',
        GOV + 'park {"engine_private_bytes": 1, "pressure_pct": 97.4}',
        GOV + 'transition {"broken json"',
        'INFO slmguard.governor: governor.resume {"n_ctx": 512}',
    ]
)


def test_governor_events_are_read_in_order_and_bad_lines_skipped() -> None:
    events = sc.governor_events(JOURNAL)
    assert [e[0] for e in events] == [
        "governor.transition",
        "governor.transition",
        "governor.max_tokens_cap",
        "governor.transition",
        "governor.park",
        "governor.resume",
    ]
    assert events[0][1]["to_level"] == "shed"


def test_meminfo_lines_are_read_in_kib() -> None:
    text = (
        "MemTotal:        2012345 kB\nCommitLimit:     1006172 kB\nHugePages_Total:       0\nbad\n"
    )
    assert sc.parse_meminfo_kib(text) == {
        "MemTotal": 2012345,
        "CommitLimit": 1006172,
        "HugePages_Total": 0,
    }


def test_the_ladder_is_the_highest_level_and_the_rungs_acted_on() -> None:
    ladder = sc.ladder_seen(["normal", "shed", "None"], sc.governor_events(JOURNAL))
    assert ladder == {
        "highest": "critical",
        "levels": ["normal", "shed", "degrade", "critical"],
        "actions": ["max_tokens_cap", "park", "resume"],
    }
    assert sc.ladder_seen(["normal", "shed"], [])["highest"] == "shed"
    assert sc.ladder_seen([], [])["highest"] is None


def _sample(at: float, current: int = DECLARED + 9 * MIB, **kw: Any) -> sc.InnocentSample:
    events = kw.pop("events", {"low": 0, "high": 0, "max": 0, "oom": 0, "oom_kill": 0})
    return sc.InnocentSample(at, current, events, kw.pop("pid", 700), kw.pop("rss", DECLARED + MIB))


def test_an_untouched_neighbour_has_no_problems() -> None:
    samples = [_sample(0.0), _sample(0.5), _sample(1.0)]
    assert sc.neighbour_verdict(samples, DECLARED, 700, [(812, "python3")]) == []


@pytest.mark.parametrize(
    ("change", "word"),
    [
        ({"pid": None, "rss": 0, "current": 0}, "replaced or gone"),
        ({"pid": 901}, "replaced or gone"),
        ({"current": DECLARED - 4096}, "memory.current"),
        ({"rss": DECLARED - 4096}, "RssAnon"),
        ({"events": {"low": 3, "oom": 0, "oom_kill": 0}}, "low went 0 -> 3"),
        ({"events": {"low": 0, "oom": 1, "oom_kill": 1}}, "oom_kill went 0 -> 1"),
        ({"events": {"low": 0, "high": 2, "max": 0}}, "high went 0 -> 2"),
        ({"events": {"low": 0, "high": 0, "max": 1}}, "max went 0 -> 1"),
    ],
)
def test_each_harm_to_the_neighbour_is_named(change: dict[str, Any], word: str) -> None:
    samples = [_sample(0.0), _sample(0.5, **change), _sample(1.0)]
    if "events" in change:  # a counter only grows
        samples[2] = _sample(1.0, events=change["events"])
    problems = sc.neighbour_verdict(samples, DECLARED, 700, [])
    assert any(word in p for p in problems), problems


def test_a_kernel_kill_of_the_neighbour_is_named() -> None:
    problems = sc.neighbour_verdict([_sample(0.0)], DECLARED, 700, [(700, "python3")])
    assert problems == ["the kernel killed the neighbour: [(700, 'python3')]"]
    assert sc.neighbour_verdict([], DECLARED, 700, []) == ["the neighbour was never sampled"]


CRITICAL = {"highest": "critical", "levels": ["shed", "critical"], "actions": ["park"]}


def test_the_load_verdict_wants_shedding_critical_and_a_200_after() -> None:
    good = [(1.0, 200, None, ""), (9.0, 503, "2", "memory_shedding"), (60.0, 200, None, "")]
    assert sc.load_verdict(good, CRITICAL, recovered=True) == []
    assert sc.load_verdict(good[:1], CRITICAL, True) == [
        "never answered 503 with Retry-After and a memory code (memory_shedding, "
        "memory_projection, engine_parked) while the hog grew"
    ]
    restarts = [(1.0, 200, None, ""), (9.0, 503, "2", "engine_stalled"), (60.0, 200, None, "")]
    assert "never answered 503" in sc.load_verdict(restarts, CRITICAL, True)[0]
    parked = [(1.0, 200, None, ""), (9.0, 503, "2", "engine_parked"), (60.0, 200, None, "")]
    assert sc.load_verdict(parked, CRITICAL, True) == []
    no_header = [(9.0, 503, None, "memory_shedding")]
    assert "never answered 503" in sc.load_verdict(no_header, CRITICAL, True)[0]
    shed_only = {"highest": "shed", "levels": ["shed"], "actions": []}
    assert sc.load_verdict(good, shed_only, True) == [
        "the governor never reached critical (highest shed)"
    ]
    odd = [*good, (20.0, None, None, "timed out"), (21.0, 500, None, "internal")]
    assert "2 requests unanswered or failed" in sc.load_verdict(odd, CRITICAL, True)[0]
    assert sc.load_verdict(good, CRITICAL, recovered=False) == ["no 200 after the hog left"]


def test_the_neighbour_step_runs_only_when_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Not in CI's `make systest` (every step but the named-only ones)."""

    def ok(ctx: sc.Ctx) -> tuple[str, dict[str, Any]]:
        return "fine", {}

    monkeypatch.setattr(sc, "STEPS", [("facts", (), (), ok), ("neighbour-lives", (), (), ok)])
    out = tmp_path / "results.jsonl"
    assert sc.run([], sc.Output(out, None), deadline_s=scaled(600)) == 0
    assert report.expected_steps(report.parse_results(out.read_text().splitlines()).events) == (
        "facts",
    )
    out.unlink()
    assert sc.run(["facts", "neighbour-lives"], sc.Output(out, None), scaled(600)) == 0
    parsed = report.parse_results(out.read_text().splitlines())
    assert [(s.step, s.status) for s in parsed.steps] == [
        ("facts", "pass"),
        ("neighbour-lives", "pass"),
    ]
    assert "neighbour-lives" in sc.NEIGHBOUR_STEPS and "neighbour-lives" in sc.ORDER


def test_the_benchmark_steps_are_the_scenario_s() -> None:
    names = [s[0] for s in sc.STEPS]
    assert all(s in names for s in bench.STEPS.split(","))
    needs = dict((s[0], s[2]) for s in sc.STEPS)["neighbour-lives"]
    assert set(needs) <= set(bench.STEPS.split(","))


def _record() -> dict[str, Any]:
    return {
        "step": "neighbour-lives",
        "status": "pass",
        "reason": "neighbour 700 lived",
        "duration_s": 412.5,
        "details": {
            "load": {
                "critical_after_s": 48.0,
                "hog_gone_s": 59.1,
                "recovered_after_s": 190.2,
                "peak": {"hog_bytes": 400 * MIB},
            },
            "ladder": {"highest": "critical", "actions": ["park", "max_tokens_cap", "park"]},
            "neighbour_min_current": DECLARED + 5 * MIB,
            "responses": [
                [1.0, 200, None, ""],
                [20.5, 503, "1", "memory_shedding"],
                [50.0, 503, "5", "engine_parked"],
                [190.2, 200, None, ""],
            ],
        },
    }


def test_a_benchmark_row_comes_from_the_step_s_record() -> None:
    lines = ['{"event": "begin"}', "not json", json.dumps(_record()), '{"event": "end"}']
    row = bench.run_row(bench.step_record(lines), 0, 700.4)
    assert row["first_503_s"] == 20.5
    assert (row["critical_s"], row["hog_gone_s"], row["recovered_s"]) == (48.0, 59.1, 190.2)
    assert row["actions"] == ["max_tokens_cap", "park"]
    assert row["neighbour_min_mib"] == 197.0 and row["hog_peak_mib"] == 400
    assert row["statuses"] == {"200": 2, "503 memory_shedding": 1, "503 engine_parked": 1}
    missing = bench.run_row(bench.step_record(['{"event": "begin"}']), 1, 90.0)
    assert missing["status"] == "missing" and missing["exit"] == 1


def test_the_section_has_a_line_per_run_and_the_count_passed() -> None:
    rows = [bench.run_row(_record(), 0, 700.0), bench.run_row(None, 1, 80.0)]
    text = bench.section(rows, "1.0 / 2.0 / 3.0", "make systest-neighbour")
    assert text.startswith(bench.SECTION + "\n")
    assert "**1 of 2 passed.**" in text
    assert "| 1 | 0 | pass | 20.5 | 48.0 | 59.1 | 190.2 | critical |" in text
    assert "| 2 | 1 | missing |" in text


def test_the_cache_comes_from_the_systest_arguments() -> None:
    assert bench.cache_dir(["--cache", "/c"]) == Path("/c")
    assert bench.cache_dir(["--strict", "--cache=/d"]) == Path("/d")
    assert bench.cache_dir([]).name == "systest"


def test_a_refusal_is_recorded_with_its_code_message_and_retry_after() -> None:
    body = json.dumps({"error": {"code": "memory_shedding", "message": "memory at 91%"}})
    shed = sc.Http(503, {"retry-after": "5"}, body, 0.1)
    assert sc._error_of(shed) == {
        "status": 503,
        "retry_after": "5",
        "code": "memory_shedding",
        "message": "memory at 91%",
    }
    gone = sc._error_of(sc.Http(None, {}, "", 60.0, error="timed out"))
    assert (gone["status"], gone["code"], gone["message"]) == (None, None, "timed out")
    assert sc._error_of(sc.Http(200, {}, "{}", 0.1))["code"] is None


def test_the_governor_is_read_with_the_admin_token(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The status route wants the admin token apply made; a refusal is kept, not {}."""

    class Route(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = self.headers.get("Authorization") == "Bearer s3cret"
            body = json.dumps({"level": "critical"} if ok else {"error": {}}).encode()
            self.send_response(200 if ok else 401)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Route)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        ctx = sc.Ctx(base_url=f"http://127.0.0.1:{server.server_address[1]}")
        token = tmp_path / "admin-token"
        monkeypatch.setattr(sc, "ADMIN_TOKEN", token)
        assert sc._governor(ctx) == {"http": 401}  # no token file: the API key's headers
        token.write_text("s3cret\n")
        assert sc._governor(ctx) == {"level": "critical"}
    finally:
        server.shutdown()
        server.server_close()
