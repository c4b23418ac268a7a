"""What the sink's ``/query`` endpoint will run: one SELECT over the project's own tables.

A query is parsed (sqlglot, ClickHouse dialect) and allowed only if every part of it is
on an allow-list: one statement, a SELECT (or a UNION of them), tables from the
project's schema and nothing else (no database qualifier, no table function, no system
table), columns those tables have or the query itself names, functions from
``FUNCTIONS``, joins on an equality between the two sides' columns (or USING). No
SETTINGS, FORMAT or INTO. What runs is the SQL generated back from the checked tree, never
the caller's text, so nothing the parser saw differently from ClickHouse can ride along.
A refusal says which part broke the rule.

Rows come only from the project's tables: nothing on the lists makes rows out of the
query's text (no arrayJoin, ARRAY JOIN, WITH RECURSIVE, WITH FILL, numbers() or other
table functions, cross joins), and literals are capped (``MAX_LITERAL_ELEMENTS``,
``MAX_STRING_LITERAL_BYTES``), so a few kilobytes of SQL cannot ask for millions of rows.

This is the first of two walls: the client that runs the query is read-only with
result-size, memory and time limits that act inside the engine (analytics/query.py),
and on a ClickHouse server the query user is granted SELECT on the project's database
and no sources (compose/).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import sqlglot
from sqlglot import exp
from sqlglot.dialects.clickhouse import ClickHouse
from sqlglot.errors import ParseError
from sqlglot.tokens import TokenType

MAX_SQL_CHARS = 20_000
MAX_SQL_NESTING = 32
"""Parentheses (subqueries, calls, expressions) open at once: the report's deepest query
opens 4; sqlglot's parser recurses about ten frames a level and Python allows 1,000."""
MAX_LITERAL_ELEMENTS = 100
"""Elements of one array, tuple or map literal: enough to name arms or quantile levels."""
MAX_STRING_LITERAL_BYTES = 1024
"""Bytes of one string literal (UTF-8): ids, topics, patterns; not data to unpack."""

# Every function a report, status or test query uses, and the plain arithmetic,
# comparison, date and array helpers around them. Nothing that reads outside the row:
# no dictGet, no file/url/remote, no system introspection, no currentUser, no sleep.
# Nothing that makes rows (arrayJoin), nor values whose size is a number in the query
# rather than the size of their arguments (range, replicate, repeat, arrayWithConstant)
# or a product of them (replaceAll).
FUNCTIONS = frozenset(
    name.lower()
    for name in (
        # aggregates
        "count",
        "sum",
        "avg",
        "min",
        "max",
        "any",
        "anyLast",
        "uniq",
        "uniqExact",
        "countIf",
        "sumIf",
        "avgIf",
        "quantile",
        "quantiles",
        "quantileExact",
        "quantileExactInclusive",
        "quantileTDigest",
        "median",
        "groupArray",
        "groupUniqArray",
        "argMin",
        "argMax",
        "stddevPop",
        "stddevSamp",
        "varPop",
        "varSamp",
        "maxMapMerge",
        "sumMap",
        "maxMap",
        "minMap",
        # conditionals and logic
        "if",
        "multiIf",
        "coalesce",
        "ifNull",
        "nullIf",
        "isNull",
        "isNotNull",
        "and",
        "or",
        "not",
        "xor",
        # numbers
        "abs",
        "round",
        "floor",
        "ceil",
        "intDiv",
        "modulo",
        "least",
        "greatest",
        "exp",
        "log",
        "sqrt",
        "pow",
        "toInt32",
        "toInt64",
        "toUInt32",
        "toUInt64",
        "toFloat64",
        "toString",
        "toDecimal64",
        # time
        "toUnixTimestamp",
        "toUnixTimestamp64Milli",
        "fromUnixTimestamp64Milli",
        "toDateTime",
        "toDateTime64",
        "toDate",
        "toStartOfHour",
        "toStartOfMinute",
        "toStartOfInterval",
        "now",
        "now64",
        "dateDiff",
        "toIntervalSecond",
        # strings
        "length",
        "lower",
        "upper",
        "substring",
        "position",
        "match",
        "like",
        "concat",
        "startsWith",
        "endsWith",
        "trim",
        "lengthUTF8",
        # arrays, maps, tuples
        "arrayAvg",
        "arraySum",
        "arrayMin",
        "arrayMax",
        "arrayReduce",
        "has",
        "empty",
        "notEmpty",
        "tupleElement",
        "mapKeys",
        "mapValues",
        "array",
        "tuple",
        "map",
        "indexOf",
        "arrayElement",
    )
)

