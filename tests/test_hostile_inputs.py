"""Hostile model files and plans, fed to every verb that reads them, as child processes.

Property-based (Hypothesis): GGUF headers built from a valid one by
mutations an attacker would make (truncation, huge and negative counts and
values, wrong types, arrays where scalars belong, arrays nested thousands
deep, strange strings: NULs, newlines, ``[Service]``, ``%``, 100,000
characters) go to ``plan --model`` and ``doctor --model``; plans mutated the
same way (wrong types, huge or negative numbers, 5,000-digit integers, JSON
nested thousands deep, strange strings, truncated text) go to ``doctor``,
``render`` (every target), ``apply --dry-run``, ``watch --once`` and ``serve --plan``.

Each case must end with an exit code from docs/cli.md's table and, when it
fails, one ``error:`` line (plus at most a ``hint:``), never a traceback,
within a memory bound (RLIMIT_AS of 1 GiB on the child, and its own peak RSS,
VmHWM, under 300 MiB) and a time bound (60 s, times
``SLMGUARD_TEST_TIME_FACTOR``). A plan the reader refuses must be refused by
every verb with the reader's own message (one reader), ``serve`` included:
it never starts anything for a bad plan or a model that is not the planned
file.

Deterministic: ``derandomize=True`` and no example database, so CI runs the
same examples every time; the example counts keep the suite to about a
minute on two cores.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import resource
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, event, example, given, settings
from hypothesis import strategies as st

from fleettrees import IMAGE
from ggufcraft import (
    SCALARS,
    Tensor,
    gguf_bytes,
    minimal_kv,
    minimal_tensors,
    nested_array,
    write_gguf,
)
from hostboards import RK3588_HARDENED
from hosttree import build_tree
from rendertrees import make_board_root, make_plan
from slmguard.errors import ConfigError
from slmguard.plan.planfile import load_plan, plan_to_dict
from waiting import scaled

# sysexits(3) codes of docs/cli.md's table, and doctor's/watch's own 0-3.
DOCUMENTED = {0, 1, 2, 3, 64, 65, 66, 69, 73, 74, 78}
AS_LIMIT_BYTES = 1 << 30
HWM_LIMIT_KIB = 300 << 10
CHILD = """\
import atexit, os
def _hwm():
    with open("/proc/self/status") as f:
        kib = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
    with open(os.environ["SLMGUARD_TEST_HWM_FILE"], "w") as out:
        out.write(kib)
