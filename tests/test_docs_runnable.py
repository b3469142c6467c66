"""The README is a front door that works as typed (issue 38).

Every command block of README.md and docs/index.md marked runnable is run as typed
(``tests/docblocks.py`` says how), the Quickstart walked in this tree with the real
engine (``make quickstart`` walks it in a fresh clone, on purpose: minutes); both
READMEs stay short and run the same commands; docs/index.md links every doc; every
generation example in the docs asks for a bounded answer. Troubleshooting's entries quote
what slmguard really answers: the loading one against an engine whose model load is held
for real (``tests/loadgate.c``, preloaded).
"""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import docblocks
import loadgate
from docblocks import ROOT, Block, WalkFailed, blocks, quickstart, shell_blocks, walk
from serveproc import ServerProcess, start_server
from waiting import scaled, wait_for

READMES = (ROOT / "README.md", ROOT / "README.zh-CN.md")
#: The docs the README sends a newcomer to first (the ones the front door moved out).
FRONT_DOCS = tuple(ROOT / "docs" / f"{n}.md" for n in ("index", "install", "tour", "cli", "gpu"))
MAX_LINES = 200


def _commands(block: Block) -> tuple[str, ...]:
    return tuple(block.command_text(c) for c in block.commands)


def test_the_readmes_are_short_and_run_the_same_commands() -> None:
    english, chinese = ([_commands(b) for b in blocks(p)] for p in READMES)
    assert english == chinese, "README.zh-CN.md must run what README.md runs"
    for path in READMES:
        lines = path.read_text(encoding="utf-8").count("\n")
        assert lines <= MAX_LINES, f"{path.name}: {lines} lines (at most {MAX_LINES})"
    # The Quickstart: three commands, the server among them.
    qs = quickstart()
    assert len(qs.commands) == 3 and qs.background == "make run" and qs.until == "ready: "


def test_the_index_links_every_doc() -> None:
    index = (ROOT / "docs/index.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\(([\w-]+\.md)(?:#[\w-]+)?\)", index))
    docs = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    assert docs <= linked, f"docs/index.md does not link {sorted(docs - linked)}"
    readme = READMES[0].read_text(encoding="utf-8")
    for target in re.findall(r"\]\((docs/[\w-]+\.md)", readme):
        assert (ROOT / target).is_file(), f"README links {target}, which is not there"


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    heads = re.findall(r"^#+\s+(.*)$", path.read_text(encoding="utf-8"), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_every_relative_link_of_the_readmes_and_docs_resolves() -> None:
    for doc in (*READMES, *sorted((ROOT / "docs").glob("*.md"))):
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text(encoding="utf-8")):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            linked = (doc.parent / path) if path else doc
            assert linked.exists(), f"{doc.name}: a link to {target}, which is not there"
            if anchor and linked.suffix == ".md":
                assert anchor in _anchors(linked), f"{doc.name}: no heading for {target}"


#: A shell variable spliced into a single-quoted body (``'"$URL"'``): a string there.
_SPLICE = re.compile(r"'\"\$\w+\"'")
_BODY = re.compile(
    r"(/v1/(?:chat/completions|completions|responses|messages))\b[^`]*?-d '(\{.*?\})'", re.S
)


def test_every_generation_example_bounds_its_answer() -> None:
    """A curl example without max_tokens runs up to the server's default on a slow CPU,
    which looks like a hang to a newcomer: every one in the READMEs and docs bounds it."""
    checked = 0
    for path in (*READMES, *sorted((ROOT / "docs").glob("*.md"))):
        text = re.sub(r"\\\n\s*", " ", path.read_text(encoding="utf-8"))
        for route, body in _BODY.findall(text):
            data = json.loads(_SPLICE.sub("X", body))
            key = "max_output_tokens" if route == "/v1/responses" else "max_tokens"
            assert key in data, f"{path.name}: {route} example without {key}: {body}"
            checked += 1
    assert checked >= 4


