"""Translating: the one search value (settings), greedy, beam and sampled search over the KV
cache (search; what may be chosen besides the likeliest: sampling), the steps that search
and serve's continuous search (joinable) both drive (steps) and the k best of each row of
log-probabilities that a beam step takes (topk), the one decode driver (translator) and what
it takes and gives (translations), the engines it drives behind one interface (engine:
aiayn's own, aiayn_engine, or CTranslate2's, ct2; by --engine name: engines), the batch
budget (budget), the output layer's kernel (kernels), int8 decoding (int8) through aiayn's
own C kernel (native), attention maps of a translation (attention) and word alignments from
them (align), files of any length translated chunk by chunk, resumable (files), the rules
by which lines of text are read from files and stdin (lines), and the teacher-forced scores
of given pairs (scoring).

May import: aiayn.errors, aiayn.options, aiayn.util, aiayn.config, aiayn.model, aiayn.data, aiayn.runs.
"""
