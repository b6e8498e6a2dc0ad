"""Parameter-efficient fine-tuning through the sink lens: adapters as hooks (``adapters``), tasks and a training
loop (``train``), the prefix's share of attention (``sinks``) and the Layer Card (``layer_card``)."""

from sinklens.peft.adapters import LoRA, METHODS, Adapter, PrefixTuning, PrefixTuningPlus, adapted, make_adapter

__all__ = ["Adapter", "LoRA", "METHODS", "PrefixTuning", "PrefixTuningPlus", "adapted", "make_adapter"]
