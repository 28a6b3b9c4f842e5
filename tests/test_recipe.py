"""Recipes (swectl/train/recipe.py, run by swectl/cli/phases.py) without training: the bundled and the suites' recipes
check against the config, the first run's file pins the first run's settings, extends / like / drop, templates and
vars, the refusals, the ETA's critical path, and a small recipe of real commands (plot) run with siblings, logs and a
resume. The whole first run, shrunk, is tests/integration/test_first_run.py."""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

import anyio
import pytest

from swectl import logs
from swectl.cli import up
from swectl.cli.main import main
from swectl.cli.phases import check, run_recipe
from swectl.errors import ConfigError
from swectl.train import recipe as recipes

RUN = Path("/runs/r")


def _phase_config(recipe: recipes.Recipe, name: str):
    command = check(recipe, RUN, [])[name]
    return command.config(None)


SUITE_RECIPES = sorted([*Path("benchmarks/recipes").glob("*.toml"), *Path("experiments/recipes").glob("*.toml")])


def test_every_bundled_and_suite_recipe_checks_against_the_config() -> None:
    paths = [*sorted(recipes.RECIPES_DIR.glob("*.toml")), *SUITE_RECIPES]
    assert len(SUITE_RECIPES) >= 3  # hack, chaos, learn
    for path in paths:
        recipe = recipes.load(str(path), {})
        assert set(check(recipe, RUN, [])) == {p.name for p in recipe.file.phase}, path


def test_the_prm_recipe_labels_episodes_trains_a_judge_and_serves_it_to_grpo() -> None:
    """experiments/recipes/prm.toml: a judge-data phase is `swectl data judge RUNS... --out FOLDER/judge.jsonl`, the
    judge trains on that file, and the GRPO phase's [reward.prm] serves the judge's final weights from the policy,
    with the first run's episode settings and no split held out."""
    recipe = recipes.load("experiments/recipes/prm.toml", {"tasks": "/d/train.jsonl", "judge_data": ["/a", "/b"],
                                                           "policy": "/sft/w", "judge_steps": 7})
    commands = check(recipe, RUN, [])
    assert commands["judge-data"].argv == ["data", "judge", "/a", "/b", "--tasks", "/d/train.jsonl", "--out",
                                           str(RUN / "judge-data" / "judge.jsonl")]
    judge = _phase_config(recipe, "judge")
    assert (judge.train.algorithm, judge.train.model, judge.train.steps) == ("sft", "/sft/w", 7)
    assert judge.train.data.sft_data == [str(RUN / "judge-data" / "judge.jsonl")]
    grpo = _phase_config(recipe, "grpo-prm")
    assert (grpo.train.algorithm, grpo.train.model, grpo.reward.prm.enabled) == ("grpo", "/sft/w", True)
    assert grpo.reward.prm.model == str(RUN / "judge" / "weights" / "final")
    assert (grpo.train.sampling.max_staleness, grpo.train.loss.kl_coef, grpo.rollout.step_limit) == (0, 0.0, 6)
    assert (recipe.file.split.test_fraction if recipe.file.split else None) in (0.0, "{test_fraction}")
    assert recipe.vars["test_fraction"] == 0.0


def test_the_first_run_file_pins_the_first_runs_settings() -> None:
    """The numbers the first run was measured with (docs/results.md), as the SFT and GRPO phases' configs get them:
    a change to first-run.toml that moves one is a new first run, and its results entry must say so."""
    recipe = recipes.load("first-run", {})
    sft = _phase_config(recipe, "sft")
    assert (sft.train.algorithm, sft.train.steps, sft.train.model) == ("sft", 400, str(RUN / "model"))
    assert sft.train.data.sft_data == [str(RUN / "sft-data" / s) for s in ("gold", "give-up", "recover")]
    assert (sft.train.data.sft_batch_size, sft.train.data.sft_resolved_only) == (8, False)
    assert (sft.train.optim.lr, sft.train.optim.warmup_steps, sft.train.optim.schedule) == (2e-3, 3, "constant")
    assert sft.trainer.threads_per_rank == (os.cpu_count() or 1)
    grpo = _phase_config(recipe, "grpo")
    assert (grpo.train.algorithm, grpo.train.steps, grpo.train.model) == (
        "grpo", 40, str(RUN / "sft" / "weights" / "final"))
    assert (grpo.train.optim.lr, grpo.train.optim.schedule, grpo.train.loss.kl_coef) == (2e-4, "cosine", 0.5)
    sampling = grpo.train.sampling
    assert (sampling.tasks_per_step, sampling.n_samples, sampling.max_staleness) == (4, 4, 1)
    assert (grpo.train.data.tasks, grpo.train.data.test_fraction) == (str(RUN / "train.jsonl"), 0.0)
    assert grpo.train.loss.mask_truncated and grpo.train.loss.mask_format_errors
    assert (grpo.trainer.threads_per_rank, grpo.env_pool.warm, grpo.engine.max_batch) == (1, 0, 16)
    assert (grpo.rollout.step_limit, grpo.rollout.max_tokens, grpo.rollout.agent_config) == (6, 192, "compact")
    commands = check(recipe, RUN, [])
    reading = commands["eval-sft"].argv
    assert reading[:3] == ["eval", "--model", str(RUN / "sft" / "weights" / "final")] and "--fresh" in reading
    assert reading[reading.index("--samples") + 1] == "12"
    assert commands["sft-data"].argv[:6] == ["data", "gold", "--script", "gold", "--script", "give-up"]


