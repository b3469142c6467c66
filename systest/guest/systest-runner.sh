#!/bin/sh
# systest-runner: baked into the guest image, started once at boot by
# systest-runner.service. Mounts the host's share (9p, tag "systest"), runs the
# scenario found there with Debian's python3 (results as JSON lines into the
# share, echoed on the console as the fallback channel), then powers off.
share=/run/systest
prefix='SYSTEST-RESULT '
mkdir -p "$share"
if mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 systest "$share"; then
    /usr/bin/python3 "$share/scenario.py" --config "$share/config.json" \
        --out "$share/results.jsonl" --console /dev/console
    rc=$?
    echo "${prefix}{\"event\": \"runner-exit\", \"rc\": $rc}" >/dev/console
    sync
    umount "$share"
else
    echo "${prefix}{\"step\": \"guest-share\", \"status\": \"fail\", \"reason\": \"9p mount of the host share failed\"}" >/dev/console
fi
grep -qw systest.nopoweroff /proc/cmdline || systemctl poweroff --no-block
