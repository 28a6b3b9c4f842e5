"""swectl.model.logit_transforms: which configs the hand-computed logit paths (trainer, lean decode) must refuse."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from swectl.model.logit_transforms import logit_transforms


@pytest.mark.parametrize(("fields", "named"), [
    ({}, []),
    ({"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1}, []),
    ({"final_logit_softcapping": 0.0}, []),
    ({"final_logit_softcapping": 30.0}, ["final_logit_softcapping"]),
    ({"final_logit_softcapping": 1.0}, ["final_logit_softcapping"]),  # a cap of 1 squashes every logit into (-1, 1)
    ({"logit_scale": 0.0625}, ["logit_scale"]),
    ({"logits_scaling": 8.0, "logit_scale": 2}, ["logit_scale", "logits_scaling"]),
])
def test_logit_transforms_names_what_changes_the_logits(fields: dict, named: list[str]) -> None:
    assert logit_transforms(SimpleNamespace(**fields)) == named


def test_a_real_gemma2_config_is_named() -> None:
    transformers = pytest.importorskip("transformers")
    assert logit_transforms(transformers.Gemma2Config()) == ["final_logit_softcapping"]
    assert logit_transforms(transformers.Qwen3Config()) == []