atexit.register(_hwm)
from slmguard.cli import main
main()
"""

HYPOTHESIS = {
    "derandomize": True,
    "database": None,
    "deadline": None,
    "phases": (Phase.explicit, Phase.generate, Phase.shrink),
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
}


@dataclass(frozen=True)
class Ran:
    argv: tuple[str, ...]
    code: int
    stderr: str
    hwm_kib: int


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT_BYTES, AS_LIMIT_BYTES))


def run_verb(work: Path, *argv: str) -> Ran:
    hwm = work / "hwm"
    hwm.unlink(missing_ok=True)
    env = {
        **os.environ,
        "SLMGUARD_STATE_DIR": str(work / "state"),
        "SLMGUARD_TEST_HWM_FILE": str(hwm),
        "OPENBLAS_NUM_THREADS": "1",
        "NO_COLOR": "1",
    }
    r = subprocess.run(
        [sys.executable, "-c", CHILD, *argv],
        capture_output=True,
        text=True,
        errors="replace",
        env=env,
        timeout=scaled(60),
        preexec_fn=_limit,
        check=False,
        cwd=work,
    )
    kib = int(hwm.read_text()) if hwm.exists() else 0
    return Ran(tuple(argv), r.returncode, r.stderr, kib)


def assert_clean(ran: Ran, allowed: set[int] = DOCUMENTED) -> str | None:
    """A documented exit, a bounded child, one error line; returns that line (None: no error)."""
    where = f"{' '.join(ran.argv)[:300]} -> {ran.code}\n{ran.stderr[-2000:]}"
    assert ran.code in allowed, where
    assert "Traceback" not in ran.stderr, where
    assert ran.hwm_kib, f"the child did not report its peak RSS: {where}"
    assert ran.hwm_kib < HWM_LIMIT_KIB, f"peak RSS {ran.hwm_kib} KiB: {where}"
    lines = [ln for ln in ran.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"slmguard( \w+)?: error: ", ln)]
    for ln in lines:
        assert ln.startswith(("slmguard", "hint:", "usage:", "note:")) or ln[:4].isdigit(), where
    if ran.code in (0, 1, 2) and not errors:
        return None
    assert len(errors) == 1, where
    return errors[0]


# -- Strategies -----------------------------------------------------------------------

STRANGE = [
    "",
    "\x00",
    "tiny\n[Service]\nExecStartPre=+/bin/touch /x\n",
    "%n%h%%%i",
    "a\u202eb",
    "\r\n\t\x1b[2J",
    "é" * 30,
    "x" * 100_000,
    "$(touch /x);`id`",
    "\ud800",
]
strange_text = st.sampled_from(STRANGE) | st.text(max_size=20)

INTS = [0, 1, -1, -5, 2, 255, 4096, 2**31 - 1, 2**32 - 1, 2**63 - 1, 10**9, 10**12, -(2**63)]
int_type = st.sampled_from([k for k in SCALARS if k not in ("f32", "f64", "bool")])


def _coerce(vtype: str, value: int) -> int:
    """``value`` wrapped into what ``vtype`` holds (as a C cast would)."""
    bits = struct.calcsize(SCALARS[vtype][1]) * 8
    value %= 1 << bits
    if vtype.startswith("i") and value >= 1 << (bits - 1):
        value -= 1 << bits
    return value


gguf_scalar = st.one_of(
    st.builds(lambda t, v: (t, _coerce(t, v)), int_type, st.sampled_from(INTS) | st.integers()),
    st.tuples(st.just("f32"), st.sampled_from([0.0, -1.0, 1e30, float("nan"), float("inf")])),
    st.tuples(st.just("bool"), st.booleans()),
    st.tuples(st.just("str"), strange_text),
)
gguf_value = st.one_of(
    gguf_scalar,
    st.builds(
        lambda t, vs: ("array", (t, [_coerce(t, v) for v in vs])),
        int_type,
        st.lists(st.sampled_from(INTS), max_size=6),
    ),
    st.builds(lambda vs: ("array", ("str", vs)), st.lists(strange_text, max_size=4)),
    st.builds(lambda d: ("array", nested_array(d)), st.sampled_from([2, 3, 4, 50, 20_000])),
    st.just(("array", struct.pack("<IQ", 8, 2**62))),  # claims 2^62 strings
)
KNOWN_KEYS = [
    "general.architecture",
    "general.name",
    "general.type",
    "general.alignment",
    "general.file_type",
    "llama.block_count",
    "llama.embedding_length",
    "llama.context_length",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.attention.key_length",
    "llama.attention.sliding_window",
    "llama.attention.sliding_window_pattern",
    "llama.vocab_size",
    "tokenizer.ggml.tokens",
    "tokenizer.chat_template",
]
gguf_key = st.sampled_from(KNOWN_KEYS) | strange_text
gguf_tensor = st.builds(
    Tensor,
    st.sampled_from(["token_embd.weight", "t" * 64, "a\nb", ""]) | st.text(max_size=8),
    st.sampled_from([(8,), (0,), (64, 8), (1, 1, 1, 1, 1), (1 << 40, 1 << 40), (3,)]),
    st.sampled_from([0, 1, 8, 30, 2**20]),
    st.sampled_from([0, 33, 2048, 2**62]),
)
FACT_KEYS = [k for k in KNOWN_KEYS if k.startswith("llama.")]
int_scalar = st.builds(
    lambda t, v: (t, _coerce(t, v)), int_type, st.sampled_from(INTS) | st.integers()
)
gguf_mutation = st.one_of(
    # The facts the budget reads, most often: extreme numbers, then any value at all.
    st.tuples(st.just("set"), st.sampled_from(FACT_KEYS), int_scalar),
    st.tuples(st.just("set"), st.sampled_from(FACT_KEYS), gguf_value),
    st.tuples(st.just("set"), st.sampled_from(KNOWN_KEYS), gguf_value),
    st.tuples(st.just("set"), gguf_key, gguf_value),
    st.tuples(st.just("drop"), st.sampled_from(KNOWN_KEYS)),
    st.tuples(st.just("n_kv"), st.sampled_from([0, 1, 2**32, 2**63, 2**64 - 1])),
    st.tuples(st.just("n_tensors"), st.sampled_from([0, 3, 2**20, 2**64 - 1])),
    st.tuples(st.just("tensor"), gguf_tensor),
    st.tuples(st.just("cut"), st.floats(0.0, 1.0)),
    st.tuples(st.just("version"), st.sampled_from([1, 2, 4, 0x03000000, 2**32 - 1])),
)


def build_gguf(mutations: list[tuple[Any, ...]]) -> bytes:
    kv: dict[str, tuple[str, Any]] = {k: (t, v) for k, t, v in minimal_kv()}
    tensors = list(minimal_tensors())
    counts: dict[str, int] = {}
    cut: float | None = None
    version = 3
    for m in mutations:
        if m[0] == "set":
            kv[m[1]] = m[2]
        elif m[0] == "drop":
            kv.pop(m[1], None)
        elif m[0] in ("n_kv", "n_tensors"):
            counts[m[0]] = m[1]
        elif m[0] == "tensor":
            tensors.append(m[1])
        elif m[0] == "cut":
            cut = m[1]
        elif m[0] == "version":
            version = m[1]
    items = [(k, t, v) for k, (t, v) in kv.items()]
    data = gguf_bytes(items, tensors, data=False, version=version, **counts)
    data += b"\0" * min(1 << 16, 4096 * len(tensors))  # some data, not all it may claim
    if cut is not None:
        data = data[: int(len(data) * cut)]
    return data


JSON_BAD: list[Any] = [
    None,
    True,
    "",
    "big",
    [],
    {},
    {"a": {"b": [1]}},
    1.5,
    -1,
    -(10**6),
    0,
    10**6,
    10**12,
    10**18,
    2**63,
    "@@BIGINT@@",
    "@@DEEP@@",
    *STRANGE[:6],
    ["@@DEEP@@"],
    [1, 1, 1],
    [-2, -1],
    "/dev/../etc/shadow",
    "relative/path",
]
plan_value = st.sampled_from(JSON_BAD) | st.integers() | strange_text


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


#: The model render and apply deploy (``--model``): a small real GGUF. The plans name
#: an absent path with this file's size and sha256 (a copy elsewhere is the same model),
#: so serve, which reads the plan's path, stops at 66.
DEPLOYED = build_gguf([])


def _plan_dict(model_path: Path) -> dict[str, Any]:
    plan = make_plan(model_path=str(model_path), model_bytes=len(DEPLOYED))
    data = plan_to_dict(plan)
    data["model"]["sha256"] = hashlib.sha256(DEPLOYED).hexdigest()
    data["budget"] = [{"name": "kv_cache", "bytes": 1 << 20, "when": "load", "kind": "anon"}]
    data["reasons"] = {"n_ctx": "largest that fits"}
    return data


BASE_PATHS = _paths(_plan_dict(Path("/absent.gguf")))
plan_mutation = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(BASE_PATHS), plan_value),
    st.tuples(st.just("set"), st.sampled_from(BASE_PATHS), st.sampled_from(JSON_BAD)),
    st.tuples(st.just("drop"), st.sampled_from(BASE_PATHS)),
    st.tuples(st.just("add"), st.sampled_from(["engine", "model", "board", ""]), strange_text),
    st.tuples(st.just("cut"), st.floats(0.0, 1.0)),
    st.tuples(st.just("schema"), st.sampled_from(["slmguard.plan/1", "slmguard.plan/3", 2, ""])),
)


def build_plan_text(model_path: Path, mutations: list[tuple[Any, ...]]) -> str:
    data = _plan_dict(model_path)
    cut: float | None = None
    for m in mutations:
        if m[0] in ("set", "drop"):
            *parents, last = m[1]
            node: Any = data
            try:
                for p in parents:
                    node = node[p]
                if m[0] == "set":
                    node[last] = copy.deepcopy(m[2])
                else:
                    del node[last]
            except (KeyError, IndexError, TypeError):
                continue  # an earlier mutation removed or replaced the parent
        elif m[0] == "add":
            target = data.get(m[1], data) if m[1] else data
            if isinstance(target, dict):
                target[m[2]] = m[2]
        elif m[0] == "cut":
            cut = m[1]
        elif m[0] == "schema":
            data["schema"] = m[1]
    text = json.dumps(data)
    text = text.replace('"@@BIGINT@@"', "9" * 5000).replace('"@@DEEP@@"', "[" * 3000 + "]" * 3000)
    if cut is not None:
        text = text[: int(len(text) * cut)]
    return text


# -- The suite --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("hostile")
    return {
        "doctor_root": build_tree(base / "doctor-root", RK3588_HARDENED),
        "board_root": make_board_root(base / "board-root", "armbian"),
        "work": base,
    }


# The cases, always run first (Phase.explicit), then generated ones.
@example(mutations=[("set", "llama.block_count", ("u64", 10**12))])
@example(mutations=[("set", "llama.block_count", ("u64", 10**9))])
@example(mutations=[("set", "llama.attention.head_count", ("i32", -4))])
@example(mutations=[("set", "llama.context_length", ("i32", -5))])
@example(mutations=[("set", "llama.block_count", ("array", nested_array(20_000)))])
@example(mutations=[("set", "general.name", ("str", STRANGE[2]))])
@settings(max_examples=30, **HYPOTHESIS)
@given(mutations=st.lists(gguf_mutation, min_size=1, max_size=4))
def test_hostile_gguf_headers(hosts: dict[str, Path], mutations: list[tuple[Any, ...]]) -> None:
    work = hosts["work"]
    model = work / "hostile.gguf"
    model.write_bytes(build_gguf(mutations))
    ran = run_verb(work, "plan", "--model", str(model), "--board", "rpi5-8g", "--json")
    line = assert_clean(ran, {0, 65, 66, 78})
    event(f"plan exit {ran.code}")
    if ran.code == 65:
        assert line is not None and str(model) in line
    ran = run_verb(
        work, "doctor", "--model", str(model), "--board", "rpi5-8g",
        "--root", str(hosts["doctor_root"]),
    )  # fmt: skip
    assert_clean(ran, {0, 1, 2, 3})


#: The fleet targets of render, each into its own directory.
FLEET = ("ansible", "k8s")
#: What a fleet target needs besides the plan (k8s pins the image by its digest).
FLEET_ARGS = {"k8s": ("--image", IMAGE)}


def _verbs(hosts: dict[str, Path], plan: Path, n: int) -> list[tuple[tuple[str, ...], set[int]]]:
    out = hosts["work"] / f"out-{n}"
    model = hosts["work"] / "deployed.gguf"
    if not model.exists():
        model.write_bytes(DEPLOYED)
    fleet = ("render", "--plan", str(plan), "--model", str(model), "--force", "--target")
    return [
        (("doctor", "--plan", str(plan), "--root", str(hosts["doctor_root"])), {0, 1, 2}),
        (
            (
                "render",
                "--plan",
                str(plan),
                "--model",
                str(model),
                "--out",
                str(out),
                "--exec",
                "/usr/bin/slmguard",
            ),
            {0},
        ),
        *(
            (
                (*fleet, t, *FLEET_ARGS.get(t, ()), "--out", str(out.with_name(f"{out.name}-{t}"))),
                {0},
            )
            for t in FLEET
        ),
        (
            (
                "apply",
                "--plan",
                str(plan),
                "--model",
                str(model),
                "--dry-run",
                "--root",
                str(hosts["board_root"]),
            ),
            {0},
        ),
        (("watch", "--once", "--plan", str(plan), "--json"), {0, 1, 2}),
        # The base plan's model file does not exist: serve must stop there (66), or at the
        # model check (65) for a path the mutation pointed elsewhere, never start.
        (("serve", "--plan", str(plan), "--port", "1"), {65, 66}),
        # bench resolves the plan's model as serve does: it stops there, never measures.
        (("bench", "--plan", str(plan)), {65, 66}),
    ]


@example(mutations=[("set", ("engine", "n_ctx"), 10**12)])
@example(mutations=[("set", ("cpu_affinity",), [-2, -1])])
@example(mutations=[("set", ("kernel", "cma_bytes"), -1)])
@example(mutations=[("set", ("engine", "n_threads"), "@@BIGINT@@")])
@example(mutations=[("set", ("board", "name"), "@@DEEP@@")])
@example(mutations=[("set", ("board", "name"), STRANGE[2])])
@settings(max_examples=10, **HYPOTHESIS)
@given(mutations=st.lists(plan_mutation, min_size=1, max_size=3))
def test_hostile_plans(hosts: dict[str, Path], mutations: list[tuple[Any, ...]]) -> None:
    work = hosts["work"]
    plan = work / "hostile-plan.json"
    plan.write_text(build_plan_text(work / "absent.gguf", mutations), errors="surrogatepass")
    try:
        load_plan(plan)
        refusal = None
    except ConfigError as err:
        refusal = err.message
    event("refused" if refusal else "valid")
    for n, (argv, ok) in enumerate(_verbs(hosts, plan, 0)):
        ran = run_verb(work, *argv)
        if refusal is None:
            # A valid plan: the verb's own outcome (render and apply may refuse a plan
            # that does not fit with 78 and the numbers, or a mutated size or sha256 that
            # --model no longer has with 65; doctor says 0-2).
            assert_clean(ran, ok | {78, 73, 65})
            continue
        line = assert_clean(ran, {3} if argv[0] == "doctor" else {78})
        assert line is not None and refusal in line, (n, argv[0], refusal, ran.stderr)


def test_the_base_plan_is_valid_and_serve_stops_at_its_missing_model(
    hosts: dict[str, Path],
) -> None:
    """The suite's premise: unmutated, every verb accepts the plan and serve stops at 66."""
    plan = hosts["work"] / "base-plan.json"
    plan.write_text(build_plan_text(hosts["work"] / "absent.gguf", []))
    load_plan(plan)
    for argv, ok in _verbs(hosts, plan, 1):
        assert_clean(run_verb(hosts["work"], *argv), ok)


