"""The controller: ``swectl up`` as the RL loop of docs/architecture.md 8.1.

    DataSource --tasks--> Rollout (n episodes per task, graded) --groups--> batcher (drop ABORTED and refill,
    rewards, advantages, dynamic sampling) --TrainBatch in shared memory--> Trainer (one FSDP2 step, weights
    folder) --> Engines.update_weights --> next step

``algorithm = "sft"`` replaces the rollout with a seeded pass over trajectories (swectl traj.json runs or
OpenAI-messages JSONL). Every ``save_every`` steps a checkpoint (checkpoint.py); ``--resume RUN_DIR`` goes on
from the latest one, and a trainer that dies is restarted from it (trainer.max_restarts in a row). Outputs in the run
folder: metrics.jsonl and tensorboard/ (actors/metrics.py), steps.jsonl (each step's tasks and groups),
weights/step_N (what the engines were given), checkpoints/, episodes/step_N/ (per-episode artifacts),
eval/step_N/ (held-out evaluations), trainer*.log and engine-logs/.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec

from swectl.actors.data_source import DataSource
from swectl.actors.engines import Engines, engine_hosts
from swectl.actors.env_pool import new_run_id
from swectl.actors.metrics import Metrics, StepProgress
from swectl.actors.rollout import EpisodeResult
from swectl.actors.trainer import Trainer, TrainerLostError, TrainerNoSpaceError
from swectl.config import ClusterConfig, TrainConfig, ranks_per_node
from swectl.errors import ConfigError
from swectl.images.builds import tree_bytes
from swectl.logs import write_run_log
from swectl.model.tokenizer import load_tokenizer
from swectl.rl.admission import Admission
from swectl.rl.batch import make_batch
from swectl.rl.groups import Group
from swectl.rl.shm import BatchWriter
from swectl.rl.weight_sync import ParamSpec, plan_buckets
from swectl.rl.wire import Ready, StepReply, TrainerSettings
from swectl.tasks.record import Task
from swectl.train.checkpoint import (
    RunState,
    checkpoint_dir,
    commit_checkpoint,
    latest_checkpoint,
    prune_weights,
    step_name,
    truncate_records,
    write_atomic,
)
from swectl.train.feed import GroupFeed
from swectl.train.plan import TrainPlan
from swectl.train.rollouts import TrainRollouts
from swectl.train.services import RlServices
from swectl.train.sources import FeedSource, GroupSource, SampleSource, SftSource, StepSamples

_log = logging.getLogger(__name__)
Say = Callable[[str], None]


def trainer_settings(config: ClusterConfig, plan: TrainPlan, run_dir: Path, resume: str) -> TrainerSettings:
    """What the trainer ranks are given: [train.optim], [train.loss] and [trainer], whole."""
    t = config.train
    return TrainerSettings.of(config.trainer, t.optim, t.loss, model=plan.model, out_dir=str(run_dir),
                              algorithm=t.algorithm, total_steps=t.steps, seed=t.seed, resume=resume,
                              prob_weight=config.experiment.prob_weight)


class Controller:
    """One training run: its actors, its loop, its state."""

    def __init__(self, config: ClusterConfig, plan: TrainPlan, run_dir: Path, *, say: Say) -> None:
        self.config = config
        self.train: TrainConfig = config.train
        self.plan = plan
        self.run_dir = run_dir
        self.say = say
        self.state = RunState(weights=plan.model)
        self.restarts = 0  # trainer restarts in a row, with no step trained between them
        self._restarted_at = -1  # the step the last restart went on from
        self._trainer_was_ready = False
        self._trainer_ever_ready = False  # it came up once in this process: a later start that fails is a fault
        self._weight_group = ""  # the distributed sync's group name; "" = weights go by disk
        self._buckets: list[list[ParamSpec]] = []
        self._checkpoint_path = ""  # the trainer state to start the ranks from ("" = the model folder)
        self._tok: Any = None  # the policy's tokenizer, loaded at the first rollout

    # ------------------------------------------------------------ the run, with restarts

    async def run(self, *, resume: bool) -> RunState:
        if resume:
            self._load_latest(required=True)
        while True:
            try:
                await self._run_once()
                return self.state
            except* (TrainerLostError, TrainerNoSpaceError) as group:
                error = _first_leaf(group)
                # it never came up (no torch, a model it cannot load): no retry. One that came up before and died
                # while starting again (killed during a restart: the chaos soak) is a fault like any other
                if not self._trainer_was_ready and not self._trainer_ever_ready:
                    raise error from None
                if self.state.step > self._restarted_at:  # steps were trained since the last restart: a new fault
                    self.restarts = 0
                self.restarts += 1
                if self.restarts > self.config.trainer.max_restarts:
                    raise error from None
                if isinstance(error, TrainerNoSpaceError):
                    await self._wait_for_space(error)
                else:
                    self.say(f"trainer lost: {error}\n  restart {self.restarts}/{self.config.trainer.max_restarts} "
                             "from the last checkpoint")
                self._load_latest(required=False)
                self._restarted_at = self.state.step

    async def _wait_for_space(self, error: TrainerNoSpaceError) -> None:
        """After a step that found the disk full: wait (trainer.disk_wait_s at most) until the run's disk has room
        for a checkpoint like its last one (or three times the model's weights) and 64 MiB, saying so once."""
        need = _room_for_a_checkpoint(self.run_dir, Path(self.plan.model))
        wait_s = self.config.trainer.disk_wait_s
        free = shutil.disk_usage(self.run_dir).free
        self.say(f"trainer: no space left on the run's disk: {error}\n  {free / 2**20:.0f} MiB free in "
                 f"{self.run_dir}, {need / 2**20:.0f} MiB needed; waiting up to {wait_s:.0f} s "
                 f"(trainer.disk_wait_s), then restart {self.restarts}/{self.config.trainer.max_restarts} from "
                 "the last checkpoint")
        with anyio.move_on_after(wait_s):
            while shutil.disk_usage(self.run_dir).free < need:  # noqa: ASYNC110 (no event for free space)
                await anyio.sleep(1.0)
        free = shutil.disk_usage(self.run_dir).free
        if free < need:
            raise TrainerNoSpaceError(f"{error}; after {wait_s:.0f} s (trainer.disk_wait_s) the run's disk still "
                                      f"has {free / 2**20:.0f} MiB free of the {need / 2**20:.0f} MiB a "
                                      f"checkpoint needs: free space in {self.run_dir}, then `swectl up --resume "
                                      f"{self.run_dir}`") from None

    def _load_latest(self, *, required: bool) -> None:
        found = latest_checkpoint(self.run_dir)
        if found is None:
            if required:
                raise ConfigError(f"--resume {self.run_dir}: no checkpoint there (checkpoints/latest is missing)")
            self.state = RunState(weights=self.plan.model)
            self._checkpoint_path = ""
        else:
            folder, self.state = found
            self._checkpoint_path = str(folder / "trainer")
            self.say(f"resuming after step {self.state.step} from {folder}")
        truncate_records(self.run_dir / "steps.jsonl", self.state.step)

    async def _run_once(self) -> None:
        cfg, t = self.config, self.train
        run_id = self.run_dir.name
        resume_from = self._checkpoint_path
        # from step 0 (a fresh start, or a restart before the first checkpoint): every earlier line goes
        metrics = Metrics(self.run_dir, resume_step=self.state.step if self.state.step else -1)
        progress = StepProgress(t.steps, self.state.step)
        # the one question "is this an RL run?": whether it has the bundle of pool, engines, judge and rollouts
        rl = RlServices(cfg, self.run_dir, say=self.say, tokenizer=self._tokenizer) if t.algorithm == "grpo" else None
        async with (_closing(metrics), rl.opened(run_id, self.state.weights) if rl else contextlib.nullcontext(),
                    engine_hosts(cfg.trainer_nodes()) as thosts, anyio.create_task_group() as tg):
            trainer = Trainer(cfg.trainer, trainer_settings(cfg, self.plan, self.run_dir, resume_from), thosts,
                              log_dir=self.run_dir, run_id=run_id, progress=self.say)
            self.say(f"starting {rl.describe() + ' and ' if rl else ''}the trainer ({_ranks(cfg, thosts)})")
            self._trainer_was_ready = False
            ready = await self._start_services(tg, trainer, rl)
            self._trainer_was_ready = self._trainer_ever_ready = True
            self.say(f"trainer ready: {ready.world_size} ranks on {ready.device}, {ready.parameters:,} parameters")
            self._weight_group = ""
            if rl is not None:
                if cfg.trainer.weight_sync == "distributed":
                    await self._form_weight_group(trainer, rl.engines, ready.device, run_id)
                await rl.ready(tg)
            grpo: SampleSource | None = None  # made at the first GRPO step
            sft: SampleSource | None = None  # made at the first SFT step
            with BatchWriter() as writer:
                if rl is not None and t.eval_every and self.state.step == 0:
                    await self._evaluate(rl.rollouts, metrics, 0)
                while self.state.step < t.steps:
                    step = self.state.step + 1
                    if rl is not None and step > t.data.sft_steps:
                        grpo = grpo or await self._grpo_source(tg, rl.rollouts)
                        source = grpo
                    else:
                        sft = sft or SftSource(self.plan.sft_samples, batch_size=t.data.sft_batch_size, seed=t.seed,
                                               cursor=self.state.sft_cursor)
                        source = sft
                    await self._step(step, source, rl, trainer, writer, metrics, progress)
                    if rl is not None and t.eval_every and (step % t.eval_every == 0 or step == t.steps):
                        await self._evaluate(rl.rollouts, metrics, step)
                    if self._checkpoint_due(step):
                        await self._checkpoint(trainer)
            progress.close()
            tg.cancel_scope.cancel("training done")

    # ------------------------------------------------------------ one step

    async def _step(self, step: int, source: SampleSource, rl: RlServices | None, trainer: Trainer,
                    writer: BatchWriter, metrics: Metrics, progress: StepProgress) -> None:
        """One step of the loop, whatever the algorithm: samples from ``source``, one trainer step on them, the
        new weights to the engines, the step's metrics and record."""
        t0 = time.monotonic()
        got = await source.next(step)
        values = {**got.values, "rollout_s": time.monotonic() - t0, **(rl.step_values() if rl else {})}
        reply = None
        if got.samples:
            reply = await self._train(step, got, trainer, writer, values, push=rl is not None)
        else:  # every group had equal rewards (or was aborted): nothing to learn from, nothing to push
            self.say(f"step {step}: no learning signal (all {values.get('groups_dropped_uninformative', 0):.0f} "
                     f"groups had equal rewards, {values.get('groups_dropped_aborted', 0):.0f} aborted); no update")
            values["skipped"] = 1.0
        if reply is not None and reply.skipped:
            self.say(f"step {step}: {reply.reason}; the weights were not pushed")
            values["skipped"] = 1.0
        elif reply is not None and rl is not None:
            values["sync_s"] = await self._sync_weights(step, reply, trainer, rl.engines)
        if values.get("skipped"):
            self.state.skipped_steps.append(step)
        elif reply is not None and reply.weights_dir:
            self.state.weights = reply.weights_dir
        self.state.step = step
        source.save(self.state)
        values["weight_version"] = float(step)
        values["step_s"] = time.monotonic() - t0
        metrics.log(step, values)
        progress.update(step, values)
        with (self.run_dir / "steps.jsonl").open("ab") as f:
            f.write(msgspec.json.encode(msgspec.structs.replace(got.record, step=step)) + b"\n")
        prune_weights(self.run_dir, self.train.keep_weights, {self.state.weights, *self._checkpointed_weights()})

    async def _train(self, step: int, got: StepSamples, trainer: Trainer, writer: BatchWriter,
                     values: dict[str, float], *, push: bool) -> StepReply:
        batch = make_batch(step, got.algorithm, got.samples)
        t1 = time.monotonic()
        ref = writer.write(batch)
        values["transport_s"] = time.monotonic() - t1
        frame_bytes = writer.frame_bytes(ref) if trainer.stream_frames else None
        weights_dir = str(self.run_dir / "weights" / step_name(step))
        if (self._weight_group or not push) and not self._checkpoint_due(step):
            # broadcast to the engines, or no engines to give it to (SFT): a folder only where a checkpoint needs one
            weights_dir = ""
        reply = await trainer.step(step, ref, weights_dir=weights_dir, frame_bytes=frame_bytes)
        values.update(reply.metrics)
        return reply

    def _checkpoint_due(self, step: int) -> bool:
        t = self.train
        return bool(t.save_every and step % t.save_every == 0) or step == t.steps

    # ------------------------------------------------------------ weight sync

    async def _form_weight_group(self, trainer: Trainer, engines: Engines, device: str, run_id: str) -> None:
        """The distributed sync's group: trainer rank 0 and every engine server, over NCCL on GPU, gloo on CPU."""
        remote_engines = engines.remote
        if remote_engines and not trainer.remote:
            raise ConfigError("trainer.weight_sync = \"distributed\": the engines run on other nodes, but trainer "
                              "rank 0 runs on this machine (loopback); put the trainer on a node the engines reach "
                              "(trainer.nodes) or use weight_sync = \"disk\"")
        backend = "nccl" if device.startswith("cuda") else "gloo"
        group = f"swectl-{run_id}-{self.restarts}"
        port = await trainer.free_port()
        world = engines.weight_group_size()
        timeout = self.config.trainer.start_timeout_s
        t0 = time.monotonic()
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: trainer.join_weight_group(port, world, group, backend, timeout_s=timeout))
            tg.start_soon(lambda: engines.join_weight_group(trainer.weight_group_address, port, group, backend,
                                                            timeout_s=timeout))
        self._buckets = plan_buckets(trainer.params, int(self.config.trainer.weight_sync_bucket_mb * 2**20))
        self._weight_group = group
        size = sum(p.nbytes for p in trainer.params)
        self.say(f"weight group {group}: trainer + {world - 1} engine server(s) over {backend}, {size / 1e6:,.1f} MB "
                 f"in {len(self._buckets)} bucket(s) per sync (formed in {time.monotonic() - t0:.1f} s)")

    async def _sync_weights(self, step: int, reply: StepReply, trainer: Trainer, engines: Engines) -> float:
        """Give the engines the weights of ``step``: broadcast over the weight group, or from a folder on disk."""
        if self._weight_group:
            broken = engines.weight_group_broken()
            if broken is None:
                group, buckets = self._weight_group, self._buckets
                return await engines.update_weights_distributed(
                    buckets, str(step), lambda: trainer.broadcast_weights(group, buckets))
            _log.warning("step %d: weights go by disk: %s", step, broken)
            self.say(f"step {step}: the weight group is broken ({broken}); syncing from disk from now on")
            self._weight_group = ""
        folder = reply.weights_dir
        if not folder:
            folder = str(self.run_dir / "weights" / step_name(step))
            await trainer.save_weights(Path(folder))
            self.state.weights = folder
        return await engines.update_weights(folder, str(step))

    def _checkpointed_weights(self) -> set[str]:
        return {p.name for p in (self.run_dir / "checkpoints").glob("step_*") if p.is_dir()}

    async def _checkpoint(self, trainer: Trainer) -> None:
        folder = checkpoint_dir(self.run_dir, self.state.step)
        folder.mkdir(parents=True, exist_ok=True)
        try:
            await trainer.checkpoint(self.state.step, folder / "trainer")
        except TrainerNoSpaceError as exc:  # the ranks removed the partial one and are still up
            shutil.rmtree(folder, ignore_errors=True)
            free_mib = shutil.disk_usage(self.run_dir).free / 2**20
            self.say(f"checkpoint after step {self.state.step} skipped: {exc} ({free_mib:.0f} MiB free in "
                     f"{self.run_dir}); the run goes on, the next checkpoint tries again")
            return
        commit_checkpoint(self.run_dir, self.state)

    # ------------------------------------------------------------ GRPO's sample source, the judge, evaluation

    async def _grpo_source(self, tg: anyio.abc.TaskGroup, rollouts: TrainRollouts) -> SampleSource:
        """Synchronous groups, or with train.sampling.max_staleness the async group feed started in ``tg``."""
        t = self.train
        tasks = DataSource(self.plan.train_tasks, seed=t.seed, cursor=self.state.cursor)
        if not t.sampling.max_staleness:
            return GroupSource(rollouts, tasks, t.sampling, self.config.experiment, t.loss)
        feed = await self._start_feed(tg, rollouts, tasks)
        return FeedSource(feed, tasks, t.sampling, self.config.experiment, t.loss)

    async def _start_feed(self, tg: anyio.abc.TaskGroup, rollouts: TrainRollouts, tasks: DataSource) -> GroupFeed:
        """The async loop's group supply (feed.py), its grader and its episode limit, running in ``tg``."""
        t = self.train
        grader = rollouts.grader(self.run_dir / "episodes")
        limiter = anyio.CapacityLimiter(t.concurrency)

        async def run_group(task: Task, draw: int) -> tuple[Group | None, list[EpisodeResult]]:
            out = rollouts.fresh(self.run_dir / "episodes" / f"group_{draw:06d}")
            rollout = rollouts.rollout(grader, f"g{draw}", out, limiter=limiter)
            results: list[EpisodeResult] = []
            group = await rollouts.group(rollout, task, results)
            if group is not None:
                rollouts.score(group, f"g{draw}:{task.instance_id}", out)
            return group, results

        s = t.sampling
        feed = GroupFeed(Admission(s.max_staleness, s.tasks_per_step * s.n_samples, version=self.state.step),
                         tasks, run_group, group_size=s.n_samples, dynamic_sampling=s.dynamic_sampling,
                         drop_cap=s.tasks_per_step * s.max_sampling_rounds, draws=len(tasks.cursor.consumed))
        await tg.start(feed.run, name="group feed")
        self.say(f"async training: up to {s.max_staleness + 1} steps of groups outstanding "
                 f"(max_staleness {s.max_staleness}), {t.concurrency} episodes at once")
        return feed

    async def _start_services(self, tg: anyio.abc.TaskGroup, trainer: Trainer, rl: RlServices | None) -> Ready:
        """The trainer and (in an RL run) the engines and the tokenizer made ready at the same time, each owned by
        ``tg`` once up: they wait on nothing of each other's (docs/results.md, "2026-11-29 (night)": started one
        after another, a GRPO run on 2 cores waited for each in turn)."""
        ready: list[Ready] = []

        async def trainer_up() -> None:
            ready.append(await tg.start(trainer.run, name="trainer"))

        async with anyio.create_task_group() as starting:
            if rl is not None:
                starting.start_soon(rl.start, tg)
            starting.start_soon(trainer_up)
        return ready[0]

    def _tokenizer(self) -> Any:
        if self._tok is None:
            self._tok = load_tokenizer(self.plan.model, "train.model")
        return self._tok

    async def _evaluate(self, rollouts: TrainRollouts, metrics: Metrics, step: int) -> None:
        if not self.plan.test_tasks:
            return
        rate = await rollouts.evaluate(self.plan.test_tasks, metrics, step)
        self.say(f"eval after step {step}: {rate:.0%} of held-out episodes resolved")


