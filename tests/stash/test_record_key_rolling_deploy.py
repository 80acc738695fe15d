"""A rolling deploy of a key type that gains a defaulted field, against a model: the old
release (``KeyV1``, name only) and the new one (``KeyV2``, name and ``region`` defaulting
to ``""``) write, delete and look up keys of one collection through every key path
(``upsert_key``, ``upsert``, ``insert_without_overwrite``, a ``TypedCollection.table``,
``Stash.with_transaction``'s table, ``peek_key_one`` of the handle and of a transaction),
and the collection always holds exactly the model's ``{(name, region): value}``, one
entry per key.  On the release that encoded keys with every field, the new release's
first write of an old key added a second entry."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from stash import Stash, TypedCollection
from tests.stash.test_record_key_legacy_texts import OldKeyCodec


@dataclass(frozen=True)
class KeyV1:
    __stash_name__ = "deploy.Key"
    name: str


@dataclass(frozen=True)
class KeyV2:
    __stash_name__ = "deploy.Key"
    name: str
    region: str = ""


names = st.sampled_from(["a", "b", "c"])
regions = st.sampled_from(["", "eu"])
values = st.integers(0, 9)


class RollingDeploy(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.s = Stash.open("memory://")
        self.v1 = TypedCollection("c", key=KeyV1, value="int")
        self.v2 = TypedCollection("c", key=KeyV2, value="int")
        self.model: dict[tuple[str, str], int] = {}

    def teardown(self) -> None:
        self.s.close()

    def _key(self, release: int, name: str, region: str) -> KeyV1 | KeyV2:
        return KeyV1(name) if release == 1 else KeyV2(name, region)

    @rule(release=st.sampled_from([1, 2]), name=names, region=regions, value=values)
    def upsert_key(self, release: int, name: str, region: str, value: int) -> None:
        region = "" if release == 1 else region
        tc = self.v1 if release == 1 else self.v2
        tc.upsert_key(self.s, self._key(release, name, region), value)
        self.model[(name, region)] = value

    @rule(name=names, region=regions, value=values)
    def upsert_many(self, name: str, region: str, value: int) -> None:
        self.v2.upsert(self.s, [(KeyV2(name, region), value), (KeyV2(name), value + 1)])
        self.model[(name, region)] = value
        self.model[(name, "")] = value + 1

    @rule(release=st.sampled_from([1, 2]), name=names, value=values)
    def insert_without_overwrite(self, release: int, name: str, value: int) -> None:
        tc = self.v1 if release == 1 else self.v2
        got = tc.insert_without_overwrite(self.s, self._key(release, name, ""), value)
        want = self.model.setdefault((name, ""), value)
        assert got == want

    @rule(release=st.sampled_from([1, 2]), name=names, value=values)
    def table_set(self, release: int, name: str, value: int) -> None:
        tc = self.v1 if release == 1 else self.v2
        t = tc.table(self.s)
        t.set(self._key(release, name, ""), value)
        t.commit()
        self.model[(name, "")] = value

    @rule(name=names, region=regions, value=values)
    def transaction_table_set(self, name: str, region: str, value: int) -> None:
        self.s.with_transaction(lambda tx: tx.table(self.v2).set(KeyV2(name, region), value))
        self.model[(name, region)] = value

    @rule(release=st.sampled_from([1, 2]), name=names)
    def table_delete(self, release: int, name: str) -> None:
        tc = self.v1 if release == 1 else self.v2
        t = tc.table(self.s)
        t.set(self._key(release, name, ""), None)
        t.commit()
        self.model.pop((name, ""), None)

    @rule(release=st.sampled_from([1, 2]), name=names, region=regions)
    def lookups(self, release: int, name: str, region: str) -> None:
        region = "" if release == 1 else region
        tc = self.v1 if release == 1 else self.v2
        key = self._key(release, name, region)
        want = self.model.get((name, region))
        assert tc.peek_key_one(self.s, key) == want
        assert self.s.with_transaction(lambda tx: tx.peek_key_one(tc, key)) == want

    @invariant()
    def one_entry_per_key(self) -> None:
        c = self.v2.get(self.s)
        if self.s.upper(c).as_option() == 0:
            return
        assert self.v2.peek_one(self.s) == {KeyV2(n, r): v for (n, r), v in self.model.items()}
        assert all(d == 1 for _, _, d in self.s.peek(c))


RollingDeploy.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_rolling_deploy_of_a_key_type = RollingDeploy.TestCase


class UpgradeFromFullKeys(RuleBasedStateMachine):
    """An upgrade of a key type that ALREADY had a defaulted field (``KeyV2``): before
    it, release 0 writes every key with every field (the rule of every release before
    keys omitted their defaults: ``OldKeyCodec``) through its key paths; after it, the
    release of today, with the type unchanged and no migration, finds, replaces and
    deletes those keys through every key path, and the collection always holds exactly
    the model, one entry per key.  Before every key path looked a key up under both of
    its texts, the first write of an old key added a second entry and a delete retracted
    a text that was not stored."""

    def __init__(self) -> None:
        super().__init__()
        self.s = Stash.open("memory://")
        self.v0 = TypedCollection("c", key=OldKeyCodec(KeyV2), value="int")
        self.v2 = TypedCollection("c", key=KeyV2, value="int")
        self.model: dict[tuple[str, str], int] = {}
        self.upgraded = False

    def teardown(self) -> None:
        self.s.close()

    @precondition(lambda self: not self.upgraded)
    @rule(name=names, region=regions, value=values)
    def old_upsert_key(self, name: str, region: str, value: int) -> None:
        self.v0.upsert_key(self.s, KeyV2(name, region), value)
        self.model[(name, region)] = value

    @precondition(lambda self: not self.upgraded)
    @rule(name=names, region=regions)
    def old_table_delete(self, name: str, region: str) -> None:
        t = self.v0.table(self.s)
        t.set(KeyV2(name, region), None)
        t.commit()
        self.model.pop((name, region), None)

    @precondition(lambda self: not self.upgraded)
    @rule()
    def upgrade(self) -> None:
        self.upgraded = True

    @precondition(lambda self: self.upgraded)
    @rule(name=names, region=regions, value=values)
    def upsert_key(self, name: str, region: str, value: int) -> None:
        self.v2.upsert_key(self.s, KeyV2(name, region), value)
        self.model[(name, region)] = value

    @precondition(lambda self: self.upgraded)
    @rule(name=names, region=regions, value=values)
    def upsert_many(self, name: str, region: str, value: int) -> None:
        self.v2.upsert(self.s, [(KeyV2(name, region), value), (KeyV2(name), value + 1)])
        self.model[(name, region)] = value
        self.model[(name, "")] = value + 1

    @precondition(lambda self: self.upgraded)
    @rule(name=names, region=regions, value=values)
    def insert_without_overwrite(self, name: str, region: str, value: int) -> None:
        got = self.v2.insert_without_overwrite(self.s, KeyV2(name, region), value)
        assert got == self.model.setdefault((name, region), value)

    @precondition(lambda self: self.upgraded)
    @rule(name=names, region=regions, value=st.none() | values)
    def table_set(self, name: str, region: str, value: int | None) -> None:
        t = self.v2.table(self.s)
        t.set(KeyV2(name, region), value)
        t.commit()
        if value is None:
            self.model.pop((name, region), None)
        else:
            self.model[(name, region)] = value

    @precondition(lambda self: self.upgraded)
    @rule(name=names, region=regions, value=st.none() | values)
    def transaction_table_set(self, name: str, region: str, value: int | None) -> None:
        self.s.with_transaction(lambda tx: tx.table(self.v2).set(KeyV2(name, region), value))
        if value is None:
            self.model.pop((name, region), None)
        else:
            self.model[(name, region)] = value

    @precondition(lambda self: self.upgraded)
    @rule(name=names)
    def table_delete_rows(self, name: str) -> None:
        t = self.v2.table(self.s, uniqueness_violation=lambda a, b: False)
        t.delete(lambda k, v: k.name == name)
        t.commit()
        self.model = {k: v for k, v in self.model.items() if k[0] != name}

    @rule(name=names, region=regions)
    def lookups(self, name: str, region: str) -> None:
        tc = self.v2 if self.upgraded else self.v0
        want = self.model.get((name, region))
        assert tc.peek_key_one(self.s, KeyV2(name, region)) == want
        got = self.s.with_transaction(lambda tx: tx.peek_key_one(tc, KeyV2(name, region)))
        assert got == want

    @invariant()
    def one_live_entry_per_key(self) -> None:
        c = self.v2.get(self.s)
        if self.s.upper(c).as_option() == 0:
            return
        assert self.v2.peek_one(self.s) == {KeyV2(n, r): v for (n, r), v in self.model.items()}
        # The raw consolidated rows: one per key, none with a multiplicity other than 1.
        rows = self.s._peek_raw(c)
        assert all(d == 1 for _, _, d in rows) and len(rows) == len(self.model)


UpgradeFromFullKeys.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=14,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_upgrade_of_a_key_type_with_defaulted_fields = UpgradeFromFullKeys.TestCase
