"""The distributed weight sync (the fast path of docs/architecture.md 5.3) for real, on CPU: trainer rank 0 of 2
torchrun gloo ranks and two CPU engine servers form a weight group over gloo through SGLang's
``/init_weights_update_group``; a trained step's weights are broadcast bucket by bucket through
``/update_weights_from_distributed``; the engines then hold exactly the weights the trainer writes to disk, and serve
the new version. On a GPU the same code runs with NCCL (not exercised here: no GPU on this machine).
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

pytest.importorskip("transformers", reason="needs the cpu extra (pip install 'swectl[cpu]')")

from safetensors.torch import load_file

from swectl.actors.engines import Engines
from swectl.config import EngineConfig
from swectl.engine.wire import GenerateRequest, SamplingParams
from swectl.rl.shm import BatchWriter
from swectl.rl.weight_sync import plan_buckets

from .test_trainer import _batch, _vocab, _with_trainer

pytestmark = [pytest.mark.integration, pytest.mark.anyio]
FAST = {"health_interval_s": 0.3, "max_failures": 2, "start_timeout_s": 120.0}
REQUEST = GenerateRequest(input_ids=[5, 6, 7, 8], sampling_params=SamplingParams(max_new_tokens=2, temperature=0))


async def test_weights_broadcast_to_two_engines_equal_the_saved_ones(model: Path, tmp_path: Path) -> None:
    engines = Engines(EngineConfig(replicas=2, **FAST), model=str(model), log_dir=tmp_path / "engine-logs")
    seen: dict[str, object] = {}

    async def body(trainer, ready) -> None:  # type: ignore[no-untyped-def]
        assert ready.params, "Ready carries the parameters a sync sends"
        assert "lm_head.weight" not in {p.name for p in ready.params}  # tied to the embedding: not sent
        async with anyio.create_task_group() as tg:
            await tg.start(engines.run)
            group = "swectl-test-weights"
            port = await trainer.free_port()
            world = engines.weight_group_size()
            assert world == 3
            with anyio.fail_after(120):
                async with anyio.create_task_group() as join:
                    join.start_soon(trainer.join_weight_group, port, world, group, "gloo")
                    join.start_soon(engines.join_weight_group, trainer.weight_group_address, port, group, "gloo")
            assert engines.weight_group_broken() is None
            with BatchWriter() as writer:
                reply = await trainer.step(1, writer.write(_batch(1, "sft", _vocab(model), seed=1)))
            assert not reply.skipped
            buckets = plan_buckets(trainer.params, 64 * 1024)
            assert len(buckets) > 2  # the tiny model's ~0.6 MB goes in several buckets
            seconds = await engines.update_weights_distributed(
                buckets, "1", lambda: trainer.broadcast_weights(group, buckets))
            seen["seconds"] = seconds
            await trainer.save_weights(tmp_path / "saved")
            saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
            original = load_file(str(model / "model.safetensors"))
            for server in engines._servers:
                assert server.client is not None
                for name in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight", "model.norm.weight"):
                    got = await server.client.get_weights_by_name(name, 64)
                    want = saved[name].reshape(-1)[:64].tolist()
                    assert got == pytest.approx(want, rel=1e-6, abs=1e-7), name
                    if name != "model.norm.weight":  # trained: the values moved (a norm may stay put)
                        assert got != pytest.approx(original[name].reshape(-1)[:64].tolist(), abs=1e-9), name
                assert await server.client.get_weight_version() == "1"
            result = await engines.route("k").generate(REQUEST)
            assert result.weight_version == "1"
            tg.cancel_scope.cancel()

    await _with_trainer(model, tmp_path / "run", body)
    assert isinstance(seen["seconds"], float)
