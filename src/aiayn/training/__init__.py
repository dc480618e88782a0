"""Training: the loop (loop), the data and its batch stream (stream), Adam and the schedule
(optim), which runs may start (admission), best weights and patience (early_stopping), ranks
and collectives under torchrun (distributed), starting from another run (transfer) and the
notebooks' toy tasks (toy).

May import: aiayn.errors, aiayn.util, aiayn.config, aiayn.model, aiayn.data, aiayn.runs,
aiayn.inference, aiayn.evaluation.
"""