def test_a_recipe_extends_another_changing_copying_and_dropping_phases(tmp_path: Path) -> None:
    child = tmp_path / "child.toml"
    child.write_text('''extends = "first-run"
drop = ["eval-test", "plot"]
[vars]
grpo_steps = 3
extra = 7
[[phase]]
name = "sft"
config = { train = { optim = { lr = 1e-3 } } }
[[phase]]
name = "grpo-zero"
like = "grpo"
config = { experiment = { zero_advantages = true } }
[report]
reading = [{ name = "grpo_train", phase = "eval-grpo", label = "renamed" }]
''')
    recipe = recipes.load(str(child), {})
    names = [p.name for p in recipe.file.phase]
    assert names == ["model", "sft-data", "sft", "eval-sft", "grpo", "eval-grpo", "grpo-zero"]
    assert (recipe.vars["grpo_steps"], recipe.vars["extra"], recipe.vars["sft_steps"]) == (3, 7, 400)
    sft = _phase_config(recipe, "sft")
    assert (sft.train.optim.lr, sft.train.optim.schedule, sft.train.steps) == (1e-3, "constant", 400)  # merged
    zero = _phase_config(recipe, "grpo-zero")
    grpo = _phase_config(recipe, "grpo")
    assert zero.experiment.zero_advantages and not grpo.experiment.zero_advantages
    assert zero.train.steps == grpo.train.steps == 3 and recipe.phase("grpo-zero").after == ["sft"]
    report = recipe.file.report
    assert report is not None and [r.name for r in report.reading] == ["sft_train", "grpo_train"]  # test dropped
    assert report.reading[1].label == "renamed" and report.gain == ["sft_train", "grpo_train"]


def test_extends_refuses_what_it_cannot_mean(tmp_path: Path) -> None:
    def refused(text: str, match: str) -> None:
        (tmp_path / "r.toml").write_text(text)
        with pytest.raises(ConfigError, match=match):
            recipes.load(str(tmp_path / "r.toml"), {})

    refused('extends = "first-run"\ndrop = ["nope"]\n', r"drop names nope, not phases of the recipe it extends")
    refused('extends = "first-run"\n[[phase]]\nname = "x"\nlike = "nope"\n', r"like names 'nope'")
    refused('extends = "first-run"\n[[phase]]\nname = "grpo"\nlike = "sft"\n', r"like makes a new phase")
    refused('drop = ["sft"]\n[[phase]]\nname = "a"\nkind = "plot"\n', r"extends none")
    refused('extends = "r.toml"\n', r"extends itself")
    refused('extends = "missing.toml"\n', r"recipe missing.toml: no such file")
    # dropping what a kept phase waits for is the phases' own check
    refused('extends = "first-run"\ndrop = ["sft"]\n', r"phase eval-sft waits for 'sft', which is not a phase")
    (tmp_path / "base.toml").write_text('[[phase]]\nname = "a"\nkind = "plot"\nargs = { run_dir = "/x" }\n')
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "r.toml").write_text('extends = "../base.toml"\n')  # relative to the file that extends
    assert [p.name for p in recipes.load(str(tmp_path / "sub" / "r.toml"), {}).file.phase] == ["a"]


def test_load_drops_phases_for_a_caller() -> None:
    recipe = recipes.load("first-run-control", {}, drop=["grpo-shuffled", "eval-shuffled"])
    assert "grpo-shuffled" not in {p.name for p in recipe.file.phase}
    assert recipe.file.report is not None and recipe.file.report.control == []


