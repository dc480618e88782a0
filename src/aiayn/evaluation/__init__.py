"""Scores: `aiayn evaluate` and the validation during training (evaluate), sacreBLEU's BLEU
and chrF and the error rates (metrics).

May import: aiayn.errors, aiayn.util, aiayn.config, aiayn.model, aiayn.data, aiayn.runs,
aiayn.inference.
"""
