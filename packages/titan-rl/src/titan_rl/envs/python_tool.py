"""The `python` tool of code-execution episodes: runs the model's code in the sandbox, returns what it printed.

The answer is short on purpose (it becomes the model's next context): at most `max_chars` of stdout,
or on failure `error: ` and the last line of stderr (`error: ZeroDivisionError: division by zero`) or
the limit that stopped it (`error: cpu_limit`, `error: wall_timeout`). A program that loops, forks without end or writes outside its working directory is
stopped by the sandbox's limits and read-only view, and answered with its error.

Results are memoised per (code, limits) for the process, because a group of samples often runs the same
code: one sandbox run (~70 ms) instead of one per sample. The memo assumes the code's output does not
depend on the run (time, randomness); where it does, the first run's output is kept. A wall-clock
timeout is not memoised (on a loaded machine it may be the load's, not the code's).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from titan_rl.envs.sandbox import SandboxConfig, run_sandboxed


_MEMO: dict[tuple[str, SandboxConfig, int], str] = {}
_MEMO_SIZE = 4096
# Outcomes that the code decides; a wall-clock timeout may be the machine's load, so it is not kept.
_MEMOISED_STATUSES = ("ok", "error", "cpu_limit", "memory_limit", "output_limit")


def _run(code: str, config: SandboxConfig, max_chars: int) -> str:
    key = (code, config, max_chars)
    if key in _MEMO:
        return _MEMO[key]
    result = run_sandboxed(code, config)
    if result.status == "ok":
        answer = result.stdout[:max_chars]
    else:
        last = next((line for line in reversed(result.stderr.splitlines()) if line.strip()), "")
        detail = last.strip() if result.status == "error" and last.strip() else result.status
        answer = f"error: {detail}"[:max_chars]
    if result.status in _MEMOISED_STATUSES and len(_MEMO) < _MEMO_SIZE:
        _MEMO[key] = answer
    return answer


@dataclass(kw_only=True, frozen=True)
class PythonTool:
    """`tool(code) -> text`, for `ToolEnv(task, tools={"python": PythonTool()})`."""

    config: SandboxConfig = field(default_factory=SandboxConfig)
    max_chars: int = 200

    def __post_init__(self) -> None:
        if self.max_chars < 1:
            raise ValueError(f"max_chars={self.max_chars}; must be >= 1")

    def __call__(self, code: str) -> str:
        code = code.strip()
        try:
            return _run(code, self.config, self.max_chars)
        except ValueError as e:  # the code is larger than the sandbox takes
            return f"error: {e}"[:self.max_chars]
