"""The controller: ``swectl up`` as the RL loop of DESIGN section 3.

    DataSource --tasks--> Rollout (n episodes per task, graded) --groups--> batcher (drop ABORTED and refill,
    rewards, advantages, dynamic sampling) --TrainBatch in shared memory--> Trainer (one FSDP2 step, weights
    folder) --> Engines.update_weights --> next step

``algorithm = "sft"`` replaces the rollout with a seeded pass over trajectories (swectl traj.json runs or
OpenAI-messages JSONL). Every ``save_every`` steps a checkpoint (checkpoint.py); ``--resume RUN_DIR`` goes on
from the latest one, and a trainer that dies is restarted from it (trainer.max_restarts). Outputs in the run
folder: metrics.jsonl and tensorboard/ (actors/metrics.py), steps.jsonl (each step's tasks and groups),
weights/step_N (what the engines were given), checkpoints/, episodes/step_N/ (per-episode artifacts),
eval/step_N/ (held-out evaluations), trainer*.log and engine-logs/.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.abc
import msgspec

from swectl.actors.data_source import DataCursor, DataSource
from swectl.actors.engines import Engines, engine_hosts
from swectl.actors.env_pool import EnvPool, new_run_id, running_pool
from swectl.actors.grader import Grader, GraderConfig
from swectl.actors.judge import Judge
from swectl.actors.metrics import Metrics, StepProgress
from swectl.actors.rollout import EpisodeResult, Rollout, RolloutConfig
from swectl.actors.trainer import Trainer, TrainerLostError
from swectl.agent.loop import Episode, EpisodeConfig
from swectl.agent.metrics import agent_metrics
from swectl.agent.protocol import AgentLimits
from swectl.config import ClusterConfig, TrainConfig
from swectl.engine.client import SglangClient
from swectl.engine.wire import SamplingParams
from swectl.errors import ConfigError, TaskDataError
from swectl.logs import write_run_log
from swectl.rl.admission import Admission
from swectl.rl.advantages import advantage_stats
from swectl.rl.batch import TrainSample, make_batch
from swectl.rl.groups import GradedEpisode, Group, group_outcomes, group_samples, score_group
from swectl.rl.shm import BatchWriter
from swectl.rl.weight_sync import ParamSpec, plan_buckets
from swectl.rl.wire import StepReply, TrainerSettings
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

_log = logging.getLogger(__name__)
T = TypeVar("T")
Say = Callable[[str], None]
REFILL_TRIES = 2  # extra rounds to replace ABORTED episodes of a group before the group is dropped


class TrainPlan(msgspec.Struct, frozen=True, kw_only=True):
    """What a run trains on, resolved once: the model folder, the task splits or the SFT samples."""

    model: str
    train_tasks: list[Task] = []
    test_tasks: list[Task] = []
    sft_samples: list[TrainSample] = []


def trainer_settings(config: ClusterConfig, plan: TrainPlan, run_dir: Path, resume: str) -> TrainerSettings:
    t, tr = config.train, config.trainer
    return TrainerSettings(
        model=plan.model, out_dir=str(run_dir), algorithm=t.algorithm, lr=t.lr, warmup_steps=t.warmup_steps,
        total_steps=t.steps, schedule=t.schedule, min_lr_ratio=t.min_lr_ratio, weight_decay=t.weight_decay,
        grad_clip=t.grad_clip, aggregation=t.aggregation, eps_low=t.eps_low, eps_high=t.eps_high,
        tis_cap=t.tis_cap, kl_coef=t.kl_coef, prob_weight=t.prob_weight, micro_batch_tokens=tr.micro_batch_tokens,
        threads=tr.threads_per_rank, backend=tr.backend, seed=t.seed, resume=resume, sync_dtype=tr.weight_sync_dtype,
    )


def episode_config(config: ClusterConfig, *, temperature: float, seed: str | None = None) -> EpisodeConfig:
    """The episodes' settings from ``[rollout]``; ``seed`` (a namespace) seeds every request's sampling."""
    r = config.rollout
    return EpisodeConfig(seed=seed,
        manage_context=r.manage_context, per_step_samples=config.train.sample_mode == "step",
        limits=AgentLimits(step_limit=r.step_limit, max_context_tokens=r.context,
                           max_format_errors=r.max_format_errors),
        sampling=SamplingParams(max_new_tokens=r.max_tokens, temperature=temperature))


def _weight_version(versions: list[str]) -> int:
    numbers = [int(v) for v in versions if v.isdigit()]
    return min(numbers) if numbers else 0


def graded_episode(result: EpisodeResult) -> GradedEpisode:
    """Read an episode's tokens back from its traj.json."""
    path = Path(result.artifacts) / "traj.json"
    try:
        episode = msgspec.json.decode(path.read_bytes(), type=_TrajFile).episode
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise TaskDataError(f"{path}: cannot read the episode back: {exc}") from exc
    t = episode.trajectory
    steps = [(s.prompt_ids, s.output_ids, s.output_logprobs) for s in episode.samples]
    return GradedEpisode(instance_id=result.instance_id, sample=result.sample, outcome=result.outcome,
                         resolved=result.resolved, token_ids=t.token_ids, loss_mask=t.loss_mask, logprobs=t.logprobs,
                         weight_version=_weight_version(t.weight_versions),
                         mixed_versions=len(set(t.weight_versions)) > 1, steps=steps,
                         step_scores=[j.score for j in result.step_judgements],
                         format_errors=[s.format_error for s in episode.steps], exit_status=result.exit_status)


