"""Parameter-efficient fine-tuning through the sink lens: prefix-tuning, Prefix-Tuning+ and LoRA as hooks
(:mod:`~sinklens.peft.adapters`), offline tasks and a small training loop (:mod:`~sinklens.peft.train`),
the prefix's share of attention (:mod:`~sinklens.peft.sinks`) and the Layer Card
(:mod:`~sinklens.peft.layer_card`)."""

from sinklens.peft.adapters import LoRA, METHODS, Adapter, PrefixTuning, PrefixTuningPlus, adapted, make_adapter

__all__ = ["Adapter", "LoRA", "METHODS", "PrefixTuning", "PrefixTuningPlus", "adapted", "make_adapter"]
