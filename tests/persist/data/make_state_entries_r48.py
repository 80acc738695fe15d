"""Generate ``state_entries_r48.json``: the log rows of persist shards written by the code
before the leaner state entries (inline parts with their ``sha256``, ``"runs": []``,
writers with ``"last_token": null``, landed records as ``{"entry", "ms", "seqno"}`` under
``landed/<digest of the token>``), and what reading them gave then.  Run with that code
checked out (commit 06a6f71): ``python make_state_entries_r48.py OUT``."""

import base64
import json
import os
import sys
import tempfile

import pyarrow as pa
import sqlalchemy as sa

from persist import PersistClient
from stash import Stash

KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.string())])


def main(out: str) -> None:
    d = tempfile.mkdtemp()
    stash = Stash.open(f"sqlite:///{d}/s.db", fenced=False)
    client = PersistClient(stash, f"file://{d}/blob", compaction="off", gc_interval_seconds=None)
    client.consensus.max_diffs = 4
    w, r = client.open("old", KS, VS)
    for t in range(11):  # past a rollup: a rollup row and diffs after it
        w.compare_and_append([(((t,), (f"v{t}",)), t, 1)], t, t + 1)
    rows = sorted(map(json.dumps, r.snapshot(10).to_pylist()))
    st = client.inspect("old")
    expected = {
        "shard_id": client.shard_id("old"),
        "upper": st.upper.as_option(),
        "rows": rows,
        "tokens": [rec.entry for rec in st.landed.values()],
        "state": json.dumps(st.to_json(), sort_keys=True),
    }
    eng = sa.create_engine(f"sqlite:///{d}/s.db")
    with eng.connect() as conn:
        rev = conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar_one()
        tables = {}
        for t, cols in [
            ("collections", "collection_id, name, key_codec, value_codec"),
            ("data", "collection_id, key, value, time, diff"),
            ("sinces", "collection_id, since"),
            ("uppers", "collection_id, upper"),
            ("logs", "name, seqno, rollup, data"),
        ]:
            tables[t] = {
                "columns": [c.strip() for c in cols.split(",")],
                "rows": [
                    list(x)
                    for x in conn.execute(sa.text(f"SELECT {cols} FROM {t} ORDER BY 1, 2"))  # noqa: S608
                ],
            }
    eng.dispose()
    w.expire()
    r.expire()
    client.close()
    stash.close()
    files = {}  # the blob store: its identity marker (every part is inline)
    for root, _d, fs in os.walk(f"{d}/blob"):
        for name in fs:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                files[os.path.relpath(full, f"{d}/blob")] = base64.b64encode(f.read()).decode()
    with open(out, "w") as f:
        json.dump(
            {"revision": rev, "tables": tables, "expected": expected, "blob_files": files},
            f,
            indent=0,
            sort_keys=True,
        )


if __name__ == "__main__":
    main(sys.argv[1])
