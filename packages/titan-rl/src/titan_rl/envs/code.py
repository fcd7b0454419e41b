"""Code-execution reward: the completion is a Python program, scored against hidden tests.

Scoring happens here, in the trainer: the sandbox only runs the program and prints, per test, the value
of the test's expression as tagged JSON of plain values (None, bool, int, float, str, and lists, tuples,
sets and dicts of them). We parse that and compare it with the expected value, which never enters the
sandbox. Nothing the program can rebind (builtins, the harness's globals, its output) makes a wrong
value equal: an object with a forged `__eq__` is not a plain value, and a forged results line must
still carry the right values. Equal means the same plain value of the same types (3 is not 3.0 and
True is not 1; sets and dicts in any order; NaN equals NaN).
"""
from __future__ import annotations

import ast
import inspect
import json
import random
from dataclasses import dataclass, field
from typing import Any

from titan_rl.envs.base import Problem
from titan_rl.envs.sandbox import SandboxConfig, SandboxResult, run_sandboxed

RESULTS_MARKER = "TITAN-RESULTS "
_MAX_DEPTH = 64

# The harness is the sandbox's main program: it runs the candidate (solution.py) as __main__, then
# evaluates each test expression in the candidate's namespace and prints the encoded values.
_HARNESS = '''
import json, sys
_ns = {"__name__": "__main__"}
with open("solution.py", encoding="utf-8") as _f:
    exec(compile(_f.read(), "solution.py", "exec"), _ns)
%s
_results = []
for _expr in json.loads(%r):
    try:
        _results.append({"value": _encode(eval(_expr, _ns))})
    except BaseException as _e:
        _results.append({"error": type(_e).__name__})
sys.stdout.flush()
sys.stdout.write("\\n%s" + json.dumps(_results) + "\\n")
'''


def _encode(x, depth=0):
    """Plain values to tagged JSON; anything else (including subclasses of plain types) is refused."""
    if depth > 64:
        raise ValueError("nested too deeply")
    t = type(x)
    if x is None or t is bool or t is int or t is str:
        return x
    if t is float:
        return {"float": repr(x)} if x != x or x in (float("inf"), float("-inf")) else x
    if t is list or t is tuple or t is set or t is frozenset:
        return {t.__name__: [_encode(v, depth + 1) for v in x]}
    if t is dict:
        return {"dict": [[_encode(k, depth + 1), _encode(v, depth + 1)] for k, v in x.items()]}
    raise TypeError(f"{t.__name__} is not a plain value")


_ENCODE_SOURCE = inspect.getsource(_encode)  # the harness carries this very function


def _decode(x: Any, depth: int = 0) -> Any:
    """Inverse of _encode over parsed JSON (run in the trainer; raises ValueError on anything else)."""
    if depth > _MAX_DEPTH:
        raise ValueError("nested too deeply")
    if x is None or type(x) in (bool, int, float, str):
        return x
    if type(x) is dict and len(x) == 1:
        (tag, body), = x.items()
        if tag == "float" and body in ("nan", "inf", "-inf"):
            return float(body)
        if type(body) is list and tag in ("list", "tuple", "set", "frozenset"):
            items = [_decode(v, depth + 1) for v in body]
            return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
        if type(body) is list and tag == "dict" and all(type(kv) is list and len(kv) == 2 for kv in body):
            return {_decode(k, depth + 1): _decode(v, depth + 1) for k, v in body}
    raise ValueError(f"not an encoded plain value: {str(x)[:80]}")


def _split_check(check: str | tuple[str, Any]) -> tuple[str, Any]:
    """A check is `(expression, expected)` or the string 'EXPRESSION == LITERAL'."""
    if isinstance(check, tuple):
        expr, expected = check
        if not isinstance(expr, str):
            raise TypeError(f"check {check!r}: the expression must be a str")
        return expr, expected
    try:
        tree = ast.parse(check, mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"check {check!r} is not a Python expression: {e.msg}") from None
    if not (isinstance(tree, ast.Compare) and len(tree.ops) == 1 and isinstance(tree.ops[0], ast.Eq)):
        raise ValueError(f"check {check!r}: write it as 'EXPRESSION == LITERAL' or give (expression, expected)")
    try:
        expected = ast.literal_eval(tree.comparators[0])
    except ValueError:
        raise ValueError(f"check {check!r}: the right side of == must be a literal (the expected value)") from None
    return ast.unparse(tree.left), expected


