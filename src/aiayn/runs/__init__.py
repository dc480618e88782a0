"""A run directory, as `aiayn train` writes it and every later command reads it: its files,
config, tokenizer and weights, and the model its config describes (directory), its metrics
log (metrics), and checkpoints that survive a crash and load without unpickling
(checkpoint).

May import: aiayn.errors, aiayn.util, aiayn.config, aiayn.model, aiayn.data.
"""
