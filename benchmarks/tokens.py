"""just bench tokens: encode throughput of the Hugging Face tokenizer vs the tiktoken encoding of the same BPE.

Realistic observations of 100 B, 1 KB, 10 KB and 100 KB: source files (the Python standard library and this
repository), pytest logs (this repository's test names, tracebacks from its own lines), diffs (this repository's
git history) and multilingual text, encoded as the agent encodes observations
(``encode(text, add_special_tokens=False)``). Two policies' tokenizers: the tiny model's (``swectl model init``
defaults: 8,192 ids trained on the standard library) and a Qwen-shaped one (NFC normalizer, Qwen 2 split regex
then ByteLevel) trained on the same corpus. Every text is checked id for id against HF (the oracle).

Each cell is timed in alternating rounds (HF, then tiktoken), the best round of each kept: on a shared machine
the best round is the one least disturbed by other jobs. Also measured: building and verifying the encoding, and
one agent step's observation bookkeeping (TrajectoryBuilder.add_observation, which renders the chat template too).

Writes benchmarks/results/tokens.json: per cell ``<tokenizer>_<kind>_<size>_{hf,tiktoken}_mb_s`` and ``_speedup``,
per tokenizer ``<tokenizer>_speedup_geomean``, ``<tokenizer>_mismatched_texts`` and the step timings.
"""

from __future__ import annotations

import argparse
import ast
import functools
import math
import random
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from common import Goal, Progress, host_meta, report  # noqa: E402

from swectl.agent.trajectory import TrajectoryBuilder  # noqa: E402
from swectl.model.fast_tokens import FastTokenizer, tiktoken_encoding  # noqa: E402
from swectl.model.tiny import SPECIAL_TOKENS, ModelInitConfig, hf_tokenizer, read_corpus, train_tokenizer  # noqa: E402

SUITE = "tokens"
SIZES = {"100B": 100, "1KB": 1_000, "10KB": 10_000, "100KB": 100_000}
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                 r"|\s+(?!\S)|\s+")
MULTILINGUAL = [
    "Die Funktion gibt für leere Eingaben „None“ zurück; das ist ein Fehler. Größe: 12 µs, Temperatur 21 °C.\n",
    "La función devuelve «None» cuando la entrada está vacía — corregido en la versión 2.3. ¿Dónde está?\n",
    "该函数在输入为空时返回 None，这是一个错误。请参阅第 3 节中的说明。测试通过：12/12。\n",
    "入力が空のとき、この関数は None を返します。これはバグです。テストは 12 件中 12 件成功しました。\n",
    "입력이 비어 있으면 이 함수는 None을 반환합니다. 이것은 버그입니다. 테스트 12개 중 12개 통과.\n",
    "Функция возвращает None для пустого ввода; это ошибка. См. раздел 3. Тесты: 12 из 12 пройдены.\n",
    "Η συνάρτηση επιστρέφει None όταν η είσοδος είναι κενή· αυτό είναι σφάλμα. Δοκιμές: 12/12.\n",
    "الدالة تُرجع None عندما يكون الإدخال فارغًا، وهذا خطأ. الاختبارات: ١٢ من ١٢ ناجحة.\n",
    "जब इनपुट खाली होता है तो फ़ंक्शन None लौटाता है; यह एक बग है। परीक्षण: 12 में से 12 सफल।\n",
    "✅ 12 passed ⚠️ 1 warning 🐍 Python 3.11 — “smart quotes” ‘here’ … ½ ≤ ≥ ≠ → ← ∑ ∞\n",
]


# ---------------------------------------------------------------- observations


def cut(stream: str, size: int, n: int, rng: random.Random, *, at: str = "\n") -> list[str]:
    """``n`` pieces of about ``size`` UTF-8 bytes from ``stream``, starting at random ``at`` boundaries."""
    data = stream.encode("utf-8")
    out = []
    for _ in range(n):
        start = rng.randrange(max(1, len(data) - size))
        start = data.find(at.encode(), start) + len(at) if data.find(at.encode(), start) >= 0 else 0
        out.append(data[start:start + size].decode("utf-8", errors="ignore"))
    return out


def source_stream() -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))[:150] + sorted((REPO / "swectl").rglob("*.py"))
    return "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)


