"""The training plan of a run, resolved once before the loop starts: the model folder (the tiny default made on
first use), the seeded train/held-out split of the tasks (recorded in split.json, and held to on resume), and the
SFT samples (train.data.sft_data, or gold trajectories of the train split made at the start)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import anyio
import msgspec

from swectl.actors.engine_kinds import engine_kind
from swectl.config import ClusterConfig
from swectl.data.atif import is_atif, samples_from_atif
from swectl.data.trajectories import TRAJ_FILE, samples_from_messages_jsonl, samples_from_runs
from swectl.errors import ConfigError, TaskDataError
from swectl.images.project import BUNDLED_TASKS
from swectl.model.tokenizer import load_tokenizer
from swectl.rl.batch import TrainSample
from swectl.tasks.record import Task
from swectl.train.split import SPLIT_FILE, record_split, split_source_off_loop

Say = Callable[[str], None]


class TrainPlan(msgspec.Struct, frozen=True, kw_only=True):
    """What a run trains on, resolved once: the model folder, the task splits or the SFT samples."""

    model: str
    train_tasks: list[Task] = []
    test_tasks: list[Task] = []
    sft_samples: list[TrainSample] = []


async def build_plan(config: ClusterConfig, run_dir: Path, *, say: Say) -> TrainPlan:
    """Resolve the model folder (making the tiny default on first use) and the task splits or SFT samples (in the
    run's event loop: gold trajectories, when the run makes them, run in sandboxes)."""
    t, data = config.train, config.train.data
    kind = engine_kind(config.engine.kind)
    untied = kind.needs_untied_head  # its weight reload leaves an output head tied to the embeddings stale
    model = t.model or str(Path(config.out_dir) / "models" / ("tiny-qwen3-untied" if untied else "tiny-qwen3"))
    if not t.model and not (Path(model) / "config.json").is_file():
        from swectl.model.tiny import ModelInitConfig, init_model

        say(f"no model given (train.model): making the tiny default at {model} (`swectl model init"
            f"{' --untied' if untied else ''}`)")
        await anyio.to_thread.run_sync(
            lambda: init_model(Path(model), ModelInitConfig(tie_word_embeddings=not untied), progress=say))
    if not (Path(model) / "config.json").is_file():
        raise ConfigError(f"train.model {model}: not a Hugging Face model folder (no config.json)")
    if untied and t.algorithm != "sft" and ties_embeddings(Path(model)):
        raise ConfigError(f"train.model {model} ties its output head to its embeddings, and {kind.name}'s weight "
                          "reload leaves a tied head stale (the engines would sample from old weights); train an "
                          "untied model (`swectl model init --untied`, or set tie_word_embeddings false and save "
                          "lm_head), or use engine.kind = \"cpu\"")
    if t.algorithm == "sft":
        return TrainPlan(model=model, sft_samples=_sft_samples(config, model))
    split = await split_source_off_loop(data.tasks or str(BUNDLED_TASKS), data.test_fraction, data.split_seed,
                                        key="train.data.tasks", say=say)
    record_split(run_dir / SPLIT_FILE, split.record,
                 settings="train.data.tasks, train.data.test_fraction or train.data.split_seed")
    train, test = split.train, split.held_out
    sft: list[TrainSample] = []
    if data.sft_steps:
        sft = (_sft_samples(config, model) if data.sft_data
               else await _gold_samples(config, model, train, run_dir / "gold", say))
    return TrainPlan(model=model, train_tasks=train, test_tasks=test, sft_samples=sft)


def ties_embeddings(model: Path) -> bool:
    """Whether a Hugging Face model folder's config ties the output head to the input embeddings."""
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"train.model {model}: cannot read config.json: {exc}") from exc
    return bool(config.get("tie_word_embeddings", False))


async def _gold_samples(config: ClusterConfig, model: str, tasks: list[Task], out: Path, say: Say
                        ) -> list[TrainSample]:
    """SFT data for the first train.data.sft_steps of a grpo run when train.data.sft_data is empty: each train-split
    task's gold patch acted out as agent turns in a real sandbox and graded (`swectl data gold`), made once per run."""
    from swectl.eval.gold import make_gold

    if _gold_to_make(out, say):
        say(f"train.data.sft_steps = {config.train.data.sft_steps} with no train.data.sft_data: making gold "
            "trajectories of the "
            f"{len(tasks)} train-split tasks in {out}")
        tokenizer = load_tokenizer(model, "train.model")
        summary = await make_gold(config, tasks, out, tokenizer, tokenizer_path=model,
                                  concurrency=config.train.concurrency, status=say)
        say(f"{summary.resolved} of {summary.total} gold trajectories resolve and are kept")
    samples = samples_from_runs([out])
    if not samples:
        raise TaskDataError(f"{out}: no gold trajectory resolved; see its summary.json")
    return samples


def _gold_to_make(out: Path, say: Say) -> bool:
    """Whether ``out`` needs gold trajectories made; if so it is made empty (an interrupted gold run's partial results
    would be refused: they are made anew)."""
    if (out / "summary.json").exists():
        return False
    if out.exists():
        say(f"{out} holds an unfinished gold run (no summary.json): making it again")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    return True


def _is_atif_source(path: Path) -> bool:
    """An ATIF file, or a folder of them that is not a swectl run folder (no traj.json episodes in it)."""
    if path.is_file():
        return is_atif(path)
    return (path.is_dir() and not (path / TRAJ_FILE).is_file() and not any(path.glob(f"*/{TRAJ_FILE}"))
            and any(is_atif(p) for p in path.rglob("*.json")))


def _sft_samples(config: ClusterConfig, model: str) -> list[TrainSample]:
    data = config.train.data
    if not data.sft_data:
        raise ConfigError('train.algorithm = "sft" needs train.data.sft_data: traj.json run folders (a `swectl eval` '
                          "or `swectl data gold` output), OpenAI-messages JSONL files or ATIF trajectories "
                          "(files, or folders holding them such as a Harbor job folder)")
    samples: list[TrainSample] = []
    tokenizer = None
    for item in data.sft_data:
        path = Path(item)
        if not path.exists():
            raise ConfigError(f"train.data.sft_data: {path} does not exist")
        if _is_atif_source(path):  # Harbor's (and any tool's) ATIF trajectories: token-exact where they carry ids
            tokenizer = tokenizer or load_tokenizer(model, "train.model")
            samples += samples_from_atif([path], tokenizer)
        elif path.is_file() and path.suffix in (".jsonl", ".json") and path.name != "traj.json":
            tokenizer = tokenizer or load_tokenizer(model, "train.model")
            samples += samples_from_messages_jsonl(path, tokenizer, strict=data.sft_strict)
        else:
            # rejection-sampling fine-tuning, unless train.data.sft_resolved_only = false (a teacher's every attempt)
            samples += samples_from_runs([path], resolved_only=config.train.data.sft_resolved_only)
    if not samples:
        raise TaskDataError(f"train.data.sft_data: no trajectories found in {', '.join(data.sft_data)}")
    return samples
