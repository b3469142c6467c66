"""Host readers: the only code reading kernel and process files, as pure parsers plus thin readers.

Every reader takes ``root`` (default ``/``), opens each file through
:func:`slmguard.host.files.read` and translates OS errors into
:class:`slmguard.errors.HostReadError`; parsers return frozen snapshots. Nothing here
writes, but :func:`slmguard.host.process.set_oom_score_adj` (this process's own).

The map, by subject (each module's docstring says what it owns and must not touch):

  reading     files (the one small-file read), kmsg (``/dev/kmsg`` records, OOM kills),
              filedigest (one large file hashed, streamed: ``doctor --verify-model``)
  system      procfs (meminfo, swaps, sysctl, cmdline, device tree, uptime), psi
  one process process (all of ``/proc/<pid>``: status, maps, limits, oom_score_adj,
              fds and their DMA-BUFs, threads, kernel stack)
  memory      cgroup (v1/v2 behind one facade), headroom (pure: limit, how full, poll
              interval), footprint (a process's RssAnon + RssShmem + VmSwap and its io
              write counters), zram, fstab, dmabuf (the system-wide total), devmem
              (device memory no cgroup sees: NvMap, DRM clients)
  CPU         cpu (the cores: online, big, usable by this process, busy time, clocks and
              governor), cpufeatures (the instruction set, for the engine build)
  board state thermal (zones, trip points, cooling, which cores are throttled, the
              zones to watch), devfreq (every devfreq device: the DDR controller, NPU,
              GPU), accel (NPU/GPU load; clocks through devfreq), nvpmodel (the Jetson
              power mode), pithrottle (the Pi firmware's throttle flags), boardstate
              (all of them and the CPU clocks, once: what tuning judges, bench records)
  devices     devices (nodes a service must be allowed), gpu (GPU nodes, permissions,
              driver and version, Vulkan ICDs)
  boot        kernelargs (pure: the command line as text), bootfiles, systemd
  storage     storage (the state directory's mount and options, journald's settings)
  the audit   snapshot (everything the doctor reads, once)
"""
