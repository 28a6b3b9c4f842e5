"""The first run's phase helpers that benchmarks/ and experiments/ still use (swectl/train/first_run.py; `swectl up`
runs the recipe file, tests/test_recipe.py) without running them: its settings are keys the config has,
its numbers come from ``--set recipe.KEY=VALUE`` and a resumed run's recipe.json, its table and the `swectl up`
choices around it. The whole run, shrunk, is tests/integration/test_first_run.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from swectl.config import load_config
from swectl.errors import ConfigError
from swectl.images.project import BUNDLED_TASKS
from swectl.train import first_run
from swectl.train.first_run import (
    Recipe,
    Summary,
    expected_s,
    load_recipe,
    overrides,
    set_flags,
    sft_speed,
    summary_table,
)


def test_the_recipe_sets_only_keys_the_config_has_and_they_decode(tmp_path: Path) -> None:
    recipe = Recipe(tasks=str(tmp_path / "tasks.jsonl"))
    sft = load_config(None, overrides({**recipe.rollout_sets(), **recipe.sft_sets(tmp_path / "m", ["a", "b"])}))
    assert sft.train.algorithm == "sft" and sft.train.steps == recipe.sft_steps
    assert sft.train.data.sft_data == ["a", "b"] and sft.train.data.sft_resolved_only is False
    assert sft.rollout.step_limit == recipe.step_limit and sft.rollout.max_tokens == recipe.max_tokens
    grpo = load_config(None, overrides({**recipe.rollout_sets(), **recipe.grpo_sets(tmp_path / "w")}))
    assert grpo.train.algorithm == "grpo" and grpo.train.steps == recipe.grpo_steps
    assert grpo.train.model == str(tmp_path / "w") and grpo.train.loss.kl_coef == recipe.kl_coef
    assert grpo.train.data.split_seed == recipe.seed and grpo.train.data.test_fraction == recipe.test_fraction
    assert grpo.train.data.tasks == recipe.tasks  # GRPO splits the same task file the readings read
    assert "FormatError" in grpo.train.loss.mask_truncated_endings
    recorded = load_config(None, overrides(recipe.grpo_sets(tmp_path / "w", tmp_path / "train.jsonl")))
    assert recorded.train.data.tasks == str(tmp_path / "train.jsonl") and recorded.train.data.test_fraction == 0


def test_grpo_on_the_recorded_train_split_draws_the_tasks_of_its_own_split(tmp_path: Path) -> None:
    """The split is made once (train.jsonl): GRPO trained on that file whole draws the same tasks in the same order
    as GRPO that split the bundled tasks itself with the same seed, so the first run trains as it did."""
    from swectl.actors.data_source import DataSource, split_tasks
    from swectl.images.project import BUNDLED_TASKS
    from swectl.tasks.sources import load_tasks

    recipe = Recipe(seed=3)
    train, _ = first_run.write_split(tmp_path, recipe)
    resplit, _ = split_tasks(load_tasks(str(BUNDLED_TASKS)).tasks, recipe.test_fraction, recipe.seed)
    whole, held_out = split_tasks(load_tasks(str(tmp_path / "train.jsonl")).tasks, 0.0, recipe.seed)
    assert not held_out and sorted(t.instance_id for t in whole) == sorted(t.instance_id for t in train)

    def drawn(tasks: list) -> list[str]:
        return [t.instance_id for t in DataSource(tasks, seed=recipe.seed).next(3 * len(tasks))]

    assert drawn(whole) == drawn(resplit)


def test_a_short_sft_warms_up_for_fewer_steps_than_it_has(tmp_path: Path) -> None:
    for steps in (1, 2, 3, 400):
        config = load_config(None, overrides(Recipe(sft_steps=steps).sft_sets(tmp_path, ["gold"])))
        assert config.train.optim.warmup_steps < max(steps, 2)


def test_grpo_is_asynchronous_on_a_one_thread_trainer_unless_the_recipe_says_synchronous(tmp_path: Path) -> None:
    cores = os.cpu_count() or 1
    for recipe, staleness, threads in ((Recipe(), 1, 1), (Recipe(max_staleness=0), 0, cores),
                                       (Recipe(grpo_trainer_threads=3), 1, 3)):
        config = load_config(None, overrides(recipe.grpo_sets(tmp_path / "w")))
        assert config.train.sampling.max_staleness == staleness and config.trainer.threads_per_rank == threads
    sft = load_config(None, overrides(Recipe().sft_sets(tmp_path / "m", ["gold"])))
    assert sft.trainer.threads_per_rank == cores  # SFT trains alone: every core


def test_the_noisy_teacher_off_trains_on_resolved_gold_only(tmp_path: Path) -> None:
    sets = Recipe(give_up=0).sft_sets(tmp_path, ["gold"])
    assert load_config(None, overrides(sets)).train.data.sft_resolved_only is True


def test_recipe_overrides_and_a_resumed_runs_recipe(tmp_path: Path) -> None:
    assert load_recipe(tmp_path, {"sft_steps": 7}).sft_steps == 7
    (tmp_path / first_run.RECIPE_FILE).write_text(json.dumps({"seed": 3, "grpo_steps": 4}))
    recipe = load_recipe(tmp_path, {"grpo_steps": 5})
    assert (recipe.seed, recipe.grpo_steps) == (3, 5)  # saved, then overridden


def test_an_unknown_or_mistyped_recipe_key_is_a_config_error_naming_the_keys(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"sft_stepz.*the keys are seed, tasks"):
        load_recipe(tmp_path, {"sft_stepz": 7})
    with pytest.raises(ConfigError, match="sft_steps"):
        load_recipe(tmp_path, {"sft_steps": "many"})


def test_the_table_gives_both_readings_the_gain_and_where_things_are(tmp_path: Path) -> None:
    reading = {"resolve_rate": 0.25, "resolved": 18, "episodes": 72}
    summary = Summary(seed=2, sft_train_resolve_rate=0.25, grpo_train_resolve_rate=0.5, test_resolve_rate=0.0,
                      gain_points=25.0, gain_noise_points=7.7, minutes=24.5, phases_s={"sft": 300.0},
                      readings={"sft_train": reading, "grpo_train": {**reading, "resolve_rate": 0.5, "resolved": 36},
                                "test": {**reading, "resolve_rate": 0.0, "resolved": 0, "episodes": 36}},
                      run_dir=str(tmp_path), recipe={})
    text = "\n".join(summary_table(summary))
    assert "train split after SFT         25.0%  (18/72 episodes)" in text
    assert "train split after GRPO        50.0%  (36/72 episodes)" in text
    assert "+25.0 points (one standard error 7.7)" in text and "24.5 min (seed 2)" in text
    assert f"swectl view {tmp_path / 'grpo'}" in text and "sft 5.0" in text
    assert "machine speed" not in text  # not known: no line


def test_the_machine_speed_comes_from_the_sft_steps_and_shows_in_the_table(tmp_path: Path) -> None:
    assert sft_speed(tmp_path) == (0.0, 0.0)  # no SFT run yet
    (tmp_path / "sft").mkdir()
    rows = [{"step": n, "step_s": s, "train_tokens_per_s": t} for n, (s, t) in
            enumerate([(9.0, 900.0), (1.5, 4000.0), (1.6, 4200.0), (1.7, 4100.0)], 1)]
    (tmp_path / "sft" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert sft_speed(tmp_path) == (1.65, 4050.0)  # medians: the slow first step does not count much
    reading = {"resolve_rate": 0.25, "resolved": 18, "episodes": 72}
    summary = Summary(seed=2, sft_train_resolve_rate=0.25, grpo_train_resolve_rate=0.25, test_resolve_rate=0.0,
                      gain_points=0.0, gain_noise_points=7.2, minutes=24.5, phases_s={}, run_dir=str(tmp_path),
                      readings={"sft_train": reading, "grpo_train": reading, "test": reading}, recipe={},
                      sft_step_s=1.65, sft_tokens_per_s=4120.0)
    assert "machine speed: SFT took 1.65 s a step (4.1k tokens/s)" in "\n".join(summary_table(summary))


def test_set_flags_pairs_each_key_with_its_value() -> None:
    assert set_flags({"a.b": 1, "c": '"x"'}) == ["--set", "a.b=1", "--set", 'c="x"']


def test_a_recipe_naming_a_split_with_an_empty_side_is_refused(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(BUNDLED_TASKS.read_text().splitlines()[0] + "\n")
    with pytest.raises(ConfigError, match="both splits need one"):
        first_run.write_split(tmp_path, Recipe(tasks=str(tasks)))



def test_the_eta_scales_an_earlier_run_on_this_machine_by_the_recipes_work(tmp_path: Path) -> None:
    past_s = [13.0, 48.0, 705.0, 157.0, 509.0, 120.0, 87.0]
    assert expected_s(Recipe(), past_s, Recipe()) == past_s
    shorter = expected_s(Recipe(sft_steps=200, grpo_steps=10, eval_samples=8), past_s, Recipe())
    assert shorter[2] == past_s[2] / 2 and shorter[4] == past_s[4] / 2
    assert shorter[3] == past_s[3] * 2 and shorter[:2] == past_s[:2]
    assert first_run.previous_run(tmp_path, tmp_path / "new") is None  # a fresh machine: no estimate
    old = tmp_path / "old"
    old.mkdir()
    (old / first_run.RECIPE_FILE).write_text("{}")
    phases = dict(zip(first_run.PHASE_KEYS, past_s, strict=True))
    (old / first_run.SUMMARY_FILE).write_text(json.dumps({"run_dir": str(old), "phases_s": phases,
                                                          "recipe": {"sft_steps": 200}, "seed": 1}))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / first_run.RECIPE_FILE).write_text("{}")
    (tmp_path / "broken" / first_run.SUMMARY_FILE).write_text("{not json")
    found = first_run.previous_run(tmp_path, tmp_path / "new")
    assert found is not None and found[0] == past_s and found[1].sft_steps == 200 and found[2] == old
    assert first_run.previous_run(tmp_path, old) is None  # a run never estimates from itself
