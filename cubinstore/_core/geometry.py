"""Launch geometry: how a manifest entry is launched, and the grid rules evaluated at launch.

A family declares how its entries are launched; the manifest carries it per entry
(``LaunchGeometry``, manifest v2 ``launch``). The build's manifest tool evaluates the constant
parts; grid items may stay rules over the launch's integer arguments and the device's SM
count, checked when a manifest is opened (``check_rule``) and evaluated at launch
(``eval_rule``). Standard library only.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from cubinstore.errors import BadArgumentError

__all__ = [
    "LaunchGeometry",
    "MAX_BLOCK_DIM",
    "MAX_CLUSTER_DIM",
    "MAX_GRID_DIM",
    "MAX_RULE_CHARS",
    "MAX_SHARED_MEM",
    "check_rule",
    "eval_rule",
    "rule_arg_indices",
]

# Bounds of a declared geometry, checked when a manifest is opened (the driver checks the
# device's own, smaller limits at launch): the slow checker and the manifest's fast path use these.
MAX_BLOCK_DIM: Final = 1024  # threads along one block dimension
MAX_CLUSTER_DIM: Final = 16  # CTAs along one cluster dimension
MAX_SHARED_MEM: Final = 1 << 20  # bytes of dynamic shared memory
MAX_GRID_DIM: Final = 2**31 - 1  # CTAs along one grid dimension

# A family declares how its entries are launched; the manifest carries it per entry, with the
# grid point's values filled in. `block`, `shared_mem` and `cluster` are integers (the build
# evaluates integer arithmetic such as "({bm} + {bn}) * {bk} * 2"); `grid` items may stay
# rules evaluated at launch over the call's integer arguments `args[i]` and the device's
# `sm_count`, with + - * // % min max cdiv.
_RULE_FUNCS: Final[Mapping[str, Any]] = {"min": min, "max": max, "cdiv": lambda a, b: -(-a // b)}
# (fewest, most) arguments of each function: checked when a rule is compiled, so a manifest with
# `cdiv(x)` is refused when it is opened, not with a TypeError at launch.
_RULE_ARITY: Final[Mapping[str, tuple[int, int | None]]] = {"min": (2, None), "max": (2, None), "cdiv": (2, 2)}
MAX_RULE_CHARS: Final = 256
# Integers a rule reads (its constants, args[i], sm_count) fit in 64 bits: with at most
# MAX_RULE_CHARS characters of + - * // %, no value it computes exceeds a few thousand bits.
_RULE_INT_MIN: Final = -(2**63)
_RULE_INT_END: Final = 2**64


class _RuleError(Exception):
    pass


def _compile_rule(text: str) -> Any:
    import ast  # only the build and a manifest with rules need it

    if type(text) is not str:
        raise _RuleError(f"expected a string, got {type(text).__name__}")
    if len(text) > MAX_RULE_CHARS:
        raise _RuleError(f"longer than {MAX_RULE_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise _RuleError(f"not an expression ({exc.msg})") from None
    except (RecursionError, MemoryError):
        raise _RuleError("nested too deeply") from None
    ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}

    def build(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            value = node.value
            if not _RULE_INT_MIN <= value < _RULE_INT_END:
                raise _RuleError(f"a constant of {value.bit_length()} bits does not fit in 64 bits")
            return lambda env: value
        if isinstance(node, ast.Name) and node.id == "sm_count":
            return lambda env: env["sm_count"]
        if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "args"
                and isinstance(node.slice, ast.Constant) and type(node.slice.value) is int):
            index = node.slice.value
            return lambda env: env["arg"](index)
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            op, left, right = ops[type(node.op)], build(node.left), build(node.right)
            return lambda env: op(left(env), right(env))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            inner = build(node.operand)
            return lambda env: -inner(env)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _RULE_FUNCS
                and not node.keywords):
            name = node.func.id
            fewest, most = _RULE_ARITY[name]
            if len(node.args) < fewest or (most is not None and len(node.args) > most):
                takes = f"exactly {fewest}" if most == fewest else f"at least {fewest}"
                call = "" if node is tree.body else f" in {ast.unparse(node)!r}"
                raise _RuleError(f"{name} takes {takes} arguments, got {len(node.args)}{call}")
            func, items = _RULE_FUNCS[name], [build(a) for a in node.args]
            return lambda env: func(*(f(env) for f in items))
        raise _RuleError(
            f"{ast.unparse(node)!r} is not allowed; use integers, args[<i>], sm_count, + - * // %, "
            f"min, max, cdiv"
        )

    try:
        return build(tree.body)
    except RecursionError:
        raise _RuleError("nested too deeply") from None


def _short_int(value: int) -> str:
    """An int for a message: a huge one by its size (str() of one past 4300 digits raises)."""
    return str(value) if value.bit_length() <= 128 else f"an int of {value.bit_length()} bits"


def _rule_int(value: object, what: str) -> int:
    if type(value) is not int:
        raise _RuleError(f"{what} is {type(value).__name__}, expected an int")
    if not _RULE_INT_MIN <= value < _RULE_INT_END:
        raise _RuleError(f"{what} is {_short_int(value)}, which does not fit in 64 bits")
    return value


@functools.lru_cache(maxsize=4096)
def _rule(text: str) -> Any:
    return _compile_rule(text)


def _no_args(index: int) -> int:
    raise _RuleError(f"uses args[{index}], which only a launch has")


def eval_rule(text: str, *, args: Sequence[Any] | None = None, sm_count: int | None = None) -> int:
    """Evaluate one geometry rule; raises ``BadArgumentError`` naming the rule."""
    def arg(index: int) -> int:
        if args is None:
            return _no_args(index)
        if not 0 <= index < len(args):
            raise _RuleError(f"args[{index}] does not exist: the launch has {len(args)} arguments")
        value = args[index]
        if isinstance(value, int) and not isinstance(value, bool) and type(value) is not int:
            value = int(value)  # an IntEnum, say: its value
        return _rule_int(value, f"args[{index}]")

    def count() -> int:
        if sm_count is None:
            raise _RuleError("uses sm_count, which only a launch has")
        return _rule_int(sm_count, "sm_count")

    class _Env(dict):  # sm_count is looked up lazily so a constant rule never needs a device
        def __missing__(self, key: str) -> int:
            return count()

    if type(text) is not str:
        raise BadArgumentError(f"launch rule: expected a string, got {type(text).__name__}")
    try:
        value = _rule(text)(_Env(arg=arg))
    except _RuleError as exc:
        raise BadArgumentError(f"launch rule {text!r}: {exc}") from None
    except ZeroDivisionError:
        raise BadArgumentError(f"launch rule {text!r}: division by zero") from None
    except (TypeError, OverflowError, RecursionError, MemoryError) as exc:  # a bound above missed: still typed
        raise BadArgumentError(f"launch rule {text!r}: cannot be evaluated ({type(exc).__name__})") from None
    return value


def check_rule(text: str) -> None:
    """Raise ``BadArgumentError`` unless ``text`` is a well-formed rule (its functions' arities included)."""
    if type(text) is not str:
        raise BadArgumentError(f"launch rule: expected a string, got {type(text).__name__}")
    try:
        _rule(text)
    except _RuleError as exc:
        raise BadArgumentError(f"launch rule {text!r}: {exc}") from None


def rule_arg_indices(text: str) -> tuple[int, ...]:
    """The sorted ``i`` of every ``args[i]`` a well-formed rule reads (the build checks them
    against the entry's parameters); raises ``BadArgumentError`` as ``check_rule`` does."""
    import ast

    check_rule(text)
    found = {node.slice.value for node in ast.walk(ast.parse(text, mode="eval"))
             if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)}
    return tuple(sorted(found))