# arrayReduce names its aggregate in a string: the name must be an allowed aggregate too.
_NAMED_AGGREGATE_ARG = {"arrayreduce"}

# sqlglot node types a SELECT over our tables may contain besides functions, columns
# and tables (checked on their own). Anything else (a Command, a SETTINGS or FORMAT
# clause, a placeholder, a parameter, DDL, DML) is refused.
_ALLOWED_NODES: tuple[type[exp.Expr], ...] = (
    exp.Select,
    exp.Union,
    exp.Subquery,
    exp.From,
    exp.Join,
    exp.Where,
    exp.Group,
    exp.Having,
    exp.Order,
    exp.Ordered,
    exp.Limit,
    exp.Offset,
    exp.Distinct,
    exp.With,
    exp.CTE,
    exp.TableAlias,
    exp.Alias,
    exp.Identifier,
    exp.Star,
    exp.Literal,
    exp.Boolean,
    exp.Null,
    exp.Paren,
    exp.Tuple,
    exp.Array,
    exp.Interval,
    exp.Var,
    exp.Connector,
    exp.Binary,
    exp.Unary,
    exp.Predicate,
    exp.Between,
    exp.In,
    exp.Case,
    exp.If,
    exp.Cast,
    exp.DataType,
    exp.DataTypeParam,
    exp.Final,
    exp.Lambda,
    exp.Bracket,
    exp.Dot,
    exp.Column,
    exp.Table,
    exp.Func,
)
# sqlglot models operators (AND, =, +, NOT, IN, BETWEEN, CASE, CAST) as functions too;
# they compute on the row and are checked only through their operands.
_OPERATORS: tuple[type[exp.Expr], ...] = (
    exp.Binary,
    exp.Unary,
    exp.Connector,
    exp.Predicate,
    exp.Cast,
    exp.If,
    exp.Case,
    exp.Array,
    exp.Tuple,
    exp.Bracket,
)
_REFUSED_ARGS = ("settings", "format", "into", "sample", "kind")

# Joins that pair rows on a condition: (strictness or kind, side) as sqlglot parses them.
# Not here, so refused: ARRAY JOIN (rows out of arrays), CROSS and comma joins (every
# pair of rows), PASTE JOIN (rows by position). The condition itself must pair the sides'
# columns (_pairs_two_sides): ON 1 = 1 is a cross join too.
_JOIN_KINDS = frozenset({"", "INNER", "OUTER", "ANY", "ALL", "SEMI", "ANTI", "ASOF"})
_JOIN_SIDES = frozenset({"", "LEFT", "RIGHT", "FULL"})
# Literals whose elements are capped, by the name a refusal gives them.
_COLLECTIONS: tuple[tuple[type[exp.Expr], str], ...] = (
    (exp.Array, "array literal"),
    (exp.Tuple, "tuple literal"),
    (exp.Struct, "tuple literal"),
)


_DIALECT = ClickHouse()


class Refused(ValueError):
    """The query breaks the allow-list; the message says where."""


