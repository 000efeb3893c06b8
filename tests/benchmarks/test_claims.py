"""benchmarks/claims.py: the table arithmetic (hand-computed) and the KL estimator comparison."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _claims():
    spec = importlib.util.spec_from_file_location("claims", ROOT / "benchmarks" / "claims.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("claims", module)
    spec.loader.exec_module(module)
    return module


def test_mean_std_by_hand():
    claims = _claims()
    # mean (0.5 + 0.7 + 0.9) / 3 = 0.7; squares 0.04 + 0 + 0.04 = 0.08; / (3 - 1) = 0.04; sqrt 0.2
    mean, std = claims.mean_std([0.5, 0.7, 0.9])
    assert mean == pytest.approx(0.7) and std == pytest.approx(0.2)
    # (1 + 2 + 4) / 3 = 7/3; squares (4/3)^2 + (1/3)^2 + (5/3)^2 = 42/9; / 2 = 7/3; sqrt 1.5275
    assert claims.mean_std([1.0, 2.0, 4.0]) == pytest.approx((7 / 3, math.sqrt(7 / 3)))
    assert claims.mean_std([3.0]) == (3.0, 0.0)


def test_table_rows_and_markdown():
    claims = _claims()
    per_seed = {
        "demo": {0: {"before": 0.5, "after": 0.9, "seconds": 10.0},
                 1: {"before": 0.5, "after": 0.7, "seconds": 20.0},
                 2: {"before": 0.5, "after": 0.8, "seconds": 30.5}},
        "ppo": {},  # not run: no row
    }
    specs = [
        {"job": "demo", "claim": "c", "metric": "after %", "key": "after", "scale": 100,
         "command": "cmd demo"},
        {"job": "demo", "claim": "c", "metric": "gain", "command": "cmd demo",
         "key": lambda r: r["after"] - r["before"]},
        {"job": "ppo", "claim": "p", "metric": "after", "key": "after", "command": "cmd ppo"},
    ]
    rows = claims.table_rows(per_seed, specs)
    assert [r["metric"] for r in rows] == ["after %", "gain"]
    after, gain = rows
    assert after["values"] == {0: 0.9, 1: 0.7, 2: 0.8}
    # mean 0.8; squares 0.01 + 0.01 + 0 = 0.02; / 2 = 0.01; std 0.1 (the same for the gains)
    assert after["mean"] == pytest.approx(0.8) and after["std"] == pytest.approx(0.1)
    assert gain["values"] == pytest.approx({0: 0.4, 1: 0.2, 2: 0.3})
    assert gain["mean"] == pytest.approx(0.3) and gain["std"] == pytest.approx(0.1)
    assert after["seconds"] == 60.5  # 10 + 20 + 30.5, the job's runs over the seeds
    text = claims.markdown(rows, [0, 1, 2, 3])
    line = text.splitlines()[2]
    assert line == "| c | after % | **80.0** | 10.0 | 90.0 | 70.0 | 80.0 |  | 60.5 | `cmd demo` |"
    assert text.splitlines()[3].startswith("| c | gain | **0.3** | 0.1 | 0.4 | 0.2 | 0.3 |")


def test_kl_estimators_zero_for_identical_models_and_aligned_with_sampler(tmp_path):
    """Policy == reference: exact KL, k1 and k3 are 0 at every token; the recomputed log-probs
    of the sampled tokens equal the sampler's (the positions are aligned)."""
    claims = _claims()
    from posttrain.models.loading import save_checkpoint
    from posttrain.tasks.arithmetic import prompt_rows, write_jsonl
    from posttrain.tasks.tiny import build_tiny_llama
    from posttrain.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    for name, seed in (("a", 0), ("b", 1)):
        save_checkpoint(build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2,
                                         intermediate_size=64, seed=seed), tok, tmp_path / name)
    write_jsonl(prompt_rows(6, 0), tmp_path / "prompts.jsonl")
    same = claims.kl_estimators(str(tmp_path / "a"), {"sft": str(tmp_path / "a"),
                                                      "data": str(tmp_path)}, 3, 0)
    assert same["kl_tokens"] > 0
    for key in ("kl_exact", "k1_mean", "k3_mean", "k1_var", "k3_var"):
        assert same[key] == pytest.approx(0.0, abs=1e-9), key
    assert same["sampler_gap_max"] < 1e-4
    other = claims.kl_estimators(str(tmp_path / "a"), {"sft": str(tmp_path / "b"),
                                                       "data": str(tmp_path)}, 3, 0)
    assert other["kl_exact"] > 0 and other["k3_mean"] > 0 and other["k1_var"] > 0
    assert other["sampler_gap_max"] < 1e-4
    json.dumps(other)  # cached as JSON


