"""host.cpufeatures: the features every core has, from /proc/cpuinfo or the auxiliary vector.

The arm64 trees are the captured boards of ``tests/fixtures/boards`` (their
cpuinfo as the kernels printed it); the emulated case is what qemu-user shows an
arm64 process on an x86 host (the host's x86 cpuinfo, the emulated CPU's auxv
words: 0x119ffb / 0 are qemu 7.2's ``-cpu cortex-a76``, measured here).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from hostboards import copy_board
from hosttree import build_tree
from slmguard.host.cpufeatures import (
    AT_HWCAP,
    AT_HWCAP2,
    HWCAP2_NAMES,
    HWCAP_NAMES,
    hwcap_features,
    machine_name,
    parse_auxv,
    parse_cpuinfo,
    read_cpu_features,
)

X86_CPUINFO = (
    "processor\t: 0\nflags\t\t: fpu sse sse2 pni ssse3 sse4_1 sse4_2 avx avx2 fma f16c\n\n"
    "processor\t: 1\nflags\t\t: fpu sse sse2 pni ssse3 sse4_1 sse4_2 avx avx2 fma f16c\n"
)
A76_HWCAP = 0x119FFB


def auxv(*pairs: tuple[int, int]) -> bytes:
    return b"".join(struct.pack("<QQ", k, v) for k, v in (*pairs, (0, 0)))


@pytest.mark.parametrize(
    ("board", "dotprod", "i8mm"),
    [
        ("rk3588-rock5b", True, False),
        ("jetson-orin-nano-devkit", True, False),
        ("rpi5", True, False),
        ("rpi4-aarch64", False, False),
    ],
)
def test_captured_boards(tmp_path: Path, board: str, dotprod: bool, i8mm: bool) -> None:
    cpu = read_cpu_features(copy_board(board, tmp_path))
    assert cpu.arch == "aarch64" and "Features" in cpu.source
    assert {"fp", "asimd"} <= cpu.features
    assert ("asimddp" in cpu.features, "i8mm" in cpu.features) == (dotprod, i8mm)


def test_only_what_every_core_has_counts() -> None:
    text = (
        "processor\t: 0\nFeatures\t: fp asimd asimddp i8mm\n\n"
        "processor\t: 1\nFeatures\t: fp asimd\n"
    )
    assert parse_cpuinfo(text) == ("aarch64", frozenset({"fp", "asimd"}))


def test_x86_flags() -> None:
    arch, features = parse_cpuinfo(X86_CPUINFO)
    assert arch == "x86_64" and {"avx2", "fma", "f16c"} <= features


def test_under_qemu_user_the_auxv_describes_the_emulated_cpu(tmp_path: Path) -> None:
    root = build_tree(
        tmp_path, {"proc/cpuinfo": X86_CPUINFO, "proc/self/auxv": auxv((AT_HWCAP, A76_HWCAP))}
    )
    cpu = read_cpu_features(root, machine="aarch64")
    assert cpu.arch == "aarch64" and "auxv" in cpu.source and "x86_64" in cpu.source
    assert {"asimddp", "fphp", "asimdhp", "atomics", "lrcpc"} <= cpu.features
    assert "i8mm" not in cpu.features and "avx2" not in cpu.features


def test_hwcap2_names_i8mm_and_bf16() -> None:
    names = hwcap_features(0, 1 << HWCAP2_NAMES.index("i8mm") | 1 << HWCAP2_NAMES.index("bf16"))
    assert names == {"i8mm", "bf16"}
    assert hwcap_features(1 << 20, 0) == {HWCAP_NAMES[20]} == {"asimddp"}


def test_auxv_stops_at_null_and_ignores_a_partial_pair() -> None:
    data = auxv((AT_HWCAP, 3), (AT_HWCAP2, 1)) + b"\x10\x00"
    assert parse_auxv(data) == {AT_HWCAP: 3, AT_HWCAP2: 1}
    assert parse_auxv(struct.pack("<QQ", 0, 0) + struct.pack("<QQ", AT_HWCAP, 7)) == {}
    assert parse_auxv(b"") == {}


def test_unreadable_files_give_no_features_and_say_why(tmp_path: Path) -> None:
    cpu = read_cpu_features(tmp_path, machine="aarch64")
    assert cpu.features == frozenset() and cpu.source.startswith("unreadable:")
    assert "auxv" in cpu.source
    cpu = read_cpu_features(tmp_path, machine="x86_64")
    assert cpu.features == frozenset() and "cpuinfo" in cpu.source


def test_a_fixture_root_takes_its_architecture_from_its_cpuinfo(tmp_path: Path) -> None:
    root = build_tree(tmp_path, {"proc/cpuinfo": X86_CPUINFO})
    assert read_cpu_features(root).arch == "x86_64"


def test_missing_names_the_absent_features_in_order() -> None:
    cpu = parse_cpuinfo("Features\t: fp asimd\n")
    from slmguard.host.cpufeatures import CpuFeatures

    facts = CpuFeatures("aarch64", cpu[1], "test")
    assert facts.missing(("fp", "i8mm", "asimd", "bf16")) == ("i8mm", "bf16")


def test_debian_architectures_are_the_kernel_machines() -> None:
    assert machine_name("arm64") == "aarch64" and machine_name("amd64") == "x86_64"
    assert machine_name("riscv64") == "riscv64"


def test_this_host() -> None:
    cpu = read_cpu_features()
    assert cpu.arch == machine_name(os.uname().machine)
    assert cpu.features, cpu.source  # a real kernel lists features
