"""The few statements every request runs (a future's insert and finish, its usage and step
metrics, a sample's completion), run on the connection's DBAPI cursor. Each is a Core statement
compiled once per dialect: its SQL and the conversion of each value (JSON, datetimes, binary) are
SQLAlchemy's own, what is left out is the work around them on every call (the statement cache's
lookup, the parameters' and the result's objects: what that saves, docs/benchmarks.md#request_costs).
The transaction stays the caller's `engine.begin()`, and `before_cursor_execute` listeners still
see every statement.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable

from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql import ClauseElement


@dataclasses.dataclass(frozen=True)
class _Param:
    name: str                          # as the SQL names it
    key: str | None                    # the caller's key; None: a value fixed in the statement
    fixed: Any
    convert: Callable[[Any], Any] | None


@dataclasses.dataclass(frozen=True)
class _Form:
    sql: str
    params: tuple[_Param, ...]
    positional: bool
    results: tuple[Callable[[Any], Any] | None, ...]
    row_type: type | None          # a SELECT's (or RETURNING's) rows, by their columns' names

    def bind(self, values: dict) -> tuple | dict:
        out = []
        for p in self.params:
            v = p.fixed if p.key is None else values[p.key]
            out.append(v if p.convert is None or v is None else p.convert(v))
        return tuple(out) if self.positional else {p.name: v for p, v in zip(self.params, out)}

    def row(self, raw: tuple) -> tuple:
        return self.row_type._make(v if f is None or v is None else f(v) for f, v in zip(self.results, raw))


class Prepared:
    """One statement, prepared for each dialect (and driver) it first runs on."""

    def __init__(self, statement: ClauseElement, keys: list[str] | None = None):
        """`keys`: an INSERT's columns given (by default all of the table's)."""
        self.statement, self.keys = statement, keys
        self._forms: dict[tuple, _Form] = {}      # by _form_key(dialect)

    def execute(self, conn: Connection, values: dict):
        """Runs it in `conn`'s transaction; the DBAPI cursor, for its rowcount or rows (`all`, `first`)."""
        form = self._form(conn.dialect)
        return self._run(conn, form.sql, form.bind(values), False)

    def executemany(self, conn: Connection, values: list[dict]) -> None:
        """Runs it once for each of `values`, in `conn`'s transaction."""
        if values:
            form = self._form(conn.dialect)
            self._run(conn, form.sql, [form.bind(v) for v in values], True).close()

    @staticmethod
    def _run(conn: Connection, sql: str, args, many: bool):
        fairy = conn.connection
        cursor = fairy.driver_connection.cursor()
        conn.dispatch.before_cursor_execute(conn, cursor, sql, args, None, many)
        try:
            (cursor.executemany if many else cursor.execute)(sql, args)
        except conn.dialect.loaded_dbapi.Error as e:     # as SQLAlchemy raises it (IntegrityError, ...)
            if conn.dialect.is_disconnect(e, fairy.dbapi_connection, cursor):
                conn.invalidate(e)
            raise DBAPIError.instance(sql, args, e, conn.dialect.loaded_dbapi.Error, dialect=conn.dialect) from e
        return cursor

    def rowcount(self, conn: Connection, values: dict) -> int:
        cursor = self.execute(conn, values)
        n = cursor.rowcount
        cursor.close()
        return n

    def all(self, conn: Connection, values: dict) -> list[tuple]:
        """A SELECT's (or RETURNING's) rows, as named tuples."""
        form = self._form(conn.dialect)
        cursor = self._run(conn, form.sql, form.bind(values), False)
        rows = [form.row(r) for r in cursor.fetchall()]
        cursor.close()
        return rows

    def first(self, conn: Connection, values: dict) -> tuple | None:
        rows = self.all(conn, values)
        return rows[0] if rows else None

    def _form(self, dialect: Dialect) -> _Form:
        return self._forms.get(_form_key(dialect)) or self._compile(dialect)

    def _compile(self, dialect: Dialect) -> _Form:
        compiled = self.statement.compile(dialect=dialect, column_keys=self.keys)
        if "__[POSTCOMPILE" in compiled.string:
            raise ValueError(f"not preparable (its SQL is completed per call): {compiled.string[:80]}")
        by_name = {name: bind for bind, name in compiled.bind_names.items()}
        names = compiled.positiontup if compiled.positional else list(by_name)
        params = []
        for name in names:
            bind = by_name[name]
            impl = bind.type.dialect_impl(dialect)
            params.append(_Param(compiled.escaped_bind_names.get(name, name), bind.key if bind.required else None,
                                 None if bind.required else bind.effective_value, impl.bind_processor(dialect)))
        columns = getattr(self.statement, "exported_columns", ())
        results = tuple(c.type.dialect_impl(dialect).result_processor(dialect, None) for c in columns)
        row_type = collections.namedtuple("Row", [f"_{i}" if not c.key or c.key.startswith("_") else c.key
                                                  for i, c in enumerate(columns)], rename=True)
        form = _Form(compiled.string, tuple(params), compiled.positional, results, row_type)
        self._forms[_form_key(dialect)] = form       # (two threads compiling at once store equal forms)
        return form


def _form_key(dialect: Dialect) -> tuple:
    """What the compiled SQL and the value conversions depend on: one process may hold engines of
    several databases, or drivers of one."""
    return dialect.name, dialect.driver, dialect.paramstyle
