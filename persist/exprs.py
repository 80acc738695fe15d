"""The tree of an Arrow compute expression, and whether statistics may prune with it.

pyarrow gives no way to walk a ``pyarrow.compute.Expression``; it does serialize one
(what pickling it does): an Arrow IPC file of one row whose columns are the
expression's literals and function options, and whose schema metadata lists the tree in
pre-order, as ordered, repeating ``(key, value)`` pairs: ``call``/``end`` (a function
call's name, around its arguments and then an ``options`` column index), ``field_ref``
(a name), ``nested_field_ref`` (the count of the names that follow) and ``literal`` (a
column index). :func:`expression_tree` reads that form back into :class:`Call`,
:class:`Field` and :class:`Literal` nodes; the ordered pairs are read from the IPC
schema message itself (a FlatBuffers table), since pyarrow hands schema metadata back
only as a dict, which loses repeated keys.

:func:`prunable` says whether pruning parts by their statistics with a filter agrees
with evaluating it: Arrow evaluates ``is_in``/``index_in`` by casting the value set to
the column's type (a datetime to a date drops its time of day), while simplifying the
filter under a part's ``min <= c <= max`` compares the value set with the bounds in
their common type, or fails when there is none (a bool column and ints). Statistics
then only prune with filters whose value sets hold values of their column's type.
Nor do they prune with a filter calling a function that may fail on some value (a
checked cast or arithmetic): the part skipped may hold the row it fails on, where
evaluating the filter on every row raises.

Sources: Arrow C++ ``compute/expression.cc`` (``Serialize``/``Deserialize``, and
``SimplifyIsIn`` for the disagreement), the Arrow IPC ``Message.fbs``/``Schema.fbs``
layouts and the FlatBuffers binary format (tables, vtables, vectors, strings).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["Call", "Field", "Literal", "Node", "expression_tree", "prunable"]


@dataclass(frozen=True)
class Field:
    """A field reference: its name path (one name, or several for a nested field)."""

    path: tuple[str, ...]


@dataclass(frozen=True)
class Literal:
    """A literal scalar."""

    value: pa.Scalar


@dataclass(frozen=True)
class Call:
    """A function call: its Arrow function name, arguments and options (the options'
    struct scalar as Arrow serializes them, with a ``_type_name`` field; ``None``
    without options)."""

    name: str
    args: tuple[Node, ...]
    options: pa.StructScalar | None


Node = Field | Literal | Call


# ------------------------------------------------------------- FlatBuffers reading


def _u32(buf: bytes, pos: int) -> int:
    return int(struct.unpack_from("<I", buf, pos)[0])


def _table_field(buf: bytes, table: int, index: int) -> int | None:
    """The position of field ``index`` of the FlatBuffers table at ``table`` (``None``
    when absent)."""
    vtable = table - int(struct.unpack_from("<i", buf, table)[0])
    vsize = int(struct.unpack_from("<H", buf, vtable)[0])
    at = 4 + 2 * index
    if at + 2 > vsize:
        return None
    off = int(struct.unpack_from("<H", buf, vtable + at)[0])
    return None if off == 0 else table + off


def _deref(buf: bytes, pos: int) -> int:
    return pos + _u32(buf, pos)


def _string(buf: bytes, pos: int) -> str:
    n = _u32(buf, pos)
    return buf[pos + 4 : pos + 4 + n].decode("utf-8")


def _ipc_schema_metadata(data: bytes) -> list[tuple[str, str]]:
    """The ordered custom metadata of the schema of an Arrow IPC file ``data``.

    Raises:
        ValueError: ``data`` is not such a file (or not in a layout read here).
    """
    try:
        if data[:6] != b"ARROW1":
            raise ValueError("not an Arrow IPC file")
        pos = 8
        if _u32(data, pos) == 0xFFFFFFFF:  # continuation marker, then the length
            pos += 4
        length = _u32(data, pos)
        fb = data[pos + 4 : pos + 4 + length]
        message = _deref(fb, 0)
        header = _table_field(fb, message, 2)  # Message.header
        if header is None:
            raise ValueError("an IPC message without a header")
        schema = _deref(fb, header)
        meta = _table_field(fb, schema, 2)  # Schema.custom_metadata
        if meta is None:
            return []
        vec = _deref(fb, meta)
        out = []
        for i in range(_u32(fb, vec)):
            kv = _deref(fb, vec + 4 + 4 * i)
            k, v = _table_field(fb, kv, 0), _table_field(fb, kv, 1)
            if k is None or v is None:
                raise ValueError("a metadata entry without a key or value")
            out.append((_string(fb, _deref(fb, k)), _string(fb, _deref(fb, v))))
        return out
    except (struct.error, UnicodeDecodeError, IndexError) as e:
        raise ValueError(f"not a readable Arrow IPC schema: {e}") from None


# ------------------------------------------------------------------ the tree


def expression_tree(expr: pc.Expression) -> Node:
    """The tree of ``expr`` (see the module docstring).

    Raises:
        ValueError: the serialized form is not one this reads (another pyarrow's, or an
            expression Arrow cannot serialize).
    """
    try:
        reduced = expr.__reduce__()
        data = bytes(reduced[1][0])
        columns = pa.ipc.open_file(pa.BufferReader(data)).read_all().columns
    except (pa.ArrowException, TypeError, IndexError) as e:
        raise ValueError(f"expression {expr} is not serializable: {e}") from None
    pairs = _ipc_schema_metadata(data)

    def scalar(i: str) -> pa.Scalar:
        return columns[int(i)][0]

    def parse(i: int) -> tuple[Node, int]:
        key, value = pairs[i]
        if key == "literal":
            return Literal(scalar(value)), i + 1
        if key == "field_ref":
            return Field((value,)), i + 1
        if key == "nested_field_ref":
            n = int(value)
            names = [v for k, v in pairs[i + 1 : i + 1 + n] if k == "field_ref"]
            if len(names) != n:
                raise ValueError("a nested field reference of other references")
            return Field(tuple(names)), i + 1 + n
        if key == "call":
            args: list[Node] = []
            options = None
            i += 1
            while pairs[i][0] != "end":
                if pairs[i][0] == "options":
                    options = scalar(pairs[i][1])
                    i += 1
                else:
                    arg, i = parse(i)
                    args.append(arg)
            if pairs[i][1] != value:
                raise ValueError(f"call {value!r} ends as {pairs[i][1]!r}")
            return Call(value, tuple(args), options), i + 1
        raise ValueError(f"unknown expression element {key!r}")

    try:
        node, end = parse(0)
    except (IndexError, KeyError, TypeError) as e:
        raise ValueError(f"expression {expr} does not parse: {e!r}") from None
    if end != len(pairs):
        raise ValueError(f"expression {expr} has trailing elements")
    return node


_SET_LOOKUPS = frozenset({"is_in", "index_in"})


def _kind(t: pa.DataType) -> str | None:
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "str"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return "bytes"
    return None


def _holds_exactly(values: pa.Array | None, t: pa.DataType) -> bool:
    """Whether ``values`` are of type ``t``, or of a type of the same kind (integers,
    strings, binary) whose values ``t`` holds exactly (so that casting them to ``t``, as
    ``is_in`` does, and comparing them with ``t``'s values in their common type, as a
    simplification does, agree)."""
    if values is None:
        return False
    if values.type == t:
        return True
    kind = _kind(t)
    if kind is None or _kind(values.type) != kind:
        return False
    try:
        return bool(values.cast(t, safe=True).cast(values.type).equals(values))
    except pa.ArrowException:
        return False


def _value_sets_typed(node: Node, schema: pa.Schema) -> bool:
    if not isinstance(node, Call):
        return True
    if node.name in _SET_LOOKUPS:
        arg = node.args[0] if node.args else None
        if not isinstance(arg, Field) or len(arg.path) != 1 or node.options is None:
            return False
        i = schema.get_field_index(arg.path[0])
        value_set = node.options.get("value_set")
        if i < 0 or value_set is None or not pa.types.is_list(value_set.type):
            return False
        if not _holds_exactly(value_set.values, schema.field(i).type):
            return False
    return all(_value_sets_typed(a, schema) for a in node.args)


#: The functions a filter that statistics prune with may call: none of them fails on
#: any value (comparisons, boolean logic, null and NaN tests, set lookups).  A call
#: that can (a checked cast or arithmetic overflowing, a division by zero, invalid
#: UTF-8) would raise on a row of a part the statistics skip, where the unpruned read
#: raises.
_TOTAL_CALLS = frozenset(
    {
        "equal",
        "not_equal",
        "less",
        "less_equal",
        "greater",
        "greater_equal",
        "and",
        "and_",
        "and_kleene",
        "and_not",
        "and_not_kleene",
        "or",
        "or_",
        "or_kleene",
        "xor",
        "invert",
        "is_null",
        "is_valid",
        "is_nan",
        "is_finite",
        "is_inf",
        "true_unless_null",
        "is_in",
    }
)


def _total(node: Node) -> bool:
    """Whether every call in ``node`` is one of :data:`_TOTAL_CALLS`."""
    if not isinstance(node, Call):
        return True
    return node.name in _TOTAL_CALLS and all(_total(a) for a in node.args)


def prunable(filter: pc.Expression, schema: pa.Schema) -> bool:
    """Whether statistics may prune parts with ``filter`` (over ``schema``'s columns):
    it calls only functions that fail on no value (:data:`_TOTAL_CALLS`: comparisons,
    boolean logic, null and NaN tests, ``is_in``), so that skipping a part never hides
    an error evaluating it there would raise; and every ``is_in`` in it looks up a
    plain column of ``schema`` in a value set of that column's type (or of integers,
    strings or binary values the column's integer, string or binary type holds
    exactly). ``False`` too when the expression cannot be read (pruning is then
    skipped, never wrong)."""
    try:
        tree = expression_tree(filter)
    except ValueError:
        return False
    return _total(tree) and _value_sets_typed(tree, schema)
