"""SinkLM, the model ``sinklens train`` trains: the module (``model``), attention variants (``variants``), its
config (``config``, parsed from flags by tyro), tokenizer, step-0 models (``init``) and the checkpoint format
(``checkpoint``, ``run_folder``, ``trainer_state``). Loading, origins and the trainer read it; it imports none
of them."""
