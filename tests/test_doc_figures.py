"""docs/serve.md states the engine's grammar bound and issue 37's figures as they are.

The default it names is the patch's own, every llama.cpp issue the patch answers is
linked, and the figures it quotes are the ones ``benchmarks/`` wrote to RESULTS.md
(``grammar_bound.py``, ``liveness.py``): a rerun that changes them makes this fail
until the docs say the new ones. Pure reading: no engine.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
SERVE_MD = ROOT / "docs" / "serve.md"
PATCH = ROOT / "engine" / "grammar-max-work.patch"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"


def _section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def _doc_section(title: str) -> str:
    text = SERVE_MD.read_text(encoding="utf-8")
    start = text.index(f"\n### {title}")
    end = text.find("\n### ", start + 1)
    return " ".join(text[start:end].split())


def test_the_documented_default_bound_is_the_patch_s() -> None:
    default = re.search(r"grammar_max_work = (\d+);", PATCH.read_text(encoding="utf-8"))
    assert default is not None, "the patch declares no default for grammar_max_work"
    doc = _doc_section("Constrained decoding")
    assert f"its default {int(default.group(1)):,} steps" in doc


def test_every_llama_cpp_issue_the_patch_answers_is_linked() -> None:
    header = PATCH.read_text(encoding="utf-8").split("\n---", 1)[0]
    issues = set(re.findall(r"#(\d{3,5})", header))
    assert issues, "the patch names no llama.cpp issue"
    doc = _doc_section("Constrained decoding")
    for number in issues:
        link = rf"\[#{number}\]\(https://github\.com/ggml-org/llama\.cpp/(issues|pull)/{number}\)"
        assert re.search(link, doc), f"#{number} is not linked"


def test_the_grammar_figures_are_the_benchmark_s() -> None:
    results = _section(RESULTS.read_text(encoding="utf-8"), "grammar bound")
    doc = _doc_section("Constrained decoding")
    json_gbnf = re.search(r"\| llama\.cpp's json\.gbnf \| 200 \| ([\d,]+) \|", results)
    assert json_gbnf is not None
    millions = int(json_gbnf.group(1).replace(",", "")) / 1e6
    assert f"`json.gbnf` {millions:.1f} million" in doc
    refused = [float(s) for s in re.findall(r"400 grammar_too_complex in ([\d.]+) s", results)]
    assert refused, "no hostile grammar refused in the benchmark"
    assert f"refused after {min(refused):.1f}-{max(refused):.1f} s" in doc
    assert "restarts 0, stalls 0, grammar bound True" in results


def test_the_fresh_server_stop_figure_is_the_benchmark_s_and_within_the_goal() -> None:
    results = _section(RESULTS.read_text(encoding="utf-8"), "liveness")
    row = re.search(r"\| before any request \| ([\d.]+) \| ([\d.]+) \| 503 \|", results)
    assert row is not None, "liveness.py has not recorded the fresh-server stop"
    stall_s, answer_s = float(row.group(1)), float(row.group(2))
    assert answer_s <= stall_s + 2.0  # issue 37's goal: the stall time + 2 s
    doc = _doc_section("When the engine is wedged")
    assert f"a chat got 503 after {answer_s:.1f} s" in doc
    assert f"`--stall-floor-s` ({stall_s:.0f} s;" in doc  # the default the README quotes


def test_a_build_without_the_bound_is_reported_as_the_docs_say() -> None:
    """What ``slmguard engine`` prints of a foreign build is what the docs quote, and it
    points back at the section that explains it."""
    from slmguard.commands.engine import grammar_bound_text

    doc = _doc_section("Constrained decoding")
    assert "`slmguard engine` (`grammar bound: no`)" in doc
    assert grammar_bound_text(False).startswith("no ")
    assert "'Constrained decoding'" in grammar_bound_text(False)
    assert "`engine.grammar_bound: false`" in doc
