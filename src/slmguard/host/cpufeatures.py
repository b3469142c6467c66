"""The CPU's instruction set: the features every core has, which an engine build may need.

Owns ``/proc/cpuinfo`` (``flags:`` on x86, ``Features:`` on arm64; one line per core,
and only features every core lists count, since the engine may run on any of them) and,
on arm64 when ``/proc/cpuinfo`` does not describe this process's CPU, the capability
words of ``/proc/self/auxv`` (``AT_HWCAP``, ``AT_HWCAP2``), named as ``/proc/cpuinfo``
names them (``asimddp``, ``i8mm``...). Both, because under qemu-user (an arm64 root on
an x86 host, ``make dist-test``) ``/proc/cpuinfo`` is the host's x86 file while
``uname`` and the auxiliary vector are the emulated CPU's. Not the cores themselves
(online, big, usable, busy: :mod:`slmguard.host.cpu`). Pure parsers plus the reader.

Example::

    "asimddp" in read_cpu_features().features  # the arm64 dot product (RK3588, Pi 5, Orin)
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

from slmguard.errors import HostReadError
from slmguard.host import files
from slmguard.host.files import ROOT

X86_64 = "x86_64"
AARCH64 = "aarch64"
_MACHINES = {"amd64": X86_64, "x86_64": X86_64, "arm64": AARCH64, "aarch64": AARCH64}
# The cpuinfo key listing one core's features, per architecture.
_CPUINFO_KEY = {X86_64: "flags", AARCH64: "Features"}

AT_HWCAP = 16
AT_HWCAP2 = 26
_AUXV_MAX_BYTES = 64 * 1024  # a real auxv is a few hundred bytes

# Linux arch/arm64/include/uapi/asm/hwcap.h: bit -> the name /proc/cpuinfo prints.
HWCAP_NAMES = (
    "fp", "asimd", "evtstrm", "aes", "pmull", "sha1", "sha2", "crc32",
    "atomics", "fphp", "asimdhp", "cpuid", "asimdrdm", "jscvt", "fcma", "lrcpc",
    "dcpop", "sha3", "sm3", "sm4", "asimddp", "sha512", "sve", "asimdfhm",
    "dit", "uscat", "ilrcpc", "flagm", "ssbs", "sb", "paca", "pacg",
)  # fmt: skip
HWCAP2_NAMES = (
    "dcpodp", "sve2", "sveaes", "svepmull", "svebitperm", "svesha3", "svesm4", "flagm2",
    "frint", "svei8mm", "svef32mm", "svef64mm", "svebf16", "i8mm", "bf16", "dgh",
    "rng", "bti", "mte", "ecv", "afp", "rpres", "mte3", "sme",
)  # fmt: skip


@dataclass(frozen=True)
class CpuFeatures:
    """The architecture (``uname -m`` spelling) and the features every core has."""

    arch: str
    features: frozenset[str]
    source: str  # where they were read, for "why this build"

    def missing(self, needed: tuple[str, ...] | list[str]) -> tuple[str, ...]:
        """The features of ``needed`` this CPU lacks, in their order."""
        return tuple(f for f in needed if f not in self.features)


def machine_name(name: str) -> str:
    """``uname -m`` or a Debian architecture as the kernel spells it (arm64 -> aarch64)."""
    return _MACHINES.get(name, name)


def parse_cpuinfo(text: str) -> tuple[str | None, frozenset[str]]:
    """The architecture a ``/proc/cpuinfo`` text describes and its common features (pure).

    ``(None, {})`` when it has neither ``flags`` nor ``Features`` lines.
    """
    for arch, key in _CPUINFO_KEY.items():
        common: set[str] | None = None
        for line in text.splitlines():
            name, sep, value = line.partition(":")
            if sep and name.strip() == key:
                words = set(value.split())
                common = words if common is None else common & words
        if common is not None:
            return arch, frozenset(common)
    return None, frozenset()


def parse_auxv(data: bytes) -> dict[int, int]:
    """The (type, value) pairs of a 64-bit little-endian auxiliary vector (pure).

    Stops at ``AT_NULL`` or at the end of the data; a trailing partial pair is ignored.
    """
    out: dict[int, int] = {}
    for offset in range(0, len(data) - 15, 16):
        key, value = struct.unpack_from("<QQ", data, offset)
        if key == 0:
            break
        out[key] = value
    return out


def hwcap_features(hwcap: int, hwcap2: int) -> frozenset[str]:
    """The arm64 feature names of the two capability words (pure)."""
    names = {n for bit, n in enumerate(HWCAP_NAMES) if hwcap >> bit & 1}
    names |= {n for bit, n in enumerate(HWCAP2_NAMES) if hwcap2 >> bit & 1}
    return frozenset(names)


def _read_auxv(root: Path) -> bytes:
    return files.read(root / "proc/self/auxv", _AUXV_MAX_BYTES).require_bytes()


def read_cpu_features(root: Path = ROOT, machine: str | None = None) -> CpuFeatures:
    """The features every core of this CPU has (see the module docstring for the sources).

    ``machine`` is the architecture the engine runs as; default: ``uname -m`` for
    the live root, the one ``/proc/cpuinfo`` describes under any other root.
    The architecture is this process's (``uname -m``) for the live root, the one
    ``/proc/cpuinfo`` describes for a fixture tree. Never raises: what cannot be read
    gives no features and says so in ``source``.
    """
    if machine is None and root == ROOT:
        machine = os.uname().machine
    try:
        described, features = parse_cpuinfo(files.read(root / "proc/cpuinfo").require())
        unread = ""
    except HostReadError as err:
        described, features, unread = None, frozenset(), f"{err.path}: {err.problem}"
    arch = machine_name(machine) if machine else (described or "unknown")
    if described == arch:
        return CpuFeatures(arch, features, f"/proc/cpuinfo {_CPUINFO_KEY[arch]} (every core)")
    if arch == AARCH64:
        try:
            auxv = parse_auxv(_read_auxv(root))
        except HostReadError as err:
            return CpuFeatures(arch, frozenset(), f"unreadable: {err.path}: {err.problem}")
        hw = hwcap_features(auxv.get(AT_HWCAP, 0), auxv.get(AT_HWCAP2, 0))
        why = (
            f"/proc/cpuinfo describes {described}" if described else "no Features in /proc/cpuinfo"
        )
        return CpuFeatures(arch, hw, f"/proc/self/auxv AT_HWCAP/AT_HWCAP2 ({why})")
    if unread:
        return CpuFeatures(arch, frozenset(), f"unreadable: {unread}")
    return CpuFeatures(arch, frozenset(), f"/proc/cpuinfo lists no {arch} features")
