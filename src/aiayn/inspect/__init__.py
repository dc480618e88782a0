"""Looking inside a model or a run: `aiayn doctor` (doctor), `aiayn info` (info), `aiayn trace`
(trace), the pictures (plots; of attention: attention_plots; the figure each is drawn on:
canvas), attention over training steps (attention_steps) and torch.nn.Transformer holding
aiayn's weights (reference).

May import: aiayn.errors, aiayn.util, aiayn.config, aiayn.model, aiayn.data, aiayn.runs,
aiayn.inference, aiayn.evaluation, aiayn.training.
"""
