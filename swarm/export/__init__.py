"""What a run gives back: the trained model in the formats people load (`python -m swarm export`).

- `state`: a run's state to export: its config, its step and every stage's saved state, from a
  checkpoint directory (the newest step in it) or from files a pipeline just wrote;
- `live`: the same from a live swarm, the newest copies its stage peers keep, fetched as a
  joining peer fetches state (the run's owner only);
- `rebuild`: the stages rebuilt as the run built them, with that state in them;
- `decoder`: a transformers causal LM as a directory `from_pretrained` loads (config, safetensors
  weights, tokenizer, generation config), a LoRA run's peft adapter or the adapter merged in;
- `zoo`: hivepipe's own models (digits_cnn, resnet18, your functions): safetensors and the config
  that rebuilds them (`load_exported`);
- `exporter`: one of those from a run's state, and at a run's end; `hub`: the Hugging Face Hub;
- `generate`: text from an exported language model (`python -m swarm generate`).
"""
