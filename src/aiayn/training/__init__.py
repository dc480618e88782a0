"""Training: the loop (loop), the data and its batch stream (stream), Adam and the schedule
(optim), the budget a run will make and what it says of it at the start (plan), which runs
may start (admission), best weights and patience (early_stopping), ranks
and collectives under torchrun (distributed), starting from another run (transfer) and the
notebooks' toy tasks (toy).

May import: aiayn.errors, aiayn.util, aiayn.config, aiayn.model, aiayn.data, aiayn.runs,
aiayn.inference, aiayn.evaluation.
"""