def checked_sql(sql: str, tables: Mapping[str, Collection[str]]) -> str:
    """The query as it will run, or Refused. ``tables``: table name -> its column names."""
    if not isinstance(sql, str) or not sql.strip():
        raise Refused("the query is empty")
    if len(sql) > MAX_SQL_CHARS:
        raise Refused(f"the query is longer than {MAX_SQL_CHARS} characters")
    try:
        _check_nesting(sql)
        statements = [s for s in sqlglot.parse(sql, read="clickhouse") if s is not None]
        if len(statements) != 1:
            raise Refused(f"one statement only (got {len(statements)})")
        (tree,) = statements
        if not isinstance(tree, (exp.Select, exp.Union)):
            raise Refused(f"only SELECT queries are allowed (got {tree.key.upper()})")
        _check(tree, tables)
        return tree.sql(dialect="clickhouse")
    except (ParseError, sqlglot.errors.TokenError) as exc:
        raise Refused(
            f"not a query this endpoint understands: {str(exc).splitlines()[0]}"
        ) from None
    except RecursionError:
        # What nests without parentheses (NOT NOT NOT ..., CASE in CASE): the parser's and
        # the generator's recursion is the bound there, and past it the query is refused.
        raise Refused("the query nests too deeply for this endpoint to read") from None


def _check_nesting(sql: str) -> None:
    """Refused when parentheses nest past MAX_SQL_NESTING, counted on the tokens (never
    recursing), so a subquery inside a subquery 200 deep is a refusal, not a RecursionError."""
    depth = 0
    for token in _DIALECT.tokenize(sql):
        if token.token_type == TokenType.L_PAREN:
            depth += 1
            if depth > MAX_SQL_NESTING:
                raise Refused(f"parentheses nest more than {MAX_SQL_NESTING} deep")
        elif token.token_type == TokenType.R_PAREN:
            depth -= 1


def _check(tree: exp.Expression, tables: Mapping[str, Collection[str]]) -> None:
    defined = _names_defined_in(tree)
    columns = {column for names in tables.values() for column in names}
    for node in tree.walk():
        if not isinstance(node, _ALLOWED_NODES):
            raise Refused(f"{node.key.upper()} is not allowed in a query here: {_show(node)}")
        if isinstance(node, (exp.Select, exp.Union)) and (
            arg := next((a for a in _REFUSED_ARGS if node.args.get(a)), None)
        ):
            raise Refused(f"{arg.upper()} is not allowed: {_show(node.args[arg])}")
        _check_size(node)
        if isinstance(node, exp.With) and node.args.get("recursive"):
            raise Refused("WITH RECURSIVE is not allowed: rows come from the project's tables")
        if isinstance(node, exp.Join):
            _check_join(node)
        elif isinstance(node, exp.Table):
            _check_table(node, tables, defined)
        elif isinstance(node, exp.Literal):
            _check_literal(node)
        elif isinstance(node, exp.Func) and not isinstance(node, _OPERATORS):
            _check_function(node)
        elif isinstance(node, exp.Column):
            if node.args.get("db") or node.args.get("catalog"):
                raise Refused(f"column {_show(node)}: qualify columns by table or alias only")
            if node.name and node.name not in columns and node.name not in defined:
                raise Refused(f"unknown column {node.name!r}")


def _check_table(node: exp.Table, tables: Mapping[str, Collection[str]], defined: set[str]) -> None:
    if not isinstance(node.this, exp.Identifier):
        raise Refused(f"table functions are not allowed: {_show(node)}")
    if node.args.get("db") or node.args.get("catalog"):
        raise Refused(f"table {_show(node)}: only the project's own tables, unqualified")
    if node.name not in tables and node.name not in defined:
        raise Refused(f"unknown table {node.name!r} (allowed: {', '.join(sorted(tables))})")


