"""The pure half of the distributed weight sync: bucket plans, wrapper-name mapping, dtypes, the version check."""

from __future__ import annotations

import pytest

from swectl.rl.weight_sync import ParamSpec, engine_name, plan_buckets, stale_servers, sync_dtype


def _spec(name: str, n: int, dtype: str = "float32") -> ParamSpec:
    return ParamSpec(name=name, dtype=dtype, shape=[n])


def test_buckets_keep_the_order_and_stay_within_the_budget() -> None:
    specs = [_spec(f"p{i}", n) for i, n in enumerate([10, 20, 5, 40, 1, 1])]  # 40, 80, 20, 160, 4, 4 bytes
    buckets = plan_buckets(specs, 100)
    assert [[s.name for s in b] for b in buckets] == [["p0"], ["p1", "p2"], ["p3"], ["p4", "p5"]]
    assert [s for b in buckets for s in b] == specs
    assert all(sum(s.nbytes for s in b) <= 100 or len(b) == 1 for b in buckets)


def test_a_tensor_larger_than_the_budget_goes_alone() -> None:
    buckets = plan_buckets([_spec("a", 1), _spec("big", 1000), _spec("b", 1)], 16)
    assert [[s.name for s in b] for b in buckets] == [["a"], ["big"], ["b"]]


def test_one_bucket_when_everything_fits_and_none_for_nothing() -> None:
    assert len(plan_buckets([_spec("a", 3), _spec("b", 4)], 1 << 20)) == 1
    assert plan_buckets([], 10) == []


def test_bad_plans_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        plan_buckets([_spec("a", 1)], 0)
    with pytest.raises(ValueError, match="repeat: a"):
        plan_buckets([_spec("a", 1), _spec("a", 2)], 10)


def test_nbytes_follows_the_dtype_sent() -> None:
    assert ParamSpec("w", "bfloat16", [3, 4]).nbytes == 24
    assert ParamSpec("w", "float32", [3, 4]).nbytes == 48
    assert ParamSpec("s", "float32", []).nbytes == 4  # a scalar


@pytest.mark.parametrize(("wrapped", "name"), [
    ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
    ("_orig_mod.model.norm.weight", "model.norm.weight"),
    ("module._fsdp_wrapped_module.model.embed_tokens.weight", "model.embed_tokens.weight"),
    ("model.layers.3._checkpoint_wrapped_module.self_attn.q_proj.weight", "model.layers.3.self_attn.q_proj.weight"),
    ("_orig_mod.module.lm_head.weight", "lm_head.weight"),
])
def test_engine_names_drop_wrapper_prefixes(wrapped: str, name: str) -> None:
    assert engine_name(wrapped) == name


def test_floating_weights_travel_in_the_dtype_asked_integers_keep_theirs() -> None:
    assert sync_dtype("torch.float32", "auto") == "float32"
    assert sync_dtype("torch.float32", "bfloat16") == "bfloat16"
    assert sync_dtype("torch.int64", "bfloat16") == "int64"
    with pytest.raises(ValueError, match="not a floating dtype"):
        sync_dtype("float32", "int8")
    with pytest.raises(ValueError, match="cannot send"):
        sync_dtype("torch.complex64", "auto")


def test_the_version_handshake_names_servers_that_missed_the_update() -> None:
    reported = {"http://a": "7", "http://b": "6", "http://c": "7"}
    assert stale_servers("7", reported) == ["http://b"]
    assert stale_servers("6", reported) == ["http://a", "http://c"]
    assert stale_servers("7", {}) == []
