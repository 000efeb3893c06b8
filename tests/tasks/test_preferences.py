import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import posttrain.rollout.sampler
from posttrain.tasks import arithmetic as A
from posttrain.tasks import preferences as P
from posttrain.tasks.tokenizer import build_char_tokenizer


def _answer(text: str) -> str:
    return text.split("<answer>")[-1].split("</answer>")[0]


@pytest.mark.parametrize("kind", ["flaw", "error", "mixed", "sign"])
def test_offline_pairs_chosen_correct_rejected_wrong(kind):
    rows = P.offline_pairs(200, seed=1, kind=kind)
    assert len(rows) == 200
    assert len({r["prompt"] for r in rows}) == 200  # distinct problems
    P.check_pairs(rows)
    for row in rows:
        problem = A.parse_problem(row["prompt"])
        assert not A.is_heldout(problem)
        # chosen is exactly the reference trace; rejected answers something else
        assert row["chosen"] == A.render_trace(problem, random.Random(0))[0]
        assert _answer(row["chosen"]) == str(problem.answer) == row["answer"]
        assert _answer(row["rejected"]) != str(problem.answer)
        assert row["source"] == f"offline:{kind}"


def test_flaw_pairs_are_the_sign_dropping_trace():
    for row in P.offline_pairs(50, seed=2, kind="flaw"):
        problem = A.parse_problem(row["prompt"])
        assert problem.has_negative
        steps, _, final = A.trace_steps(problem, random.Random(0), flaw_rate=1.0)
        assert row["rejected"] == A.format_trace(steps, final)
        assert "-" not in _answer(row["rejected"])  # the flaw never writes a minus sign


def test_mixed_uses_flaw_where_it_applies_and_random_errors_elsewhere():
    rows = P.offline_pairs(300, seed=3, kind="mixed")
    neg = [A.parse_problem(r["prompt"]).has_negative for r in rows]
    assert 0 < sum(neg) < len(rows)  # both kinds of problems occur
    for row, has_neg in zip(rows, neg, strict=True):
        problem = A.parse_problem(row["prompt"])
        if not has_neg:  # a random error: same number of steps, at least one wrong result
            assert row["rejected"].count(";") == len(problem.ops) - 1


def test_sign_pairs_teach_the_sign_in_both_directions():
    rows = P.offline_pairs(200, seed=4, kind="sign")
    neg = [A.parse_problem(r["prompt"]).has_negative for r in rows]
    assert 0.3 < sum(neg) / len(rows) < 0.7
    for row, has_neg in zip(rows, neg, strict=True):
        if has_neg:  # rejected drops the sign: fewer minus signs in the results than chosen
            assert row["rejected"].count("=-") < row["chosen"].count("=-")
        else:  # rejected adds one spurious minus sign to a positive result
            assert row["chosen"].count("=-") == 0 and row["rejected"].count("=-") >= 1
    # golden: 17-3-3 -> 17-3=14; 14-3=11; negating step k and continuing from it
    problem = A.parse_problem("17-3-3")
    texts = {P._spurious_sign_trace(problem, random.Random(s)) for s in range(20)}
    assert texts == {"<think>17-3=-14; -14-3=-17</think><answer>-17</answer>",
                     "<think>17-3=14; 14-3=-11</think><answer>-11</answer>"}


def test_heldout_pairs_come_from_heldout_problems_and_are_deterministic():
    rows = P.offline_pairs(40, seed=0, split="heldout")
    assert all(A.is_heldout(r["prompt"]) for r in rows)
    assert rows == P.offline_pairs(40, seed=0, split="heldout")
    assert rows != P.offline_pairs(40, seed=1, split="heldout")


