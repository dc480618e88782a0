"""A run directory, as `aiayn train` writes it and every later command reads it: its files,
config, tokenizer, metrics and weights, and the model its config describes (directory), and
checkpoints that survive a crash and load without unpickling (checkpoint).

May import: aiayn.errors, aiayn.util, aiayn.config, aiayn.model, aiayn.data.
"""
