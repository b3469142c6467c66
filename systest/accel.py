"""Which qemu accelerator this host can use, and whether qemu can run at all.

Owns the decision between KVM and software emulation (TCG). ``/dev/kvm`` is
not enough: on these machines it is backed by ``kvm_pvm``, a nested "PVM"
hypervisor that cannot run a stock Debian kernel. KVM is chosen only where
the real ``kvm_intel`` or ``kvm_amd`` module is loaded, ``kvm_pvm`` is not,
and ``/dev/kvm`` is writable. Readers take a ``root`` so tests can point them
at a fixture tree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Accel:
    name: str  # "kvm" or "tcg"
    qemu_args: tuple[str, ...]
    reason: str


TCG = Accel(
    "tcg",
    # thread=multi: one host thread per vCPU. Plain "max": removing CPU flags
    # from it broke the guest in the recipe's runs; qemu 7.2's max has the
    # AVX2/FMA/F16C the engine build needs.
    ("-accel", "tcg,thread=multi", "-cpu", "max"),
    "software emulation",
)
KVM = Accel("kvm", ("-accel", "kvm", "-cpu", "host"), "hardware virtualization")


def choose_accel(root: Path = Path("/"), force: str = "auto") -> Accel:
    """KVM where real kvm_intel/kvm_amd is loaded (and not kvm_pvm), else TCG."""
    if force == "tcg":
        return TCG
    modules = root / "sys" / "module"
    real = (modules / "kvm_intel").is_dir() or (modules / "kvm_amd").is_dir()
    pvm = (modules / "kvm_pvm").is_dir()
    dev = root / "dev" / "kvm"
    writable = dev.exists() and os.access(dev, os.R_OK | os.W_OK)
    if force == "kvm" or (real and not pvm and writable):
        return KVM
    if pvm:
        why = "kvm_pvm (nested PVM) cannot run a stock kernel"
    elif not real:
        why = "no kvm_intel/kvm_amd module loaded"
    else:
        why = "/dev/kvm is not writable"
    return Accel(TCG.name, TCG.qemu_args, f"software emulation: {why}")