def pytest_log_stream(rng: random.Random) -> str:
    """pytest output as an agent sees it: progress lines, failures with tracebacks of real lines, a summary."""
    tests: list[tuple[str, str, list[str]]] = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                body = lines[node.lineno - 1:(node.end_lineno or node.lineno)]
                tests.append((str(path.relative_to(REPO)), node.name, body))
    out = ["=" * 29 + " test session starts " + "=" * 30,
           "platform linux -- Python 3.11.2, pytest-8.3.4, pluggy-1.5.0",
           "rootdir: /testbed\nconfigfile: pyproject.toml\nplugins: anyio-4.8.0",
           f"collected {len(tests)} items\n"]
    failed = []
    for i, (path, name, body) in enumerate(tests):
        verdict = "FAILED" if rng.random() < 0.15 else "PASSED"
        if verdict == "FAILED":
            failed.append((path, name, body))
        line = f"{path}::{name} {verdict}"
        out.append(f"{line:<72} [{100 * (i + 1) // len(tests):>3}%]")
    out.append("\n" + "=" * 32 + " FAILURES " + "=" * 32)
    for path, name, body in failed:
        out.append(f"{'_' * 20} {name} {'_' * 20}\n")
        stop = rng.randrange(len(body))
        out += [f"    {x}" for x in body[:stop]] + [f">   {body[stop].strip()}"]
        out.append(f"E   AssertionError: assert {rng.randrange(1000)} == {rng.randrange(1000)}")
        out.append(f"E    +  where {rng.randrange(99)} = len([{rng.random():.4f}, ...])\n")
        out.append(f"{path}:{rng.randrange(400)}: AssertionError")
    out.append("=" * 25 + " short test summary info " + "=" * 25)
    out += [f"FAILED {p}::{n} - AssertionError: assert ..." for p, n, _ in failed]
    out.append(f"{'=' * 10} {len(failed)} failed, {len(tests) - len(failed)} passed, 3 warnings in 41.27s {'=' * 10}")
    return "\n".join(out) + "\n"


