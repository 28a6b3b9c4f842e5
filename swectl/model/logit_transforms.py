"""The logit transforms a Hugging Face model config can name, for the fast paths that compute logits by hand.

The trainer's selected-logits path (remote/programs/trainer.py) and the CPU engine's lean decode forward
(remote/programs/lean_decode.py) take the output projection's result as the logits. A model whose forward then
scales or soft-caps them (Gemma 2's ``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's
``logits_scaling``) would get wrong logits there: both paths ask ``logit_transforms`` and keep transformers'
forward when it names one.
"""

from __future__ import annotations

from typing import Any

# name -> the values that leave the logits as they are (a soft cap of 0 or None is off; a scale of 1 changes nothing)
IDENTITY: dict[str, tuple[object, ...]] = {
    "final_logit_softcapping": (None, 0, 0.0),
    "logit_scale": (None, 1, 1.0),
    "logits_scaling": (None, 1, 1.0),
}


def logit_transforms(config: Any) -> list[str]:
    """The transforms ``config`` (a transformers config) sets to something other than the identity, by name."""
    return [name for name, identity in IDENTITY.items() if getattr(config, name, None) not in identity]
