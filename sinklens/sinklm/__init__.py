"""SinkLM, the model ``sinklens train`` trains: module, attention variants, config, tokenizer, step-0 models and
checkpoint format. Loading, origins and the trainer read it; it imports none of them."""