def diff_stream() -> str:
    done = subprocess.run(["git", "-C", str(REPO), "log", "-p", "--no-color", "--no-ext-diff", "-n", "400"],
                          capture_output=True, text=True, errors="replace", check=False)
    return done.stdout if len(done.stdout) > 300_000 else done.stdout * (1 + 300_000 // max(1, len(done.stdout)))


def observations(quick: bool) -> dict[tuple[str, str], list[str]]:
    rng = random.Random(0)
    streams = {"source": source_stream(), "pytest_log": pytest_log_stream(rng), "diff": diff_stream(),
               "multilingual": "".join(rng.choice(MULTILINGUAL) for _ in range(4000))}
    per_size = {"100B": 200, "1KB": 60, "10KB": 12, "100KB": 4} if not quick else {"100B": 50, "1KB": 20,
                                                                                 "10KB": 4, "100KB": 2}
    out: dict[tuple[str, str], list[str]] = {}
    for kind, stream in streams.items():
        for label, size in SIZES.items():
            out[kind, label] = cut(stream, size, per_size[label], rng, at="\ndiff --git " if kind == "diff" and
                                   size >= 10_000 else "\n")
    return out


# ---------------------------------------------------------------- timing


def encode_all(tok: Any, texts: list[str]) -> None:
    for text in texts:
        tok.encode(text, add_special_tokens=False)


def best_rounds(fns: dict[str, Callable[[], Any]], rounds: int, min_s: float) -> dict[str, float]:
    """Seconds per call of each function: alternating rounds of at least ``min_s``, the best round kept."""
    best = dict.fromkeys(fns, math.inf)
    for _ in range(rounds):
        for name, fn in fns.items():
            calls, started = 0, time.perf_counter()
            while True:
                fn()
                calls += 1
                took = time.perf_counter() - started
                if took >= min_s:
                    break
            best[name] = min(best[name], took / calls)
    return best


def qwen_shaped(cfg: ModelInitConfig, texts: list[str]) -> Any:
    """train_tokenizer's BPE with Qwen's normalizer (NFC) and split (its regex, then ByteLevel without one)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=cfg.vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return tok


def tokenizers(which: list[str], progress: Progress) -> dict[str, Any]:
    cfg = ModelInitConfig()
    texts, _ = read_corpus(cfg)
    out = {}
    for name in which:
        started = time.perf_counter()
        tok = qwen_shaped(cfg, texts) if name == "qwen_shaped" else train_tokenizer(cfg, texts)
        out[name] = hf_tokenizer(tok, cfg)
        progress(f"trained {name}: {tok.get_vocab_size()} ids in {time.perf_counter() - started:.1f} s")
    return out


def step_ms(tok: Any, obs: list[str]) -> float:
    """Mean ms of TrajectoryBuilder.add_observation over an episode of these observations."""
    b = TrajectoryBuilder(tok)
    b.start("You are a software engineering agent.", "Fix the failing test in tests/test_a.py.")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    took = 0.0
    for n, text in enumerate(obs):
        reply = [*tok.encode(f"THOUGHT: step {n}\n```bash\npytest -x tests\n```", add_special_tokens=False), end]
        b.add_output(reply, [0.0] * len(reply), "v")
        started = time.perf_counter()
        b.add_observation(f"<returncode>1</returncode>\n<output>\n{text}\n</output>")
        took += time.perf_counter() - started
    return took / len(obs) * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny tokenizer only, fewer texts and rounds")
    args = parser.parse_args(argv)
    progress = Progress(SUITE)
    meta: dict[str, Any] = {"host": host_meta(), "quick": args.quick,
                            "notes": "best of alternating rounds; MB = 1e6 UTF-8 bytes; single-threaded both"}
    rounds, min_s = (3, 0.05) if args.quick else (5, 0.2)
    obs = observations(args.quick)
    meta["texts"] = {f"{k}_{s}": len(v) for (k, s), v in obs.items()}
    progress(f"{sum(len(v) for v in obs.values())} observations in {len(obs)} cells")
    metrics: dict[str, Any] = {}
    goals = []
    for name, hf in tokenizers(["tiny"] if args.quick else ["tiny", "qwen_shaped"], progress).items():
        started = time.perf_counter()
        encoding = tiktoken_encoding(hf)
        if encoding is None:
            raise SystemExit(f"{name}: no tiktoken encoding (see the log); nothing to compare")
        metrics[f"{name}_build_and_verify_s"] = round(time.perf_counter() - started, 3)
        fast = FastTokenizer(hf, encoding)
        mismatched = 0
        speedups = []
        for (kind, size), texts in obs.items():
            mismatched += sum(fast.encode(t, add_special_tokens=False) != hf.encode(t, add_special_tokens=False)
                              for t in texts)
            total = sum(len(t.encode("utf-8")) for t in texts)
            per_call = best_rounds({"hf": functools.partial(encode_all, hf, texts),
                                    "tiktoken": functools.partial(encode_all, fast, texts)}, rounds, min_s)
            cell = f"{name}_{kind}_{size}"
            metrics[f"{cell}_hf_mb_s"] = round(total / per_call["hf"] / 1e6, 2)
            metrics[f"{cell}_tiktoken_mb_s"] = round(total / per_call["tiktoken"] / 1e6, 2)
            metrics[f"{cell}_speedup"] = round(per_call["hf"] / per_call["tiktoken"], 2)
            speedups.append(per_call["hf"] / per_call["tiktoken"])
            progress(f"{cell}: HF {metrics[f'{cell}_hf_mb_s']} MB/s, tiktoken {metrics[f'{cell}_tiktoken_mb_s']} MB/s, "
                     f"x{metrics[f'{cell}_speedup']}")
        metrics[f"{name}_speedup_geomean"] = round(math.exp(sum(map(math.log, speedups)) / len(speedups)), 2)
        metrics[f"{name}_mismatched_texts"] = mismatched
        episode = obs["pytest_log", "10KB"][:4] + obs["source", "10KB"][:4] + obs["diff", "10KB"][:4]
        steps = {"hf": min(step_ms(hf, episode) for _ in range(rounds)),
                 "tiktoken": min(step_ms(fast, episode) for _ in range(rounds))}
        metrics[f"{name}_observation_step_ms_hf"] = round(steps["hf"], 3)
        metrics[f"{name}_observation_step_ms_tiktoken"] = round(steps["tiktoken"], 3)
        goals += [Goal(f"{name}_mismatched_texts", "<=", 0, text="0 (the HF ids are the oracle)"),
                  Goal(f"{name}_speedup_geomean", ">=", 1.0, text=">= 1 (tiktoken only where faster)")]
    meta["loadavg_end"] = host_meta()["loadavg_start"]
    report(SUITE, metrics, meta, goals)
    return 0 if all(g.met(metrics.get(g.metric)) for g in goals) else 1


if __name__ == "__main__":
    sys.exit(main())