# ---------------------------------------------------------------------------------------------
# the verifiers job: best-of-N at several N, its error analysis, the splits, the arguments
# ---------------------------------------------------------------------------------------------
def _verifiers():
    _claims()  # puts benchmarks/ on sys.path
    import claims_verifiers

    return claims_verifiers


class _FakePRM:
    """Step scores fixed by a table (completion -> scores), else drawn from the text."""

    def __init__(self, table=None):
        self.table = table or {}

    def split(self, completion):
        from posttrain.data.steps import split_steps

        return split_steps(completion)

    def step_scores(self, prompts, completions):
        import random

        out = []
        for c in completions:
            rng = random.Random(c)
            out.append(self.table.get(c, [rng.random() for _ in self.split(c)]))
        return out


def _fake_samples(n: int, seed: int = 0):
    """n samples for each of 5 held-out problems: reference traces, traces with injected
    errors and one completion without an answer."""
    import random

    from posttrain.search import build_samples
    from posttrain.tasks.arithmetic import format_trace, heldout_rows, parse_problem, trace_steps

    rng = random.Random(seed)
    rows = heldout_rows(5, seed)
    completions = []
    for r in rows:
        p, row = parse_problem(r["prompt"]), []
        for _ in range(n):
            if rng.random() < 0.05:
                row.append("no answer here")
                continue
            steps, _, final = trace_steps(p, rng, error_rate=rng.choice((0.0, 0.3, 0.6)))
            row.append(format_trace(steps, final))
        completions.append(row)
    samples = build_samples([r["prompt"] for r in rows], [r["answer"] for r in rows],
                            completions, [[10] * n for _ in rows])
    orm = [[rng.random() for _ in row] for row in completions]
    return samples, orm


def test_best_of_n_rows_consistent_at_every_n():
    cv = _verifiers()
    assert cv.bon_ns(64) == [1, 4, 16, 64] and cv.bon_ns(16) == [1, 4, 16]
    samples, orm = _fake_samples(16)
    got = cv.analyse(samples, orm, _FakePRM(), 16)
    methods = ("majority", "orm", "prm_min", "prm_prod", "prm_last", "weighted_prm_prod")
    for n in (1, 4, 16):
        for m in methods:
            assert got[f"bon_{m}@{n}"] <= got[f"bon_pass@{n}"], (m, n)
    share = sum(map(sum, samples.correct)) / sum(map(len, samples.correct))
    assert 0.2 < share < 0.9  # a mix: the comparisons below are not vacuous
    for m in methods:  # one sample to pick from: every selector picks it
        assert got[f"bon_{m}@1"] == pytest.approx(share)
    assert got["bon_pass@1"] <= got["bon_pass@4"] <= got["bon_pass@16"]
    assert not any(k.startswith("bon_") and k.endswith("@64") for k in got)
    assert any(got[f"bon_{m}@16"] < got["bon_pass@16"] for m in methods)  # random scores
    for m in methods:
        wrong = got[f"err_{m}@16_wrong"]
        assert wrong == pytest.approx(5 * (1 - got[f"bon_{m}@16"]))  # 5 trials at N = 16
        avoidable = got[f"err_{m}@16_avoidable"]
        assert math.isnan(avoidable) if wrong == 0 else 0 <= avoidable <= 1
    assert "err_orm@64_wrong" not in got and 0 <= got["prm_search_f1"] <= 1
    # the product aggregation really is the product of the PRM's step scores
    prm = _FakePRM()
    steps = cv.step_score_table(prm, samples)
    prod = cv.selection_scores(orm, steps)["prm_prod"]
    c = samples.completions[0][0]
    assert prod[0][0] == pytest.approx(math.prod(prm.step_scores([None], [c])[0]))