def test_the_parser_and_the_walker_fail_what_fails(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "text\n<!-- runnable -->\n```sh\necho one   # a comment\nprintf '%s' \\\n  two\n"
        "# a comment line\n```\n\n```sh\nnot runnable\n```\n"
        '<!-- runnable: background="sleep 600" until="never" -->\n```sh\nsleep 600\n```\n'
    )
    first, second = blocks(doc)
    assert first.commands == ("echo one   # a comment", "printf '%s' two")
    assert [s.output for s in walk(first, tmp_path).steps] == ["one\n", "two"]
    assert (second.background, second.until) == ("sleep 600", "never")
    for bad in ("false", 'echo \'{"error": {"message": "no"}}\'', "exit 3"):
        with pytest.raises(WalkFailed):
            walk(Block("x.md", 1, (bad,)), tmp_path)
    # A server that exits before its line is a failure, not a hang.
    with pytest.raises(WalkFailed, match="exited 0 before"):
        walk(Block("x.md", 1, ("true",), "true", "ready: "), tmp_path)


def _typed_commands(path: Path) -> list[tuple[str, list[str]]]:
    """Each command of every ``sh`` block of ``path`` as words, ``sudo`` and leading
    variable assignments dropped, cut at a pipe, a list or a redirection."""
    out = []
    for block in shell_blocks(path):
        for command in block.commands:
            text = block.command_text(command)
            words = shlex.split(text)
            while words and (words[0] == "sudo" or re.match(r"^\w+=", words[0])):
                words = words[1:]
            cut = [i for i, w in enumerate(words) if w in ("|", "&&", "||", ";") or w[0] == ">"]
            out.append((f"{path.name}:{block.line}: {text}", words[: min(cut, default=None)]))
    return out


#: A word a reader must replace before typing (``<this repository's URL>``, ``<FILE>``).
_PLACEHOLDER = re.compile(r"<[^<>\s][^<>]*>")


def test_every_command_of_the_readmes_is_typeable_as_written() -> None:
    """No command of the READMEs' Install and Quickstart blocks (nor any other of their
    ``sh`` blocks) holds a placeholder: each is typed as written where the text says (the
    clone's top directory, the packages' directory, a board)."""
    checked = 0
    for path in READMES:
        for block in shell_blocks(path):
            for command in block.commands:
                text = block.command_text(command)
                assert not _PLACEHOLDER.search(text), f"{path.name}:{block.line}: {text}"
                checked += 1
    assert checked >= 20


def test_every_cli_and_make_command_of_the_front_docs_parses() -> None:
    """The commands a newcomer cannot run here (a board's, the .deb's, a model of their own)
    still name flags and targets that exist: every ``slmguard`` command of the READMEs and
    the front docs parses, without an old spelling; every ``make`` target is there."""
    from slmguard.cli import build_parser
    from slmguard.options import RENAMED

    targets = set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    checked = 0
    for path in (*READMES, *FRONT_DOCS):
        for where, words in _typed_commands(path):
            if words and Path(words[0]).name == "slmguard":
                try:
                    args = build_parser().parse_args(words[1:])
                except SystemExit as exit_:  # a bad flag or value
                    pytest.fail(f"{where}: exit {exit_.code}")
                assert not getattr(args, RENAMED, None), where
                checked += 1
            elif words and words[0] == "make":
                named = [w for w in words[1:] if "=" not in w and not w.startswith("-")]
                assert set(named) <= targets, where
                checked += 1
    assert checked >= 20


@pytest.mark.parametrize(
    "block", [b for b in docblocks.all_blocks() if not b.background], ids=lambda b: b.path
)
def test_a_runnable_block_runs_as_typed(block: Block) -> None:
    """Each command exits 0, and none uses a flag's old spelling (plan's `--slots`,
    `--cache-ram`, `--flash-attn on|off` still work, with a warning a reader should not
    meet in the docs)."""
    for step in walk(block, ROOT).steps:
        assert step.returncode == 0
        assert "the old spelling still works" not in step.output, step.output


@pytest.mark.engine
def test_the_quickstart_walks_as_typed_in_this_tree() -> None:
    """make, make run (until "ready: "), the curl: a completion of 16 tokens at most; make
    and make run say where the CLI is."""
    from serveproc import engine_available

    if not engine_available():
        pytest.skip("the llama-server binary is not there (run `make`)")
    result = walk(quickstart(), ROOT, port=docblocks.free_port())
    make, curl = result.steps
    assert "slmguard is set up in .venv" in make.output and "make run" in make.output
    answer = json.loads(curl.output)
    assert answer["object"] == "text_completion" and answer["choices"][0]["text"]
    assert 0 < answer["usage"]["completion_tokens"] <= 16
    assert "ready: http://127.0.0.1:" in result.server_log
    # make run says how to use the CLI it built before it serves.
    assert ".venv/bin/slmguard --help" in result.server_log


