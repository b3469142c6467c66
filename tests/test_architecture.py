"""The rules of docs/architecture.md (imports, function length) hold, and break when broken.

The contracts are in pyproject.toml ([tool.importlinter]); `make lint` runs them
too. A broken rule is shown on a copy of the package with one forbidden import
added, so the contracts are known to catch what they claim to.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(src: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo", "--config", str(REPO / "pyproject.toml")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=src,
        check=False,
    )


def test_the_contracts_hold() -> None:
    done = lint_imports(REPO / "src")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "16 kept, 0 broken" in done.stdout


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        # host/ reads the host and imports no family
        ("host/procfs.py", "import slmguard.plan.schema", "Layers"),
        # the watcher talks to the server over HTTP, never through its modules
        ("watch/rules.py", "import slmguard.serve.app", "Layers"),
        # the plan family knows nothing of the deployment
        ("plan/schema.py", "import slmguard.deploy.render", "Layers"),
        # only the CLI imports a verb
        ("serve/app.py", "import slmguard.commands.plan", "Only the CLI imports the verbs"),
        # the core verbs run where the web stack is not installed
        ("doctor/findings.py", "import fastapi", "without the web stack"),
        ("watch/client.py", "import gguf", "The watcher stays small"),
        # the live view sits over the watchdog and under the CLI: a verb is above it
        ("top/view.py", "import slmguard.cli", "Layers"),
        # it reads the server over HTTP, never through the server's or the governor's code
        ("top/sources.py", "import slmguard.serve.queue", "reach the server over HTTP only"),
        ("top/client.py", "import slmguard.governor.policy", "reach the server over HTTP only"),
        # and runs where the web stack is not installed (`top --once` on a board)
        ("top/text.py", "import fastapi", "without the web stack"),
        # the governor is policy under the server: it never imports the front
        ("governor/policy.py", "import slmguard.serve.relay", "Layers"),
        # the fleet renderers build on the local deployer, never the other way
        ("deploy/apply.py", "import slmguard.deploy.fleet.ansible", "never imports the fleet"),
        # the server's own shape: no circle among its modules (the relay drives the queue)
        ("serve/queue.py", "import slmguard.serve.relay", "No circle among the modules"),
        # the server runs the app it is given; the app reaches it through serve.parts
        ("serve/server.py", "import slmguard.serve.app", "never imports its app"),
        ("serve/routes.py", "import slmguard.serve.server", "through serve.parts"),
        # a dialect is one request shape: it never needs another, nor the relay after it
        ("serve/dialects/chat.py", "import slmguard.serve.dialects.rerank", "never import each"),
        ("serve/dialects/responses.py", "import slmguard.serve.relay", "never admits, runs"),
        # sizing is arithmetic on the engine's settings: no engine, no event loop
        ("serve/sizing.py", "import slmguard.serve.engine", "Sizing is pure"),
        ("serve/sizing.py", "import asyncio", "Sizing is pure"),
        # a stream gets what it needs of the relay through its seam, StreamOwner
        ("serve/stream.py", "import slmguard.serve.relay", "only through its seam"),
        # the plan's words are pure: no arithmetic, no planner, no host reader
        ("plan/reasons.py", "import slmguard.plan.budget", "only say what the planner found"),
        ("plan/refusals.py", "import slmguard.plan.planner", "only say what the planner found"),
        # the plan's shape knows neither its relations nor its file; the relations no file
        ("plan/schema.py", "import slmguard.plan.planfile", "over the relations, the relations"),
        ("plan/relations.py", "import slmguard.plan.planfile", "over the relations, the relations"),
        # the one largest-context search imports neither of the two that call it
        ("plan/search.py", "import slmguard.plan.planner", "below the planner and the re-budget"),
        ("plan/search.py", "import slmguard.plan.rebudget", "below the planner and the re-budget"),
    ],
)
def test_a_forbidden_import_breaks_its_contract(
    tmp_path: Path, module: str, line: str, broken: str
) -> None:
    src = tmp_path / "src"
    shutil.copytree(
        REPO / "src" / "slmguard", src / "slmguard", ignore=shutil.ignore_patterns("__pycache__")
    )
    target = src / "slmguard" / module
    target.write_text(target.read_text(encoding="utf-8") + f"\n{line}  # noqa\n", "utf-8")
    done = lint_imports(src)
    assert done.returncode == 1, done.stdout
    broken_lines = [x for x in done.stdout.splitlines() if x.endswith(" BROKEN")]
    assert any(broken in x for x in broken_lines), done.stdout


# A ceiling, not a target: past a hundred lines a function is a smell; below it the
# split follows the parts a name explains (docs/architecture.md).
MAX_FUNCTION_LINES = 100


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Every function or method under ``root`` longer than ``limit`` lines, as path:line name."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines})")
    return found


def test_no_function_is_longer_than_the_limit() -> None:
    # docs/architecture.md: a function that outgrows two screens is split where a name
    # explains the part (a rule, a section of a manifest, a stage of start-up).
    assert long_functions(REPO / "src" / "slmguard") == []


def test_the_length_check_finds_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\nasync def tall():\n{body}\n")
    assert long_functions(tmp_path) == [f"m.py:5 tall ({MAX_FUNCTION_LINES + 1})"]
