"""System test: the rendered deployment under a real systemd and cgroup v2, in a VM.

Owns building (or reusing from a cache) a Debian guest image with systemd,
Python and slmguard installed from wheels built on the host, booting it under
qemu, running ``guest/scenario.py`` inside it and collecting its results.
Nothing here is imported by the ``slmguard`` package; run it as
``python -m systest`` from the repository root (see ``systest/README.md``).

Modules:
    cachekey  pure: the image cache key from the recipe, suite, packages, wheels
    report    pure: step results, JSON-lines parsing, the report table, exit code
    accel     which qemu accelerator this host can use (KVM or software emulation)
    hostdeps  host packages from Debian's archive (qemu, mmdebstrap, e2fsprogs)
    wheels    the project's and its dependencies' wheels, built on the host
    base      the guest's Debian base: bootstrap, configuration, initramfs
    image     the full guest image: the base plus the venv, the model, ext4
    vm        booting the guest with qemu and collecting its results
"""
