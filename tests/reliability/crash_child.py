"""Child process of the crash campaign: appends in a loop until it is SIGKILLed.

Usage: ``python crash_child.py STASH_URL ACK_PATH RUN``.  Every loop iteration appends one
entry ``"{RUN}-{i}"`` to two collections in one atomic ``append`` (so a half-applied
batch would show as a key in one collection only), then records the acknowledgement in
ACK_PATH (written and fsynced after the append returned).
"""

from __future__ import annotations

import os
import sys

from stash import AppendLowerMismatch, Stash


def main() -> None:
    url, ack_path, run = sys.argv[1], sys.argv[2], sys.argv[3]
    s = Stash.open(url, fenced=False)
    a = s.collection("crash_a", key="str", value="int")
    b = s.collection("crash_b", key="str", value="int")
    fd = os.open(ack_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    print("ready", flush=True)
    i = 0
    while True:
        key = f"{run}-{i}"
        ba, bb = a.make_batch(s), b.make_batch(s)
        a.append_to_batch(ba, key, i, 1)
        b.append_to_batch(bb, key, i, 1)
        try:
            s.append([ba, bb])
        except AppendLowerMismatch:
            continue
        os.write(fd, f"{key}\n".encode())
        os.fsync(fd)
        i += 1


if __name__ == "__main__":
    main()
