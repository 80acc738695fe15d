"""Generate the 0006-layout fixture of persist shards with the code before the logs
(run with that code checked out: ``python make_consensus_collections_0006.py OUT DB BLOB``)."""

import base64
import json
import os
import sys

import pyarrow as pa
import sqlalchemy as sa

from persist import PersistClient
from stash import Stash

KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.string()), ("x", pa.float64())])


def main(out: str, db: str, blob: str) -> None:
    stash = Stash.open(f"sqlite:///{db}", fenced=False)
    client = PersistClient(stash, f"file://{blob}", compaction="off", inline_max_bytes=1 << 20)
    expected = {}

    def run(name, n, max_diffs):
        client.consensus.max_diffs = max_diffs
        w, r = client.open(name, KS, VS)
        for t in range(n):
            w.compare_and_append([(((t,), (f"é{t}\u2028", t / 10)), t, 1)], t, t + 1)
        r.downgrade_since(__import__("stash").Antichain.from_elem(max(0, n - 3)))
        w.expire()
        r.expire()

    run("few", 3, 32)
    run("past_a_rollup", 38, 32)
    run("all_rollups", 5, 0)
    client.consensus.max_diffs = 32
    client.open("empty", KS, VS)
    rows_by = {}
    for name in ["few", "past_a_rollup", "all_rollups", "empty"]:
        up = client.inspect(name).upper.as_option()
        rows = []
        if up and up > 0:
            _w, rd = client.open(name, KS, VS)
            rows = sorted(map(json.dumps, rd.snapshot(up - 1).to_pylist()))
            rd.expire()
            _w.expire()
        rows_by[name] = rows
    for name in ["few", "past_a_rollup", "all_rollups", "empty"]:  # read last: reads write nothing
        st = client.inspect(name)
        sj = st.to_json()
        expected[name] = {
            "shard_id": client.shard_id(name),
            "upper": st.upper.as_option(),
            "rows": rows_by[name],
            "state": sj if isinstance(sj, str) else json.dumps(sj, sort_keys=True),
        }
    client.close()
    stash.close()
    eng = sa.create_engine(f"sqlite:///{db}")
    tables = {}
    with eng.connect() as conn:
        rev = conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar_one()
        for t, cols in [
            ("collections", "collection_id, name, key_codec, value_codec"),
            ("data", "collection_id, key, value, time, diff"),
            ("sinces", "collection_id, since"),
            ("uppers", "collection_id, upper"),
        ]:
            tables[t] = {
                "columns": [c.strip() for c in cols.split(",")],
                "rows": [
                    list(r)
                    for r in conn.execute(sa.text(f"SELECT {cols} FROM {t} ORDER BY 1"))  # noqa: S608
                ],
            }
    eng.dispose()
    files = {}
    for root, _d, fs in os.walk(blob):
        for f in fs:
            full = os.path.join(root, f)
            files[os.path.relpath(full, blob)] = base64.b64encode(open(full, "rb").read()).decode()
    json.dump(
        {"revision": rev, "tables": tables, "expected": expected, "blob_files": files},
        open(out, "w"),
        indent=0,
        ensure_ascii=False,
        sort_keys=True,
    )
    print(rev, {t: len(v["rows"]) for t, v in tables.items()})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
