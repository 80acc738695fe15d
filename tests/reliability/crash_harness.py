"""The scaffolding the crash campaigns share (``test_crash_stash.py``,
``test_crash_persist.py``, ``test_crash_txn.py``, ``test_crash_rows.py``): start a child
process, let it run for a random moment, SIGKILL it, read back what it acknowledged; and
the checks every persist campaign makes after a kill.

The child protocol: a child script takes its campaign's arguments, then ``ACK_PATH
RUN``; it prints ``ready`` once its stores are open, then loops, appending one line of
whitespace-separated fields to ACK_PATH (written and fsynced) after each acknowledged
change, until it is killed. A child that dies by itself fails the campaign with its
stderr.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from persist import collect_garbage, fsck
from tests.reliability.campaign import LONG, record

#: Seconds the checker's clock runs ahead of the wall clock: past the children's
#: 2-second writer and reader leases, so that a killed child's leases have run out for
#: GC without the checker sleeping.
PAST_LEASES_SECONDS = 10.0


def checker_clock() -> float:
    """The checker's clock (seconds): the wall clock plus :data:`PAST_LEASES_SECONDS`."""
    return time.time() + PAST_LEASES_SECONDS


def kill_runs(
    child: Path,
    args: Sequence[str],
    tmp_path: Path,
    kills: int,
    *,
    seed: int,
    window: tuple[float, float],
    label: str,
) -> Iterator[tuple[int, list[list[str]]]]:
    """For each run ``0..kills-1``: start ``python CHILD *args ACK run`` (ACK being
    ``tmp_path / f"ack{run}"``), wait for its ``ready``, let it run a moment drawn
    uniformly from ``window`` (seconds; a ``random.Random(seed)``, so a campaign's
    moments repeat), SIGKILL it and yield ``(run, acknowledgements)``, each one line's
    fields.

    Raises:
        AssertionError: the child did not say ``ready``, or died before the kill (with
            its stderr).
    """
    rng = random.Random(seed)
    for run in range(kills):
        ack = tmp_path / f"ack{run}"
        child_proc = subprocess.Popen(
            [sys.executable, str(child), *args, str(ack), str(run)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert child_proc.stdout is not None and child_proc.stderr is not None
        line = child_proc.stdout.readline()
        assert line.strip() == "ready", child_proc.stderr.read()
        time.sleep(rng.uniform(*window))
        child_proc.send_signal(signal.SIGKILL)
        child_proc.wait(timeout=30)
        assert child_proc.returncode == -signal.SIGKILL, (
            f"{label} run {run}: child died by itself: " + child_proc.stderr.read()
        )
        yield run, read_acks(ack)


def read_acks(path: Path) -> list[list[str]]:
    """The acknowledgements a child wrote to ``path``, each line's fields (none when
    the child was killed before its first)."""
    return [ln.split() for ln in path.read_text().splitlines()] if path.exists() else []


def batch_counts(snap: Any, payload: Callable[[int, int, int], str]) -> Counter[tuple[int, int]]:
    """Rows per batch ``(run, i)`` of a snapshot (a ``pyarrow.Table`` with ``run``,
    ``i``, ``j``, ``payload`` and ``_diff`` columns) of rows keyed ``(run, i, j)``.

    Raises:
        AssertionError: a row with ``_diff`` other than 1 (a duplicate), or a payload
            other than ``payload(run, i, j)``.
    """
    assert set(snap.column("_diff").to_pylist()) <= {1}, "duplicated rows"
    rows: Counter[tuple[int, int]] = Counter()
    for rr, i, j, p in zip(
        snap.column("run").to_pylist(),
        snap.column("i").to_pylist(),
        snap.column("j").to_pylist(),
        snap.column("payload").to_pylist(),
        strict=True,
    ):
        assert p == payload(rr, i, j)
        rows[(rr, i)] += 1
    return rows


def gc_then_check(client: Any, shard: str, run: int) -> tuple[int, int]:
    """Run GC (grace 0) on ``shard`` and check what it left: the Spine trace validates,
    the blob store holds exactly the parts the state references (no orphan, none
    missing), and ``persist.fsck`` finds no damage. Returns ``(blobs GC deleted,
    parts referenced)``.

    Raises:
        AssertionError: any of those checks failed (naming ``run``).
    """
    report = collect_garbage(client, shard, grace_seconds=0)
    st = client.inspect(shard)
    st.trace.validate()
    listed = {k for k, _ in client.raw_blob.list_keys(st.shard_id + "/")}
    referenced = st.referenced_blob_keys()
    assert listed == referenced, (
        f"run {run}: GC left unreferenced parts {sorted(listed - referenced)[:5]}, "
        f"missing referenced {sorted(referenced - listed)[:5]}"
    )
    damage = fsck(client, shard)
    assert damage.ok, f"run {run}: fsck: {damage.damage()}"
    return len(report.deleted_abandoned) + len(report.deleted_retired), len(referenced)


#: pytest's time limit of one crash campaign (seconds): a long campaign's hundreds of
#: kills (a child's start, a kill, the checks, GC) outlast the suite's default limit on
#: a busy machine.
CAMPAIGN_LIMIT = 3600 if LONG else 600


def record_kills(
    campaign: str, kills: int, acknowledged: int, durable_unacknowledged: int, **more: Any
) -> None:
    """Record (:func:`tests.reliability.campaign.record`) a crash campaign whose checks
    all passed: ``kills`` runs of one fault each, ``acknowledged`` changes, none lost,
    duplicated, partial or unclear, ``durable_unacknowledged`` in-flight changes found
    durable, and the campaign's own figures ``more``."""
    record(
        campaign,
        runs=kills,
        faults=kills,
        acknowledged=acknowledged,
        lost=0,
        duplicated=0,
        partial=0,
        unclear=0,
        durable_unacknowledged=durable_unacknowledged,
        **more,
    )