def _canonical(x: Any) -> str:
    """One JSON text per plain value: types kept (3 is not 3.0, True is not 1), sets and dicts unordered."""
    def canon(v: Any) -> Any:
        t = type(v)
        if t is set or t is frozenset:
            return {t.__name__: sorted((canon(i) for i in v), key=json.dumps)}
        if t is dict:
            return {"dict": sorted(([canon(k), canon(i)] for k, i in v.items()), key=json.dumps)}
        if t is list or t is tuple:
            return {t.__name__: [canon(i) for i in v]}
        return _encode(v)
    return json.dumps(canon(x))


def _expected_matches(expected: Any, reported: Any) -> bool:
    if not isinstance(reported, dict) or "value" not in reported:
        return False  # the expression raised, or the program forged something else
    try:
        return _canonical(_decode(reported["value"])) == _canonical(expected)
    except (ValueError, TypeError, RecursionError):  # TypeError: a forged unhashable dict key or set item
        return False


def code_reward(program: str, checks: list[str | tuple[str, Any]], *,
                config: SandboxConfig | None = None) -> tuple[float, SandboxResult]:
    """Fraction of `checks` whose expression, evaluated after running `program` in the sandbox, equals
    the expected value (compared here, in the trainer); 0.0 if the program fails or exceeds a limit."""
    if not checks:
        raise ValueError("checks is empty; give at least one 'EXPRESSION == LITERAL' or (expression, expected)")
    pairs = [_split_check(c) for c in checks]
    for expr, expected in pairs:
        try:
            _encode(expected)
        except (TypeError, ValueError) as e:
            raise ValueError(f"check {expr!r}: expected value {expected!r} is not a plain value ({e}); "
                             "allowed: None, bool, int, float, str and lists, tuples, sets, dicts of them") from None
    harness = _HARNESS % (_ENCODE_SOURCE, json.dumps([e for e, _ in pairs]), RESULTS_MARKER)
    result = run_sandboxed(harness, config or SandboxConfig(), files={"solution.py": program})
    if result.status != "ok":
        return 0.0, result
    for line in reversed(result.stdout.splitlines()):
        if line.startswith(RESULTS_MARKER):
            try:
                reported = json.loads(line[len(RESULTS_MARKER):])
            except (json.JSONDecodeError, RecursionError):
                return 0.0, result
            if not isinstance(reported, list) or len(reported) != len(pairs):
                return 0.0, result
            passed = sum(_expected_matches(exp, rep) for (_, exp), rep in zip(pairs, reported))
            return passed / len(pairs), result
    return 0.0, result


@dataclass(kw_only=True, frozen=True)
class CodeTask:
    """Write-a-function problems; reward = fraction of hidden checks passed in the sandbox."""

    sandbox: SandboxConfig = field(default_factory=SandboxConfig)

    _PROBLEMS = (
        ("Write a Python function add(a, b) returning a + b.", "def add(a, b):\n    return a + b",
         ["add(1, 2) == 3", "add(-5, 5) == 0", "add(10**6, 1) == 1000001"]),
        ("Write a Python function rev(s) returning the string s reversed.", "def rev(s):\n    return s[::-1]",
         ["rev('abc') == 'cba'", "rev('') == ''", "rev('ab ') == ' ba'"]),
        ("Write a Python function evens(xs) returning the even numbers of xs in order.",
         "def evens(xs):\n    return [x for x in xs if x % 2 == 0]",
         ["evens([1, 2, 3, 4]) == [2, 4]", "evens([]) == []", "evens([7]) == []"]),
    )

    def sample(self, rng: random.Random) -> Problem:
        prompt, solution, _ = rng.choice(self._PROBLEMS)
        return Problem(prompt=prompt + "\n", answer=solution)

    def reward(self, problem: Problem, completion: str) -> float:
        checks = next(c for p, _, c in self._PROBLEMS if p + "\n" == problem.prompt)
        return code_reward(completion, checks, config=self.sandbox)[0]
