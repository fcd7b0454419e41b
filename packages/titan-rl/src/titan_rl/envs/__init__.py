"""Environments with verifiable rewards (no downloads), a sandbox for code rewards, and tool-calling episodes."""
from titan_rl.envs.arithmetic import ArithmeticTask
from titan_rl.envs.base import Environment, Problem, SingleTurn, StepResult, Task
from titan_rl.envs.code import CodeTask, code_reward
from titan_rl.envs.countdown import CountdownTask
from titan_rl.envs.function_tasks import FunctionProblem, FunctionTask, code_exec_env
from titan_rl.envs.python_tool import PythonTool
from titan_rl.envs.retrieval import KeyValueRetrievalTask
from titan_rl.envs.sandbox import (
    SandboxConfig, SandboxResult, SandboxSupport, SandboxUnavailable, network_namespaces_available, run_sandboxed,
    sandbox_support,
)
from titan_rl.envs.sorting import SortingTask
from titan_rl.envs.tools import STOP_STRINGS, ToolEnv, calculator

__all__ = [
    "ArithmeticTask", "CodeTask", "CountdownTask", "Environment", "FunctionProblem", "FunctionTask",
    "KeyValueRetrievalTask", "Problem", "PythonTool", "SandboxConfig", "SandboxResult", "code_exec_env",
    "SandboxSupport", "SandboxUnavailable", "STOP_STRINGS", "SingleTurn", "SortingTask", "StepResult", "Task",
    "ToolEnv", "calculator", "code_reward", "network_namespaces_available", "run_sandboxed", "sandbox_support",
]
