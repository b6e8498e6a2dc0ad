"""SinkLM, the model ``sinklens train`` trains: its module, attention variants, config, tokenizer and
checkpoint format. Loading, origins and the trainer all read it, so it imports none of them.

* :mod:`~sinklens.sinklm.model` — :class:`~sinklens.sinklm.model.SinkLM`, a TransformerLens ``HookedRootModule``;
* :mod:`~sinklens.sinklm.variants` — the attention variants (registry by name);
* :mod:`~sinklens.sinklm.config` — ``ModelConfig`` and the run's ``TrainConfig``, parsed from flags by tyro;
* :mod:`~sinklens.sinklm.init` — a SinkLM at step 0 (:func:`~sinklens.sinklm.init.sinklm_at_init`);
* :mod:`~sinklens.sinklm.checkpoint` — run folders: save, verify and load checkpoints;
* :mod:`~sinklens.sinklm.tokenizer` — the byte-level BPE tokenizer of text runs.
"""