def _check_join(node: exp.Join) -> None:
    kind, side = (str(node.args.get(a) or "").upper() for a in ("kind", "side"))
    if kind not in _JOIN_KINDS or side not in _JOIN_SIDES:
        shown = " ".join(part for part in (side, kind) if part)
        raise Refused(f"{shown} JOIN is not allowed: join tables ON a condition or USING columns")
    if node.args.get("using"):
        return
    on = node.args.get("on")
    if on is None:
        raise Refused(
            f"a join needs ON or USING (a join without one pairs every row): {_show(node)}"
        )
    if not any(_pairs_two_sides(conjunct) for conjunct in _conjuncts(on)):
        raise Refused(
            "a join's ON needs an equality between a column of each side, ANDed with anything "
            f"else (ON 1 = 1, OR, or a comparison pairs every row): {_show(on)}"
        )


def _conjuncts(condition: exp.Expr) -> list[exp.Expr]:
    """The terms an ON condition ANDs together (parentheses looked through)."""
    condition = condition.unnest()
    if isinstance(condition, exp.And):
        return _conjuncts(condition.left) + _conjuncts(condition.right)
    return [condition]


def _pairs_two_sides(term: exp.Expr) -> bool:
    """``x.a = y.b``: columns qualified by two different tables or aliases. Only such a term,
    ANDed into ON, makes a join pair rows by value rather than pair every row."""
    if not isinstance(term, exp.EQ):
        return False
    left, right = term.left.unnest(), term.right.unnest()
    return (
        isinstance(left, exp.Column)
        and isinstance(right, exp.Column)
        and bool(left.table and right.table)
        and left.table != right.table
    )


def _check_size(node: exp.Expr) -> None:
    for kind, shown in _COLLECTIONS:
        if isinstance(node, kind) and len(node.expressions) > MAX_LITERAL_ELEMENTS:
            raise Refused(
                f"{shown} of {len(node.expressions)} elements (at most {MAX_LITERAL_ELEMENTS})"
            )


def _check_literal(node: exp.Literal) -> None:
    size = len(node.this.encode()) if node.is_string else 0
    if size > MAX_STRING_LITERAL_BYTES:
        raise Refused(f"string literal of {size} bytes (at most {MAX_STRING_LITERAL_BYTES})")


def _check_function(node: exp.Func) -> None:
    name = _function_name(node)
    if name.lower() not in FUNCTIONS:
        raise Refused(f"function {name}() is not allowed")
    if name.lower() in _NAMED_AGGREGATE_ARG:
        first = node.expressions[0] if node.expressions else node.this
        if not (isinstance(first, exp.Literal) and first.is_string):
            raise Refused(f"{name}() takes the aggregate's name as a string literal")
        aggregate = first.this.split("(", 1)[0].strip()
        if aggregate.lower() not in FUNCTIONS:
            raise Refused(f"aggregate {aggregate}() is not allowed in {name}()")


def _function_name(node: exp.Func) -> str:
    """The name ClickHouse will see, as written: what the checked tree renders before the
    call's "(". (sqlglot's own names differ: its COUNT_IF is ClickHouse's countIf.)
    ClickHouse matches these names without case, so compare them lower-cased."""
    if isinstance(
        node, (exp.Anonymous, exp.ParameterizedAgg, exp.AnonymousAggFunc, exp.CombinedAggFunc)
    ):
        this = node.this
        return this.name if isinstance(this, exp.Identifier) else str(this)
    rendered = node.sql(dialect="clickhouse")
    name, paren, _ = rendered.partition("(")
    if not paren or not name.replace("_", "").isalnum():
        raise Refused(f"{_show(node)} is not a plain function call")
    return name.strip()


def _names_defined_in(tree: exp.Expression) -> set[str]:
    """Aliases, CTE names and lambda parameters the query defines for itself."""
    names: set[str] = set()
    for node in tree.walk():
        if isinstance(node, (exp.Alias, exp.TableAlias, exp.CTE)) and node.alias:
            names.add(node.alias)
        elif isinstance(node, exp.Lambda):
            names.update(e.name for e in node.expressions)
    return names


def _show(node: object) -> str:
    text = node.sql(dialect="clickhouse") if isinstance(node, exp.Expression) else str(node)
    return text if len(text) <= 80 else text[:77] + "..."