def test_error_analysis_by_hand():
    """One problem, four samples; groups of 2 (samples 0-1, 2-3) and of 4."""
    cv = _verifiers()
    from posttrain.search import build_samples

    good = "<think>12+7=19; 19*3=57; 57-5=52</think><answer>52</answer>"
    late = "<think>12+7=19; 19*3=56; 56-5=51</think><answer>51</answer>"  # wrong at step 1
    early = "<think>12+7=18; 18*3=54; 54-5=49</think><answer>49</answer>"  # wrong at step 0
    blank = "<think>12+7=19</think>"  # no answer: no vote, no pick by majority
    samples = build_samples(["12+7*3-5"], ["52"], [[good, late, early, blank]], [[1] * 4])
    prm = _FakePRM({good: [0.9, 0.9, 0.9, 0.9], late: [0.9, 0.8, 0.3, 0.3],
                    early: [0.2, 0.9, 0.9, 0.9], blank: [0.9, 0.1]})
    steps = cv.step_score_table(prm, samples)
    # the ORM ranks both wrong samples first: picks late (group 1, beside good), early (group 2)
    scores = cv.selection_scores([[0.1, 0.9, 0.8, 0.0]], steps)
    got = cv.error_analysis(samples, scores, steps, prm.split, 2)
    assert got["err_orm@2_wrong"] == 2
    assert got["err_orm@2_avoidable"] == 0.5  # group 1 held `good`, group 2 no correct sample
    assert got["err_orm@2_missed"] == 0.5  # late's first wrong step 0.8: missed; early's 0.2
    # PRM min: group 1 good (0.9) over late (0.3); group 2 early (0.2) over blank (0.1): wrong
    assert got["err_prm_min@2_wrong"] == 1 and got["err_prm_min@2_avoidable"] == 0.0
    assert got["err_prm_min@2_missed"] == 0.0
    # PRM last: group 1 good (0.9) over late (0.3); group 2 early (0.9) over blank (0.1)
    assert got["err_prm_last@2_wrong"] == 1
    # majority at 4: 52, 51, 49 once each: the first answer wins (good)
    got4 = cv.error_analysis(samples, scores, steps, prm.split, 4)
    assert got4["err_majority@4_wrong"] == 0
    assert math.isnan(got4["err_majority@4_missed"]) and math.isnan(
        got4["err_majority@4_avoidable"])
    assert got4["err_orm@4_wrong"] == 1 and got4["err_orm@4_avoidable"] == 1.0
    assert got4["err_orm@4_missed"] == 1.0
    assert cv.first_wrong_step_missed("12+7*3-5", prm.split(good), [0.9] * 4) is None
    assert cv.first_wrong_step_missed("12+7*3-5", prm.split(early), [0.2, 1, 1, 1]) is False


def _result(seed: int) -> dict:
    cv = _verifiers()
    samples, orm = _fake_samples(16, seed)
    return {"orm_pair_accuracy": 0.8, "prm_bad_f1": 0.7, "label_accuracy": 0.5,
            "prm_exact_f1": 0.6, "prm_mc_f1": 0.6, "mc_agreement": 0.9, "prm_f1_2x0": 0.5,
            "seconds": 1.0, **cv.analyse(samples, orm, _FakePRM(), 16)}