def _dims3(value: Any, where: str, *, limit: int) -> tuple[int, int, int]:
    items = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if (not isinstance(items, (list, tuple)) or not 1 <= len(items) <= 3
            or any(isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= limit for v in items)):
        raise BadArgumentError(f"{where}: expected 1 to 3 integers in [1, {limit}], got {value!r}")
    padded = [*items, 1, 1][:3]
    return padded[0], padded[1], padded[2]


@dataclass(frozen=True)
class LaunchGeometry:
    """How an entry is launched when the caller gives no geometry (manifest v2 ``launch``)."""

    block: tuple[int, int, int]
    shared_mem: int = 0
    cluster: tuple[int, int, int] | None = None
    grid: tuple[int | str, ...] | None = None  # ints, or rules over args[i] and sm_count

    @classmethod
    def from_json(cls, obj: Any, where: str) -> LaunchGeometry:
        if not isinstance(obj, dict):
            raise BadArgumentError(f"{where}: expected an object, got {type(obj).__name__}")
        unknown = sorted(set(obj) - {"block", "shared_mem", "cluster", "grid"})
        if unknown:
            raise BadArgumentError(f"{where}: unknown key {unknown[0]!r}; allowed: block, cluster, grid, shared_mem")
        if "block" not in obj:
            raise BadArgumentError(f"{where}: missing key 'block'")
        block = _dims3(obj["block"], f"{where}.block", limit=MAX_BLOCK_DIM)
        smem = obj.get("shared_mem", 0)
        if isinstance(smem, bool) or not isinstance(smem, int) or not 0 <= smem <= MAX_SHARED_MEM:
            raise BadArgumentError(f"{where}.shared_mem: expected an integer in [0, {MAX_SHARED_MEM}], got {smem!r}")
        cluster = (None if obj.get("cluster") is None
                   else _dims3(obj["cluster"], f"{where}.cluster", limit=MAX_CLUSTER_DIM))
        grid = obj.get("grid")
        if grid is not None:
            if not isinstance(grid, list) or not 1 <= len(grid) <= 3:
                raise BadArgumentError(f"{where}.grid: expected a list of 1 to 3 integers or rules, got {grid!r}")
            for i, item in enumerate(grid):
                if isinstance(item, str):
                    try:
                        check_rule(item)
                    except BadArgumentError as exc:
                        raise BadArgumentError(f"{where}.grid[{i}]: {exc}") from None
                elif isinstance(item, bool) or not isinstance(item, int) or not 1 <= item <= MAX_GRID_DIM:
                    raise BadArgumentError(f"{where}.grid[{i}]: expected a positive integer or a rule, got {item!r}")
            grid = tuple(grid)
        return cls(block, smem, cluster, grid)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"block": list(self.block), "shared_mem": self.shared_mem}
        if self.cluster is not None:
            out["cluster"] = list(self.cluster)
        if self.grid is not None:
            out["grid"] = list(self.grid)
        return out

    def grid_for(self, args: Sequence[Any], sm_count: int | None) -> tuple[int, int, int] | None:
        """The grid for one launch, or None when the family declares no grid rule."""
        if self.grid is None:
            return None
        dims = [item if isinstance(item, int) else eval_rule(item, args=args, sm_count=sm_count) for item in self.grid]
        for d, item in zip(dims, self.grid):
            if not 1 <= d <= MAX_GRID_DIM:
                raise BadArgumentError(f"launch rule {item!r} gave grid dimension {d}, expected 1 .. 2**31-1")
        padded = [*dims, 1, 1][:3]
        return padded[0], padded[1], padded[2]