def test_templates_keep_types_fill_strings_and_escape_braces() -> None:
    names = {"steps": 4, "run": "/r", "tags": ["a"]}
    assert recipes.fill("{steps}", names, "x") == 4
    assert recipes.fill("{run}/sft after {steps}", names, "x") == "/r/sft after 4"
    assert recipes.fill({"a": ["{tags}", "{{literal}}"]}, names, "x") == {"a": [["a"], "{literal}"]}
    with pytest.raises(ConfigError, match=r"where: \{nope\} is not a var"):
        recipes.fill("{nope}", names, "where")


def test_vars_are_overridden_by_name_and_type_and_may_name_each_other() -> None:
    recipe = recipes.load("first-run", {"seed": 3, "sft_steps": 7})
    assert (recipe.vars["seed"], recipe.vars["eval_seed"], recipe.vars["sft_steps"]) == (3, 3, 7)
    assert recipe.vars["sft_trainer_threads"] == (os.cpu_count() or 1)  # {cores}
    # a var that names another has that one's type: eval_seed ("{seed}") takes an integer
    assert recipes.load("first-run", {"seed": 3, "eval_seed": 9}).vars["eval_seed"] == 9
    with pytest.raises(ConfigError, match=r"eval_seed.*is int"):
        recipes.load("first-run", {"eval_seed": "nine"})
    with pytest.raises(ConfigError, match=r"no var sft_stepz \(its vars: seed, tasks"):
        recipes.load("first-run", {"sft_stepz": 7})
    with pytest.raises(ConfigError, match=r"sft_steps.*is int"):
        recipes.load("first-run", {"sft_steps": "many"})


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "r.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(("text", "error"), [
    ('[[phase]]\nname = "a"\nkind = "plot"\nafter = ["b"]\n', "waits for 'b', which is not a phase above it"),
    ('[[phase]]\nname = "a"\nkind = "plot"\n[[phase]]\nname = "a"\nkind = "plot"\n', "not used twice"),
    ('[[phase]]\nname = "t"\nkind = "train"\n[[phase]]\nname = "e"\nkind = "eval"\nargs = {model = "{t.weights}"}\n',
     r"names \{t.weights\} but does not wait for t"),
    ('[[phase]]\nname = "a"\nkind = "shell"\n', "Invalid enum value 'shell'"),
    ('[[phase]]\nname = "a"\nkind = "plot"\n[report]\nreading = [{name = "x", phase = "a"}]\n', "not an eval phase"),
    ("description = 1\n", "Expected `str`"),
    ("[[phase]\n", "invalid TOML"),
])
def test_a_malformed_recipe_is_refused_saying_what(tmp_path: Path, text: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        recipes.read_recipe(_write(tmp_path, text))


def test_a_phase_whose_config_or_flags_are_wrong_stops_the_check(tmp_path: Path) -> None:
    bad_key = recipes.load(_write(tmp_path, '[[phase]]\nname = "t"\nkind = "train"\nconfig = {train = {lr = 1}}\n'),
                           {})
    with pytest.raises(ConfigError, match=r"train\.optim\.lr"):
        check(bad_key, tmp_path, [])
    bad_flag = recipes.load(_write(tmp_path, '[[phase]]\nname = "e"\nkind = "eval"\nargs = {no_such = 1}\n'), {})
    with pytest.raises(ConfigError, match="not a command line swectl takes"):
        check(bad_flag, tmp_path, [])


def test_the_time_left_follows_the_critical_path() -> None:
    recipe = recipes.load("first-run", {})
    seconds = {p.name: 10.0 for p in recipe.file.phase}
    seconds["grpo"] = 100.0
    # model, sft-data, sft, then grpo (100) beside eval-sft (10), then the GRPO reading (10): 140
    assert recipes.seconds_left(recipe, seconds, set()) == 140.0
    done = {"model", "sft-data", "sft", "eval-sft", "grpo"}
    assert recipes.seconds_left(recipe, seconds, done) == 10.0
    past = {name: recipes.PhaseRecord(seconds=s, argv=[], size=2.0) for name, s in seconds.items()}
    assert recipes.expected_s(recipe, {name: 1.0 for name in seconds}, past)["grpo"] == 50.0


def _metrics_run(folder: Path) -> None:
    folder.mkdir(parents=True)
    rows = [{"step": n, "loss": 1.0 / n, "step_s": 1.0, "train_tokens_per_s": 10.0} for n in range(1, 4)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


RECIPE = """
[vars]
who = "a"
[[phase]]
name = "plot-a"
kind = "plot"
args = { run_dir = "{run}/../metrics-{who}" }
[[phase]]
name = "plot-b"
kind = "plot"
output = "log"
args = { run_dir = "{run}/../metrics-a", out = "{run}/curves-b" }
[[phase]]
name = "broken"
kind = "plot"
after = ["plot-a", "plot-b"]
optional = true
args = { run_dir = "{run}/../no-such-run" }
"""


def test_a_recipe_runs_its_phases_records_them_and_keeps_them_on_resume(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    _metrics_run(tmp_path / "metrics-a")
    recipe = recipes.load(_write(tmp_path, RECIPE), {})
    run = tmp_path / "run"
    said: list[str] = []
    with logs.configure(0):
        summary = anyio.run(run_recipe, recipe, run, [], said.append)
    records = recipes.read_records(run)
    assert set(records) == {"plot-a", "plot-b"}  # the optional one failed, was said, and the run went on
    assert records["plot-b"].argv[:2] == ["plot", str(run / "../metrics-a")]
    assert any(line.startswith("[1/3] plot-a:") for line in said)
    assert any("broken:" in line and "optional: the run goes on" in line for line in said)
    assert "curves-b" in (run / "plot-b.log").read_text()  # the beside phase printed into its log
    assert "curves-b" not in capsys.readouterr().out
    assert summary.readings == {} and set(summary.phases_s) == {"plot-a", "plot-b"}
    assert json.loads((run / recipes.RECIPE_FILE).read_text())["vars"] == {"who": "a"}
    said.clear()
    with logs.configure(0):
        anyio.run(run_recipe, recipes.saved_recipe(run, {}), run, [], said.append)
    assert any("2 finished phases are kept" in line for line in said)
    assert not [line for line in said if line.startswith(("[1/3]", "[2/3]"))]  # nothing ran again


def test_sibling_phases_keep_their_records_and_output_apart(tmp_path: Path) -> None:
    """Two commands at once in one event loop: each run file takes its own scope's records, and each output stream
    its own lines."""
    log = logging.getLogger("swectl.test")
    streams = {name: (tmp_path / f"{name}.out").open("w") for name in ("a", "b")}

    async def phase(name: str, started: anyio.Event, other: anyio.Event) -> None:
        with logs.run_files_scope(), logs.output_to(streams[name]):
            logs.write_run_log(tmp_path / name)
            started.set()
            await other.wait()  # both scopes are open at once
            log.info("record of %s", name)
            print(f"line of {name}", file=logs.err())

    async def both() -> None:
        a, b = anyio.Event(), anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(phase, "a", a, b)
            tg.start_soon(phase, "b", b, a)

    with logs.configure(0):
        anyio.run(both)
    for stream in streams.values():
        stream.close()
    for name, other in (("a", "b"), ("b", "a")):
        text = (tmp_path / name / logs.RUN_LOG).read_text()
        assert f"record of {name}" in text and f"record of {other}" not in text
        printed = (tmp_path / f"{name}.out").read_text()
        assert f"line of {name}" in printed and f"line of {other}" not in printed


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up.add_parser(parser.add_subparsers())
    return parser.parse_args(["up", *argv])


def test_which_runs_are_recipe_runs(tmp_path: Path) -> None:
    assert up._recipe_asked(_args([]))
    assert up._recipe_asked(_args(["--recipe", "train"]))
    assert not up._recipe_asked(_args(["cluster.toml"]))
    single = tmp_path / "single"
    single.mkdir()
    assert not up._recipe_asked(_args(["--resume", str(single)]))
    (tmp_path / "first").mkdir()
    (tmp_path / "first" / recipes.RECIPE_FILE).write_text("{}")
    assert up._recipe_asked(_args(["--resume", str(tmp_path / "first")]))


def test_steps_with_the_first_run_says_which_vars_to_set(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--steps", "3"]) == 2
    assert "has 2 train phases" in capsys.readouterr().err


def test_a_recipe_and_a_config_file_at_once_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "cluster.toml", "--recipe", "train"]) == 2
    assert "give one" in capsys.readouterr().err


def test_an_unknown_recipe_names_the_bundled_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--recipe", "no-such"]) == 2
    assert "first-run, first-run-control, train" in capsys.readouterr().err


def test_a_bad_config_key_stops_the_first_run_before_any_phase(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--set", f"out_dir={str(tmp_path)!r}", "--set", "run_id='r'", "--set", "train.lr=1"]) == 2
    assert "train.optim.lr" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_a_recipe_its_grpo_run_would_refuse_stops_before_any_phase(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["up", "--set", f"out_dir={str(tmp_path)!r}", "--set", "run_id='r'", "--set", "recipe.pass_over=true"]
    assert main(argv) == 2
    assert "pass_over_uninformative is for synchronous grpo" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def _reading(folder: Path, seed: int, resolved: list[bool], aborted: tuple[int, ...] = ()) -> recipes.Reading:
    folder.mkdir(parents=True)
    rows = [{"instance_id": f"t{i // 2}", "sample": i % 2, "resolved": r, "exit_status": "Submitted",
             "outcome": "ABORTED" if i in aborted else "COMPLETED"} for i, r in enumerate(resolved)]
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    scored = [r for i, r in enumerate(resolved) if i not in aborted]
    return recipes.Reading(resolve_rate=sum(scored) / len(scored), resolved=sum(scored), episodes=len(scored),
                           aborted=len(aborted), folder=str(folder), model="m", seed=seed)


def test_a_gain_between_readings_of_one_seed_is_paired_episode_by_episode(tmp_path: Path) -> None:
    from swectl.cli.phases import noise_points, paired_noise_points

    before = _reading(tmp_path / "a", 0, [True, False, True, False, False, False, True, True])
    after = _reading(tmp_path / "b", 0, [True, True, True, False, True, False, True, True])
    # differences 0,1,0,0,1,0,0,0: mean 0.25, sample variance 0.2143, over 8 pairs
    assert paired_noise_points(before, after) == round(100 * (0.5 / 7 * 3 / 8) ** 0.5, 1) == 16.4
    # the same numbers as independent readings: more noise
    assert noise_points(before, after) == round(100 * (0.25 / 8 + 0.1875 / 8) ** 0.5, 1) == 23.4
    other_seed = _reading(tmp_path / "c", 1, [True, True, True, False, True, False, True, True])
    assert paired_noise_points(before, other_seed) is None  # other random numbers: not paired
    aborted = _reading(tmp_path / "d", 0, [True, True, True, False, True, False, True, True], aborted=(3,))
    assert paired_noise_points(before, aborted) is None  # an episode missing from one side


def _checked_phases(kinds: tuple[str, ...], user_sets: list[str]):
    """(recipe, phase, its checked command) for each phase of those kinds in every bundled and suite recipe."""
    for path in [*sorted(recipes.RECIPES_DIR.glob("*.toml")), *SUITE_RECIPES]:
        recipe = recipes.load(str(path), {})
        commands = check(recipe, RUN, user_sets)
        for phase in recipe.file.phase:
            if phase.kind in kinds:
                yield recipe, phase, commands[phase.name]


def test_a_train_phases_logged_command_gives_the_config_its_driver_gets() -> None:
    """A train phase's driver gets the recipe's overlay as values; the `swectl up ... --set` line the run logs for
    it must give the same config, so a user who copies that line trains the same run."""
    from swectl.cli.common import load_run_config
    from swectl.config import resolved_json

    compared = 0
    for recipe, _phase, command in _checked_phases(("train",), ["rollout.step_limit=5"]):
        argv = command.argv
        shown = [argv[i + 1] for i, flag in enumerate(argv) if flag == "--set"]
        assert shown[-1] == "rollout.step_limit=5"  # the user's sets come last: they win
        from_line = load_run_config(recipe.file.base or None, shown)
        assert resolved_json(from_line) == resolved_json(command.config(recipe.file.base or None))
        compared += 1
    assert compared >= 5


def test_a_data_or_eval_phases_logged_command_gives_the_config_its_driver_gets() -> None:
    """Data and eval phases get the overlay as values too (args.config_overlay, beside their own flags); their logged
    line carries it as --sets, and parsed as a user would run it gives the same config."""
    from swectl.cli.common import load_run_config
    from swectl.cli.eval import rollout_overrides
    from swectl.cli.phases import _parse
    from swectl.config import resolved_json

    compared = 0
    for recipe, phase, command in _checked_phases(("data", "eval"), ["rollout.step_limit=5"]):
        line, driver = _parse(command.argv), _parse(command.flags)
        assert line.config_overlay is None and command.overlay  # the values travel beside the flags
        assert driver.overrides == ["rollout.step_limit=5"] and line.overrides[-1] == "rollout.step_limit=5"
        extra = rollout_overrides(line) if phase.kind == "eval" else []
        from_line = load_run_config(line.config, [*line.overrides, *extra])
        by_value = load_run_config(driver.config, [*driver.overrides, *extra], command.overlay)
        assert resolved_json(from_line) == resolved_json(by_value), (recipe.source, phase.name)
        compared += 1
    assert compared >= 10
