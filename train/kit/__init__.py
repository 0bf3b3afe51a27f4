"""What every training program shares, so that a program says only what is particular to it:

- `start`: the start of every run (signals, settings, devices, out_dir, the observer) and `Run.loop`;
- `train_settings`, `settings`, `rules`: the common settings, declared once, their parser and their rules;
- `loop`, `metrics`, `plots`, `peak_flops`: the shared loop and what it writes and measures;
- `resume`, `signals`, `devices`, `observe` (with `loggers`, `compile_cache`): exact resume, stopping cleanly,
  the mesh and the processes, looking inside a run;
- `text`: what the programs that train on text share (the dataset, the loss estimates, GPT-2's weights).

Imports nothing, so that `from train.kit import signals` stays cheap for a program's first line.
"""