def test_injected_name_is_data_in_the_plan_file(tmp_path: Path) -> None:
    """The issue's GGUF: its general.name would add ExecStartPre=+ lines to a unit."""
    evil = "tiny\n[Service]\nExecStartPre=+/bin/touch /x\n"
    kv = [minimal_kv()[0], ("general.name", "str", evil), *minimal_kv()[2:]]
    model = write_gguf(tmp_path / "evil.gguf", kv)
    out = tmp_path / "plan.json"
    ran = run_verb(
        tmp_path, "plan", "--model", str(model), "--board", "rpi5-8g", "--json",
        "--out", str(out),
    )  # fmt: skip
    assert_clean(ran, {0})
    plan = load_plan(out)  # parses with the one reader: the name passed its rule
    assert plan.model.name == "tiny [Service] ExecStartPre=+/bin/touch /x"
    assert json.loads(out.read_text())["model"]["name"] == plan.model.name
    assert plan.model.sha256 == hashlib.sha256(model.read_bytes()).hexdigest()


def test_a_header_claiming_a_trillion_layers_costs_nothing(tmp_path: Path) -> None:
    """The issue's numbers: 10^12 layers looped forever, 10^9 grew ~200 MB/s."""
    for count in (10**9, 10**12):
        model = write_gguf(
            tmp_path / f"l{count}.gguf",
            [*minimal_kv("gemma3", block_count=("u64", count)),
             ("gemma3.attention.sliding_window", "u32", 512)],
        )  # fmt: skip
        ran = run_verb(tmp_path, "plan", "--model", str(model), "--board", "rpi5-8g")
        line = assert_clean(ran, {65})
        assert line is not None and f"gemma3.block_count = {count}: above 1,024" in line


def test_plan_on_a_fifo_and_a_device_refuses_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "m.gguf"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a FIFO"), (Path("/dev/zero"), "a character device")):
        ran = run_verb(tmp_path, "plan", "--model", str(path), "--board", "generic")
        line = assert_clean(ran, {65})
        assert line is not None and kind in line