def test_table_rows_of_both_splits(tmp_path):
    claims = _claims()
    s = {**claims.SETTINGS["quick"], "prm_budgets": [[2, 0]]}
    specs = claims.metrics(s, "cmd")
    hard = [m for m in specs if m["job"].endswith("_hard")]
    assert {m["job"] for m in hard} == {"demo_hard", "verifiers_hard", "process_hard"}
    assert all(m["command"].endswith("--split hard") and "[hard split]" in m["claim"]
               for m in hard)
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    for name, seed in (("verifiers", 0), ("verifiers", 1), ("verifiers_hard", 0),
                       ("demo_hard", 0), ("process_hard", 0)):
        r = _result(seed) if name.startswith("verifiers") else {
            "after": 0.3, "before": 0.2, "process_after": 0.25, "seconds": 1.0,
            "curve": [[0, 0.2], [20, 0.28], [30, 0.29], [60, 0.3]]}
        (jobs / f"{name}_s{seed}.json").write_text(json.dumps(r))
    per_seed = claims.load_cached(tmp_path, [0, 1], 20)
    assert per_seed["process_hard"][0]["outcome_after"] == 0.28  # the hard demo, step 20
    assert claims.load_cached(tmp_path, [0], 40)["process_hard"][0]["outcome_after"] == 0.3
    for spec in specs:
        spec["key"] = spec["key"] or "outcome_after"
    rows = claims.table_rows(per_seed, specs)
    by = {(r["claim"], r["metric"]): r for r in rows}
    bon = "best-of-N, 100 held-out problems x 16 samples"
    for n in (1, 4, 16):
        for metric in ("majority vote", "ORM best-of-N", "PRM best-of-N, min",
                       "PRM best-of-N, product", "PRM best-of-N, last step",
                       "PRM-weighted vote (product)", "pass@N (oracle)"):
            assert set(by[(bon, f"{metric} @{n} %")]["values"]) == {0, 1}
            assert set(by[(bon + " [hard split]", f"{metric} @{n} %")]["values"]) == {0}
    assert (bon, "ORM best-of-N @64 %") not in by
    assert ("PRM training budget, 600 problems x 4 samples", "PRM bad-step F1, 2 steps, "
            "all label rows") in by
    assert any(m == "ORM @16: first wrong step scored >= 0.5 by the PRM %" for _, m in by)
    assert not any(r["metric"] == "PRM + RLVR, final %" for r in rows)  # a key no run has


def test_arguments_seed_split_and_budget():
    claims = _claims()
    args, s, units = claims.parse(["--out", "x", "--only", "verifiers", "--seed", "7"])
    assert s["seeds"] == [7] and args.seed == 7 and units == [("verifiers", "easy")]
    assert s["bon_n"] == 64 and _verifiers().bon_ns(s["bon_n"]) == [1, 4, 16, 64]  # full budget
    _, s, units = claims.parse(["--out", "x", "--quick", "--only", "verifiers,process",
                                "--split", "easy,hard", "--seeds", "0,2"])
    assert s["seeds"] == [0, 2] and s["bon_n"] == 16
    assert units == [("verifiers", "easy"), ("process", "easy"), ("verifiers", "hard"),
                     ("process", "hard")]
    for bad in (["--seed", "1", "--seeds", "1,2"], ["--split", "hard", "--only", "dpo"],
                ["--split", "medium"], ["--seed", "one"]):
        with pytest.raises(SystemExit):
            claims.parse(["--out", "x", *bad])
    assert claims.job_id("verifiers", "easy") == "verifiers"
    assert claims.job_id("verifiers", "hard") == "verifiers_hard"


def test_split_world_writes_the_hard_data(tmp_path):
    claims = _claims()
    from posttrain.tasks.arithmetic import parse_problem

    world = {"sft": "m", "data": "d"}
    assert claims.split_world(world, "easy", tmp_path) is world
    hard = claims.split_world(world, "hard", tmp_path)
    assert hard["sft"] == "m" and hard["data"] == str(tmp_path / "data_hard")
    held = [json.loads(x) for x in (tmp_path / "data_hard" / "heldout.jsonl").open()]
    assert len(held) == 1000 and all(len(parse_problem(r["prompt"]).ops) == 4 for r in held)
    assert sum(1 for _ in (tmp_path / "data_hard" / "prompts.jsonl").open()) == 20_000
    keys = claims._rl_keys(hard, {"eval_size": 5, "split": "hard"}, tmp_path, 0, 3)
    assert keys["max_new_tokens"] == keys["eval_max_new_tokens"] == 64
    assert "max_new_tokens" not in claims._rl_keys(world, {"eval_size": 5}, tmp_path, 0, 3)