class _TrajFile(msgspec.Struct):
    episode: Episode


class Controller:
    """One training run: its actors, its loop, its state."""

    def __init__(self, config: ClusterConfig, plan: TrainPlan, run_dir: Path, *, say: Say) -> None:
        self.config = config
        self.train: TrainConfig = config.train
        self.plan = plan
        self.run_dir = run_dir
        self.say = say
        self.state = RunState(weights=plan.model)
        self.restarts = 0
        self._trainer_was_ready = False
        self._weight_group = ""  # the distributed sync's group name; "" = weights go by disk
        self._buckets: list[list[ParamSpec]] = []
        self._feed: GroupFeed | None = None  # async mode (train.max_staleness > 0): started at the first GRPO step
        self._judge: Judge | None = None  # [reward.prm]: the process-reward judge

    # ------------------------------------------------------------ the run, with restarts

    async def run(self, *, resume: bool) -> RunState:
        if resume:
            self._load_latest(required=True)
        while True:
            try:
                await self._run_once()
                return self.state
            except* TrainerLostError as group:
                error = _first_leaf(group)
                if not self._trainer_was_ready:  # it never came up (no torch, a model it cannot load): no retry
                    raise error from None
                self.restarts += 1
                if self.restarts > self.config.trainer.max_restarts:
                    raise error from None
                self.say(f"trainer lost: {error}\n  restart {self.restarts}/{self.config.trainer.max_restarts} "
                         "from the last checkpoint")
                self._load_latest(required=False)

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
        resume_from = getattr(self, "_checkpoint_path", "")
        # from step 0 (a fresh start, or a restart before the first checkpoint): every earlier line goes
        metrics = Metrics(self.run_dir, resume_step=self.state.step if self.state.step else -1)
        progress = StepProgress(t.steps, self.state.step)
        rl = t.algorithm == "grpo"
        pool_cm = running_pool(cfg, run_id) if rl else contextlib.nullcontext(None)
        engine_cm = engine_hosts(cfg.engine_nodes()) if rl else contextlib.nullcontext([])
        async with (_closing(metrics), pool_cm as pool, engine_cm as ehosts,
                    engine_hosts(cfg.trainer_nodes()) as thosts, anyio.create_task_group() as tg):
            trainer = Trainer(cfg.trainer, trainer_settings(cfg, self.plan, self.run_dir, resume_from), thosts,
                              log_dir=self.run_dir, run_id=run_id, progress=self.say)
            engines: Engines | None = None
            if rl:
                engines = Engines(cfg.engine, model=self.state.weights, hosts=ehosts,
                                  log_dir=self.run_dir / "engine-logs")
                self.say(f"starting {len(ehosts) * cfg.engine.replicas} {cfg.engine.kind} engine server(s) and the "
                         f"trainer ({cfg.trainer.nproc_per_node} ranks x {len(thosts)} node(s))")
                await tg.start(engines.run, name="engines")
            else:
                self.say(f"starting the trainer ({cfg.trainer.nproc_per_node} ranks x {len(thosts)} node(s))")
            self._trainer_was_ready = False
            ready = await tg.start(trainer.run, name="trainer")
            self._trainer_was_ready = True
            self.say(f"trainer ready: {ready.world_size} ranks on {ready.device}, {ready.parameters:,} parameters")
            self._weight_group = ""
            if rl and cfg.trainer.weight_sync == "distributed":
                assert engines is not None
                await self._form_weight_group(trainer, engines, ready.device, run_id)
            source = DataSource(self.plan.train_tasks, seed=t.seed, cursor=self.state.cursor) if rl else None
            self._feed = None
            self._judge = await self._start_judge(tg, ehosts) if rl and cfg.reward.prm.enabled else None
            with BatchWriter() as writer:
                if rl and t.eval_every and self.state.step == 0:
                    await self._evaluate(pool, engines, metrics, 0)
                while self.state.step < t.steps:
                    step = self.state.step + 1
                    if rl and t.max_staleness and step > t.sft_steps and self._feed is None:
                        assert pool is not None and engines is not None and source is not None
                        self._feed = await self._start_feed(tg, pool, engines, source)
                    await self._step(step, pool, engines, trainer, writer, source, metrics, progress)
                    if rl and t.eval_every and (step % t.eval_every == 0 or step == t.steps):
                        await self._evaluate(pool, engines, metrics, step)
                    if (t.save_every and step % t.save_every == 0) or step == t.steps:
                        await self._checkpoint(trainer)
            progress.close()
            tg.cancel_scope.cancel("training done")

    # ------------------------------------------------------------ one step

    async def _step(self, step: int, pool: EnvPool | None, engines: Engines | None, trainer: Trainer,
                    writer: BatchWriter, source: DataSource | None, metrics: Metrics, progress: StepProgress
                    ) -> None:
        t = self.train
        t0 = time.monotonic()
        values: dict[str, float] = {}
        record: dict = {"step": step}
        if t.algorithm == "grpo" and step > t.sft_steps:
            assert pool is not None and engines is not None and source is not None
            if self._feed is not None:
                fed = await self._feed.next()
                groups, results, info, tasks_seen = fed.groups, fed.results, fed.info, fed.tasks
            else:
                groups, results, info, tasks_seen = await self._collect(step, pool, engines, source)
            samples = group_samples(groups, mode=t.sample_mode, mask_truncated=t.mask_truncated,
                                    mask_after_format_error=t.mask_after_format_error,
                                    mask_format_errors=t.mask_format_errors,
                                    truncated_endings=t.mask_truncated_endings,
                                    step_weight=t.step_sample_weight, step_score_coef=t.step_score_advantage)
            values.update(info)
            values.update(_rollout_values(groups, results))
            record.update(tasks=tasks_seen, groups=[g.instance_id for g in groups],
                          rewards={g.instance_id: g.rewards for g in groups})
        else:
            samples = self._next_sft(t.sft_batch_size)
            record.update(samples=[s.uid for s in samples])
        values["rollout_s"] = time.monotonic() - t0
        reply = None
        if samples:
            reply = await self._train(step, samples, trainer, writer, values)
        else:  # every group had equal rewards (or was aborted): nothing to learn from, nothing to push
            self.say(f"step {step}: no learning signal (all {values.get('groups_dropped_uninformative', 0):.0f} "
                     f"groups had equal rewards, {values.get('groups_dropped_aborted', 0):.0f} aborted); no update")
            values["skipped"] = 1.0
        if reply is not None and reply.skipped:
            self.say(f"step {step}: {reply.reason}; the weights were not pushed")
            values["skipped"] = 1.0
        elif reply is not None and engines is not None:
            values["sync_s"] = await self._sync_weights(step, reply, trainer, engines)
        if values.get("skipped"):
            self.state.skipped_steps.append(step)
        elif reply is not None and reply.weights_dir:
            self.state.weights = reply.weights_dir
        self.state.step = step
        if source is not None:  # async: the tasks drawn and not trained yet are redone after a resume
            pending = [*(self._feed.pending_ids() if self._feed else []), *source.cursor.pending]
            self.state.cursor = msgspec.structs.replace(source.cursor, consumed=list(source.cursor.consumed),
                                                        pending=pending)
        values["weight_version"] = float(step)
        values["step_s"] = time.monotonic() - t0
        metrics.log(step, values)
        progress.update(step, values)
        with (self.run_dir / "steps.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        prune_weights(self.run_dir, self.train.keep_weights, {self.state.weights, *self._checkpointed_weights()})

    async def _train(self, step: int, samples: list[TrainSample], trainer: Trainer, writer: BatchWriter,
                     values: dict[str, float]) -> StepReply:
        batch = make_batch(step, self.train.algorithm if step > self.train.sft_steps else "sft", samples)
        t1 = time.monotonic()
        ref = writer.write(batch)
        values["transport_s"] = time.monotonic() - t1
        frame_bytes = writer.frame_bytes(ref) if trainer.stream_frames else None
        weights_dir = str(self.run_dir / "weights" / step_name(step))
        if self._weight_group and not self._checkpoint_due(step):
            weights_dir = ""  # broadcast to the engines; a folder only where a checkpoint needs one (resume)
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
        await trainer.checkpoint(self.state.step, folder / "trainer")
        commit_checkpoint(self.run_dir, self.state)

    # ------------------------------------------------------------ rollout and groups

    async def _collect(self, step: int, pool: EnvPool, engines: Engines, source: DataSource
                       ) -> tuple[list[Group], list[EpisodeResult], dict[str, float], list[str]]:
        """``tasks_per_step`` groups with a signal (dynamic sampling: up to max_sampling_rounds rounds of drawing
        more tasks); ABORTED episodes are replaced, a group that cannot be completed is dropped."""
        t = self.train
        kept: list[Group] = []
        every: list[Group] = []
        results: list[EpisodeResult] = []
        tasks_seen: list[str] = []
        dropped = {"uninformative": 0, "aborted": 0}
        rounds = 0
        out = self.run_dir / "episodes" / step_name(step)
        grader = self._grader(pool, out)
        rollout = self._train_rollout(pool, grader, engines, str(step), out)
        async with anyio.create_task_group() as tg:
            await tg.start(grader.run, name="grader")
            await tg.start(rollout.run, name="rollout")
            while len(kept) < t.tasks_per_step and rounds < t.max_sampling_rounds:
                rounds += 1
                tasks = source.next(t.tasks_per_step - len(kept))
                tasks_seen += [task.instance_id for task in tasks]
                for g in await _gather([lambda task=task: self._group(rollout, task, results) for task in tasks]):
                    if g is None:
                        dropped["aborted"] += 1
                        continue
                    self._score(g, f"{step}:{g.instance_id}:{len(every)}")
                    every.append(g)
                    if t.dynamic_sampling and not g.informative:
                        dropped["uninformative"] += 1
                    else:
                        kept.append(g)
                if not t.dynamic_sampling:
                    break
            tg.cancel_scope.cancel("step collected")
        info = {"groups": float(len(kept)), "sampling_rounds": float(rounds),
                "groups_dropped_uninformative": float(dropped["uninformative"]),
                "groups_dropped_aborted": float(dropped["aborted"])}
        info.update(group_outcomes(every))  # over every scored group (what the policy does), not only the kept ones
        return kept, results, info, tasks_seen

    def _score(self, group: Group, key: str) -> None:
        """Rewards and advantages of a finished group (``key`` seeds the shuffled-reward control)."""
        t = self.train
        score_group(group, estimator=t.estimator, resolved_reward=t.resolved_reward,
                    unresolved_reward=t.unresolved_reward, zero_advantages=t.zero_advantages,
                    requires_submit=t.reward_requires_submit, positive_only=t.positive_advantages_only,
                    positive_scale=t.positive_advantage_scale, truncated_reward=t.truncated_reward,
                    shuffle_seed=f"shuffle:{t.seed}:{key}" if t.shuffle_rewards else None,
                    step_coef=self.config.reward.prm.step_coef if self.config.reward.prm.enabled else 0.0)

    # ------------------------------------------------------------ async mode

    async def _start_judge(self, tg: anyio.abc.TaskGroup, ehosts: list) -> Judge:
        """The process-reward judge ([reward.prm]): its own engine group from a model folder (on the first engine
        node, never updated), or a running server; started in ``tg``."""
        from swectl.eval.agents import load_tokenizer

        prm = self.config.reward.prm
        if prm.endpoint:
            client = SglangClient(prm.endpoint, timeout_s=prm.timeout_s)
            tg.start_soon(_close_at_cancel, client, name="judge client")
            judge = Judge(prm, lambda key: client, load_tokenizer(prm.tokenizer, "reward.prm.tokenizer"))
            where = prm.endpoint
        else:
            engines = Engines(msgspec.structs.replace(self.config.engine, replicas=1, port=0), model=prm.model,
                              hosts=ehosts[:1], log_dir=self.run_dir / "judge-logs")
            await tg.start(engines.run, name="judge engines")
            judge = Judge(prm, engines.route, load_tokenizer(prm.model, "reward.prm.model"))
            where = prm.model
        await tg.start(judge.run, name="judge")
        self.say(f"process rewards: judge {where}, {prm.samples} answers per step, step_coef {prm.step_coef}")
        return judge

    async def _start_feed(self, tg: anyio.abc.TaskGroup, pool: EnvPool, engines: Engines, source: DataSource
                          ) -> GroupFeed:
        """The async loop's group supply (feed.py), its grader and its episode limit, running in ``tg``."""
        t = self.train
        grader = self._grader(pool, self.run_dir / "episodes")
        await tg.start(grader.run, name="feed grader")
        limiter = anyio.CapacityLimiter(t.concurrency)

        async def run_group(task: Task, draw: int) -> tuple[Group | None, list[EpisodeResult]]:
            rollout = self._train_rollout(pool, grader, engines, f"g{draw}",
                                          self.run_dir / "episodes" / f"group_{draw:06d}", limiter=limiter)
            results: list[EpisodeResult] = []
            async with anyio.create_task_group() as group_tg:
                await group_tg.start(rollout.run, name="group rollout")
                group = await self._group(rollout, task, results)
                group_tg.cancel_scope.cancel("group sampled")
            if group is not None:
                self._score(group, f"g{draw}:{task.instance_id}")
            return group, results

        feed = GroupFeed(Admission(t.max_staleness, t.tasks_per_step * t.n_samples, version=self.state.step),
                         source, run_group, group_size=t.n_samples, dynamic_sampling=t.dynamic_sampling,
                         drop_cap=t.tasks_per_step * t.max_sampling_rounds, draws=len(source.cursor.consumed))
        await tg.start(feed.run, name="group feed")
        self.say(f"async training: up to {t.max_staleness + 1} steps of groups outstanding "
                 f"(max_staleness {t.max_staleness}), {t.concurrency} episodes at once")
        return feed

    async def _group(self, rollout: Rollout, task: Task, results: list[EpisodeResult]) -> Group | None:
        """``n_samples`` finished episodes of ``task``; ABORTED ones are replaced (never scored)."""
        n = self.train.n_samples
        good: list[GradedEpisode] = []
        index = 0
        for _ in range(1 + REFILL_TRIES):
            want = n - len(good)
            batch = await _gather([lambda k=k: rollout.episode(task, k) for k in range(index, index + want)])
            index += want
            for r in batch:
                results.append(r)
                if r.outcome == "ABORTED" or (r.grade is not None and r.grade.infra):
                    _log.warning("episode %s#%d aborted: %s", r.instance_id, r.sample, r.reason)
                    continue
                good.append(graded_episode(r))
            if len(good) >= n:
                good.sort(key=lambda e: e.sample)
                return Group(instance_id=task.instance_id, episodes=good[:n])
        return None

    def _train_rollout(self, pool: EnvPool, grader: Grader, engines: Engines, tag: str, out: Path,
                       limiter: anyio.CapacityLimiter | None = None) -> Rollout:
        """A Rollout of training episodes: ``n_samples`` per task, sampling seeded and engine sessions keyed by
        ``tag`` (the step, or the async group's draw), artifacts under ``out``, the process-reward judge if any."""
        t = self.train
        config = RolloutConfig(concurrency=t.concurrency, samples_per_task=t.n_samples,
                               episode=episode_config(self.config, temperature=t.temperature,
                                                      seed=f"train:{t.seed}:{tag}"))
        return Rollout(config, pool, grader, lambda task, n: engines.route(f"{task.instance_id}#{tag}#{n}"),
                       self._tokenizer(), out, limiter=limiter, judge=self._judge)

    def _grader(self, pool: EnvPool, out: Path) -> Grader:
        """The Grader of one step's rollouts or evaluation (its own verdicts to reuse, its logs under ``out``)."""
        return Grader(GraderConfig(concurrency=self.train.concurrency, reuse=self.config.rollout.reuse_grades), pool,
                      log_dir=out / "grade-logs")

    def _tokenizer(self):
        if not hasattr(self, "_tok"):
            from swectl.eval.agents import load_tokenizer

            self._tok = load_tokenizer(self.plan.model, "train.model")
        return self._tok

    def _next_sft(self, n: int) -> list[TrainSample]:
        """The next ``n`` SFT samples, in seeded-shuffled epochs (the same cursor logic as tasks)."""
        samples = self.plan.sft_samples
        if not samples:
            raise ConfigError("train.algorithm = \"sft\" needs train.sft_data (traj.json runs or messages JSONL)")
        import random

        cur = self.state.sft_cursor
        out: list[TrainSample] = []
        while len(out) < min(n, len(samples)):
            order = list(range(len(samples)))
            random.Random(f"sft:{self.train.seed}:{cur.epoch}").shuffle(order)
            if cur.index >= len(order):
                cur.epoch, cur.index = cur.epoch + 1, 0
                continue
            out.append(samples[order[cur.index]])
            cur.index += 1
        self.state.sft_cursor = DataCursor(epoch=cur.epoch, index=cur.index)
        return out

    # ------------------------------------------------------------ evaluation

    async def _evaluate(self, pool: EnvPool | None, engines: Engines | None, metrics: Metrics, step: int) -> None:
        tasks = self.plan.test_tasks
        if not tasks or pool is None or engines is None:
            return
        out = self.run_dir / "eval" / step_name(step)
        t = self.train
        grader = self._grader(pool, out)
        rollout = Rollout(RolloutConfig(concurrency=t.concurrency, samples_per_task=t.eval_samples,
                                        episode=episode_config(self.config, temperature=t.temperature,
                                                               seed=f"eval:{t.seed}")),
                          pool, grader, lambda task, n: engines.route(f"eval#{task.instance_id}#{step}#{n}"),
                          self._tokenizer(), out)
        t0 = time.monotonic()
        async with anyio.create_task_group() as tg:
            await tg.start(grader.run, name="eval grader")
            await tg.start(rollout.run, name="eval rollout")
            results = await rollout.collect(tasks)
            tg.cancel_scope.cancel("evaluated")
        scored = [r for r in results if r.outcome != "ABORTED"]
        rate = sum(r.resolved for r in scored) / max(len(scored), 1)
        values = {"eval/resolve_rate": rate, "eval/episodes": float(len(scored)),
                  "eval/aborted": float(len(results) - len(scored)), "eval/time_s": time.monotonic() - t0}
        metrics.log(step, values)
        (out / "summary.json").write_text(json.dumps({"step": step, **values}, indent=1))
        self.say(f"eval after step {step}: {rate:.0%} of {len(scored)} held-out episodes resolved")


def _rollout_values(groups: list[Group], results: list[EpisodeResult]) -> dict[str, float]:
    values: dict[str, float] = {}
    advs = [a for g in groups for a in g.advantages]
    values.update({f"adv/{k}": v for k, v in advantage_stats(advs).items()})
    values["episodes"] = float(len(results))
    values["aborted"] = float(sum(r.outcome == "ABORTED" for r in results))
    values["truncated"] = float(sum(r.outcome == "TRUNCATED" for r in results))
    values.update(agent_metrics(results))
    judged = [j for r in results for j in r.step_judgements]
    if judged:  # [reward.prm]
        scores = [j.score for j in judged if j.score is not None]
        answers = sum(len(j.votes) + j.unparseable + j.failures for j in judged)
        values["prm/steps"] = float(len(judged))
        values["prm/scored_frac"] = len(scores) / len(judged)
        values["prm/score_mean"] = sum(scores) / len(scores) if scores else 0.0
        values["prm/unparseable_frac"] = sum(j.unparseable for j in judged) / max(answers, 1)
        values["prm/failures"] = float(sum(j.failures for j in judged))
    return values


async def _close_at_cancel(client: SglangClient) -> None:
    """Hold ``client`` open until the run's task group is cancelled, then close it."""
    try:
        await anyio.sleep_forever()
    finally:
        with anyio.CancelScope(shield=True):
            await client.aclose()


def _first_leaf(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


@contextlib.asynccontextmanager
async def _closing(metrics: Metrics):
    with metrics:
        yield metrics


async def _gather(calls: list[Callable[[], Awaitable[T]]]) -> list[T]:
    """Run the calls concurrently in one task group; results in call order."""
    out: list[T | None] = [None] * len(calls)

    async def one(i: int) -> None:
        out[i] = await calls[i]()

    async with anyio.create_task_group() as tg:
        for i in range(len(calls)):
            tg.start_soon(one, i)
    return out  # type: ignore[return-value]


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

