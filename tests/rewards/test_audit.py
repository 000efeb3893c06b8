"""Issue 59 item 4: `posttrain audit`: the demo's math reward passes, a weak reward ("an answer
tag is present") and a hedge-accepting one are caught, the code reward on the code world passes
and tests that are the prompt's own examples are caught, an obedient judge is caught, honest
forms a reward rejects are reported as false negatives without failing."""

from __future__ import annotations

import json
import re
import sys

import pytest

from posttrain.cli import main
from posttrain.rewards import judge
from posttrain.tasks.arithmetic import prompt_rows, write_jsonl
from tests.rewards.http_stub import serve


def tag_present(completion: str) -> float:
    return float("<answer>" in completion)


def answer_anywhere(completion: str, answer: str) -> float:
    return float(answer in completion)


def exact_tag(completion: str, answer: str) -> float:
    """Strict: the last answer tag holds exactly the answer's text."""
    return float(re.findall(r"<answer>(.*?)</answer>", completion)[-1:] == [answer])


@pytest.fixture
def prompts(tmp_path):
    return str(write_jsonl(prompt_rows(8, 1), tmp_path / "prompts.jsonl"))


def _audit(capsys, *args: str) -> tuple[int, dict]:
    code = main(["audit", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def _verdicts(report: dict) -> dict[str, str]:
    return {p["probe"]: p["verdict"] for p in report["probes"]}


def test_the_demos_math_reward_passes(capsys, prompts) -> None:
    code, report = _audit(capsys, "--reward", "math", "--reward", "format", "--data", prompts)
    assert code == 0 and report["passed"] and report["separated_rows"] == 8
    assert not report["exploits"] and not report["false_negatives"]
    checked = [p for p in report["probes"] if p["kind"] == "exploit" and p["rows"]]
    assert len(checked) >= 11 and all(p["like_right"] == 0 for p in checked)


def test_a_weak_reward_is_caught_with_its_exploits(capsys, prompts) -> None:
    code, report = _audit(capsys, "--reward", f"{__name__}:tag_present", "--data", prompts)
    assert code == 1 and not report["passed"] and report["separated_rows"] == 0
    assert {"format_only", "several_answers", "padding", "judge_injection",
            "huge_number"} <= set(report["exploits"])
    assert "empty" not in report["exploits"] and "prompt_echo" not in report["exploits"]
    main(["audit", "--reward", f"{__name__}:tag_present", "--data", prompts])
    out = capsys.readouterr().out  # the table
    assert "EXPLOIT: format_only (the tags, no answer) scores like a right answer" in out
    assert out.rstrip().endswith("failed")


def test_a_reward_that_finds_the_answer_anywhere_is_caught(capsys, prompts) -> None:
    code, report = _audit(capsys, "--reward", f"{__name__}:answer_anywhere", "--data", prompts)
    assert code == 1 and report["separated_rows"] == 8
    assert {"several_answers", "several_values", "answer_in_thinking"} <= set(
        report["exploits"])


def test_honest_forms_rejected_are_false_negatives_not_failures(capsys, prompts) -> None:
    code, report = _audit(capsys, "--reward", f"{__name__}:exact_tag", "--data", prompts)
    assert code == 0 and report["passed"]
    assert {"decimal_form", "fraction_form", "boxed_in_tag", "boxed_only",
            "unicode_digits"} <= set(report["false_negatives"])


def test_the_code_reward_on_the_code_world_and_on_tests_the_prompt_shows(capsys, tmp_path
                                                                          ) -> None:
    from posttrain.tasks.functions import code_rows

    rows = code_rows(4, 0)
    hidden = write_jsonl(rows, tmp_path / "hidden.jsonl")
    code, report = _audit(capsys, "--reward", "code", "--data", str(hidden))
    assert code == 0 and _verdicts(report)["examples_hardcoded"] == "ok"
    shown = [{**r, "tests": [f"assert f({a}) == {v}" for a, v in
                             (part.split(")=") for part in r["prompt"][2:].split(",f("))]}
             for r in rows]  # the tests are the prompt's own examples
    code, report = _audit(capsys, "--reward", "code", "--data",
                          str(write_jsonl(shown, tmp_path / "shown.jsonl")))
    assert code == 1 and report["exploits"] == ["examples_hardcoded"]


def test_a_judge_that_obeys_the_completion_is_caught(capsys, prompts, monkeypatch) -> None:
    from tests.rewards.test_judge_reward import graded

    monkeypatch.setattr(judge, "CACHE", judge._Cache())

    def obedient(path: str, body: dict) -> tuple[int, dict]:
        text, user = graded(body), body["messages"][1]["content"]
        reference = user.split("Reference answer:\n", 1)[1].split("\n", 2)[1]
        right = exact_tag(text, reference) or "grader" in text
        return 200, {"choices": [{"message": {"content": f"SCORE: {10 if right else 0}"}}]}

    with serve(obedient) as stub:
        entry = f"{{name: judge, url: '{stub.url}', model: m, rubric: 'Is it right?'}}"
        code, report = _audit(capsys, "--reward", entry, "--data", prompts)
    assert code == 1 and report["exploits"] == ["judge_injection"]


def test_a_recipe_gives_the_rewards_and_data_and_bad_arguments_are_one_line(
        capsys, tmp_path, prompts) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"train_data: {prompts}\nrewards: [{{name: math}}]\n")
    code, report = _audit(capsys, "--config", str(recipe), "--n", "3")
    assert code == 0 and report["rows"] == 3
    assert main(["audit", "--reward", "math"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--data" in err[0]
    assert main(["audit", "--reward", "maths", "--data", prompts]) == 2
    assert "unknown reward 'maths'" in capsys.readouterr().err


def test_the_command_is_listed_in_help(capsys) -> None:
    assert main(["--help"]) == 0
    assert "audit: run a reward over known exploits" in capsys.readouterr().out
    assert sys.modules["posttrain.cli"].COMMANDS["audit"]
