"""The built-in tools (ds_train/ript/tools.py): the calculator's values and the errors it answers with; the code
tool's output, or the limit that stopped it, as the tool's result; through an environment task's worker process
as a model's call would run it."""

from __future__ import annotations

import time

import pytest


@pytest.mark.parametrize("expression,said", [
    ("347 * 86", "29842"), (" (1 + 2) * -3 ", "-9"), ("7 // 2", "3"), ("6 / 3", "2"), ("1 / 8", "0.125"),
    ("2 ** 10", "1024"), ("2.5 * 4", "10"), ("17 % 5", "2"),
    ("1 / 0", "error: division by zero"),
    ("9 ** 9 ** 9", "error: the result has more than 1000 digits"),  # refused before it is computed
    ("2.5 ** 2000", "error: the result is too large"),
    ("(-8) ** (1 / 3)", "error: the result is not a real number"),
    ("347 times 86", "error: '347 times 86' is not an arithmetic expression"),
    ("__import__('os').getcwd()", "error: \"__import__('os').getcwd()\" is not arithmetic (numbers, + - * / // % ** "
                                  "and parentheses)"),
    ("(1).__class__", "error: '1 .__class__' is not arithmetic (numbers, + - * / // % ** and parentheses)"),
    ("True + 1", "error: 'True' is not arithmetic (numbers, + - * / // % ** and parentheses)"),
])
def test_the_calculator_evaluates_arithmetic_and_nothing_else(expression, said):
    from ds_train.ript.environments import tool_schema
    from ds_train.ript.tools import calculator

    start = time.monotonic()
    assert calculator(expression) == said
    assert time.monotonic() - start < 30  # 9 ** 9 ** 9 is refused, not computed (that would take hours)
    schema = tool_schema(calculator, "tools[0]")  # what the chat template shows the model
    assert schema["function"]["name"] == "calculator" and \
        schema["function"]["parameters"]["required"] == ["expression"], schema


@pytest.mark.parametrize("code,said", [
    ("print(6 * 7)", "42\n"),
    ("print('partial'); raise ValueError('bad')", "partial\n\nerror: ValueError: bad"),
    ("x = bytearray(3 << 30)", "error: the program ran out of memory (its limit is 256 MiB)"),
    ("while True: pass", "error: the program ran past 2 s and was stopped"),
    ("import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)",
     "error: the program ran past 2 s and was stopped"),
    ("import os; print(sorted(os.environ))", "['LANG', 'PATH']\n"),  # none of the trainer's variables
])
def test_a_program_runs_within_its_limits(code, said):
    from ds_train.ript.tools import run_limited

    start = time.monotonic()
    assert run_limited(code, 2, 256) == said
    assert time.monotonic() - start < 30  # stopped at its 2 s limit, not after the program's 60 s


def test_the_sleep_a_stopped_program_started_is_stopped_with_it():
    import subprocess

    from ds_train.ript.tools import run_limited

    marker = "import subprocess, time; subprocess.Popen(['sleep', '61.5']); time.sleep(60)"
    run_limited(marker, 1, 256)
    time.sleep(0.2)
    assert "sleep 61.5" not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