def _quoted(text: str) -> str:
    """The error a README's Troubleshooting entry quotes, in both READMEs alike."""
    found = [re.findall(rf"\*\*[^*`]*`([^`]*{re.escape(text)}[^`]*)`", p.read_text("utf-8"))
             for p in READMES]  # fmt: skip
    assert found[0] and found[0] == found[1], f"the READMEs do not both quote {text!r}"
    return str(found[0][0])


def test_troubleshooting_quotes_the_port_error_slmguard_gives() -> None:
    """What serve says on a port already taken (before any engine), as the READMEs quote."""
    quoted = _quoted("Address already in use")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cli = Path(sys.executable).parent / "slmguard"
        done = subprocess.run([str(cli), "serve", "--port", str(port)], capture_output=True,
                              text=True, timeout=scaled(120), check=False)  # fmt: skip
    assert done.returncode == 78, done.stderr
    assert quoted.replace(":8080:", f":{port}:") in done.stderr.splitlines()


@pytest.mark.engine
def test_troubleshooting_quotes_the_error_of_a_body_without_its_type(
    server: ServerProcess,
) -> None:
    """curl's -d without the JSON content type sends a form: the answer the README quotes."""
    import httpx

    quoted = _quoted("valid dictionary")
    body = json.dumps({"model": "m", "prompt": "The capital of France is", "max_tokens": 4})
    url = server.url + "/v1/completions"
    resp = httpx.post(url, content=body, timeout=scaled(60),
                      headers={"content-type": "application/x-www-form-urlencoded"})  # fmt: skip
    assert resp.status_code == 400 and quoted in resp.json()["error"]["message"], resp.text


def _loading_entry() -> tuple[int, str, str, str]:
    """Troubleshooting's loading entry, in both READMEs alike: status, message, code and
    Retry-After, as a newcomer reads them."""
    quoted = _quoted("Loading model")
    entries = []
    for path in READMES:
        text = path.read_text(encoding="utf-8")
        after = text[text.index(quoted) + len(quoted) :].split("\n\n", 1)[0]
        found = re.search(r"HTTP `(\d{3})`[,，] ?`Retry-After: (\d+)`", after)
        assert found, f"{path.name}: the loading entry names no status and Retry-After"
        entries.append(found.groups())
    assert entries[0] == entries[1], "the READMEs' loading entries differ"
    message = re.search(r'"message": "([^"]*)"', quoted)
    code = re.search(r'"code":\s*"([^"]*)"', quoted)
    assert message and code, quoted
    return int(entries[0][0]), message.group(1), code.group(1), entries[0][1]


@pytest.mark.engine
def test_troubleshooting_quotes_what_serve_answers_while_the_engine_loads(
    tmp_path: Path,
) -> None:
    """A real slow load: the engine (tests/loadgate.c, preloaded) holds its opening of the
    model's .gguf while a gate file exists, listening meanwhile. A completion asked then
    gets exactly what the READMEs' Troubleshooting entry quotes (status, message, code,
    Retry-After); once the gate is gone the model loads and the same request answers 200."""
    import httpx

    status, message, code, retry_after = _loading_entry()
    shim = loadgate.build(tmp_path)
    if shim is None:
        pytest.skip("no C compiler for the load gate")
    gate = tmp_path / "gate"
    gate.touch()
    server = start_server(tmp_path, env=loadgate.engine_env(shim, gate), wait=False)
    body = {"model": "gemma-3-270m-q4_k_m", "prompt": "The capital of France is", "max_tokens": 4}
    try:
        wait_for(loadgate.held(gate).exists, 120, "the engine at its model's open")
        with httpx.Client(timeout=scaled(60)) as client:
            resp = client.post(server.url + "/v1/completions", json=body)
            assert (server.health() or {}).get("state") == "loading"
            assert resp.status_code == status, resp.text
            error = resp.json()["error"]
            assert (error["message"], error["code"]) == (message, code), resp.text
            assert resp.headers.get("retry-after") == retry_after
            gate.unlink()
            server.wait_state("ready")
            resp = client.post(server.url + "/v1/completions", json=body, timeout=scaled(300))
            assert resp.status_code == 200, resp.text
            assert 0 < resp.json()["usage"]["completion_tokens"] <= 4
    finally:
        gate.unlink(missing_ok=True)
        server.stop()