def test_bad_arguments_and_check_pairs_errors():
    with pytest.raises(ValueError, match="valid: \\['error', 'flaw', 'mixed', 'sign'\\]"):
        P.offline_pairs(3, kind="typo")
    good = P.offline_pairs(2, seed=0)
    with pytest.raises(ValueError, match="pair 1: rejected answer equals"):
        P.check_pairs([good[0], {**good[1], "rejected": good[1]["chosen"]}])
    with pytest.raises(ValueError, match="pair 0: chosen answer"):
        P.check_pairs([{**good[0], "chosen": good[0]["rejected"]}])


def test_onpolicy_pairs_pick_a_correct_and_an_incorrect_sample(monkeypatch):
    """Fake sampler, per prompt in turn: all correct / all wrong / mixed / the only correct
    sample truncated (so it must not be used: that prompt counts as all wrong)."""
    tok = build_char_tokenizer()
    calls, seen = [], [0]

    def fake_generate(prompts, *, group_size, params, generator, batch_size):
        calls.append(len(prompts))
        texts, truncated = [], []
        for rendered in prompts:
            problem = A.parse_problem(rendered.replace("<s>", "").strip())
            good = A.format_trace(["x"], problem.answer)
            bad = A.format_trace(["x"], problem.answer + 1)
            kind, seen[0] = seen[0] % 4, seen[0] + 1
            groups = {0: [good] * 4, 1: [bad] * 4, 2: [bad, good, bad, good],
                      3: [good, bad, bad, bad]}
            texts += groups[kind]
            truncated += [kind == 3, False, False, False]
        return SimpleNamespace(completions=texts, truncated=torch.tensor(truncated))

    monkeypatch.setattr(posttrain.rollout.sampler, "model_sampler",
                        lambda model, tokenizer: SimpleNamespace(generate=fake_generate))
    rows, stats = P.onpolicy_pairs(None, tok, 12, seed=0, samples=4, batch_size=16)
    assert calls == [4, 4, 4]  # 16 sequences per generation batch = 4 prompts x 4 samples
    assert stats["prompts"] == 12 and stats["pairs"] == len(rows) == 3
    assert stats["all_correct"] == 3 and stats["all_wrong"] == 6
    # 3*4 + 3*2 correct samples among 48 (the truncated correct ones do not count)
    assert stats["sample_accuracy"] == pytest.approx(18 / 48)
    P.check_pairs(rows)
    assert all(r["source"] == "onpolicy" for r in rows)


def test_onpolicy_needs_two_samples():
    with pytest.raises(ValueError, match="samples >= 2"):
        P.onpolicy_pairs(None, None, 3, samples=1)


def test_cli_writes_offline_files(tmp_path, capsys):
    written = P.main(["--out", str(tmp_path), "--n", "20", "--heldout", "5", "--kind", "flaw"])
    train = [json.loads(line) for line in Path(written["train"]).read_text().splitlines()]
    held = [json.loads(line) for line in Path(written["heldout"]).read_text().splitlines()]
    assert len(train) == 20 and len(held) == 5
    assert set(train[0]) == {"prompt", "chosen", "rejected", "answer", "source"}
    P.check_pairs(train + held)
    assert "wrote train" in capsys.readouterr().out


def test_cli_writes_kto_unpaired_rows(tmp_path):
    written = P.main(["--out", str(tmp_path), "--n", "20", "--heldout", "5", "--kind", "sign"])
    train = [json.loads(line) for line in Path(written["train"]).read_text().splitlines()]
    rows = [json.loads(line) for line in Path(written["kto_train"]).read_text().splitlines()]
    assert len(rows) == 40 and set(rows[0]) == {"prompt", "completion", "label", "answer",
                                                "source"}
    want = sorted((p["prompt"], p[side], side == "chosen") for p in train
                  for side in ("chosen", "rejected"))
    assert sorted((r["prompt"], r["completion"], r["label"]) for r in rows) == want
    # shuffled: the two rows of a pair are not all neighbours
    assert any(a["prompt"] != b["prompt"] for a, b in zip(rows[::2], rows[1::2], strict=True))
    from posttrain.data import load_rows

    assert len(load_rows(written["kto_train"], kind="unpaired")) == 40