def _ranks(config: ClusterConfig, hosts: list[Any]) -> str:
    """"2 ranks x 1 node(s)", or "3 ranks on 2 node(s) (2 + 1)" when the nodes' counts differ."""
    ranks = ranks_per_node(config.trainer, len(hosts))
    if len(set(ranks)) == 1:
        return f"{ranks[0]} ranks x {len(hosts)} node(s)"
    return f"{sum(ranks)} ranks on {len(hosts)} node(s) ({' + '.join(map(str, ranks))})"


def _first_leaf(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


@contextlib.asynccontextmanager
async def _closing(metrics: Metrics):
    with metrics:
        yield metrics


def _prepare_run_dir(config: ClusterConfig, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    write_run_log(run_dir)
    write_atomic(run_dir / "config.json", msgspec.json.format(msgspec.json.encode(config)))


async def run_training(config: ClusterConfig, plan: TrainPlan, run_dir: Path, *, resume: bool, say: Say
                       ) -> RunState:
    _prepare_run_dir(config, run_dir)
    return await Controller(config, plan, run_dir, say=say).run(resume=resume)


def new_run_dir(config: ClusterConfig) -> Path:
    return Path(config.out_dir) / (config.run_id or new_run_id())


def _room_for_a_checkpoint(run_dir: Path, model: Path) -> int:
    """Bytes a restart needs free: the latest checkpoint's size (or three times the model folder's: weights and
    the optimizer's two moments) and 64 MiB."""
    found = latest_checkpoint(run_dir)
    folder = found[0] if found is not None else None
    size = tree_bytes(folder) if folder is not None else 3 * tree_bytes(model)
    return size + 64 * 2**20
