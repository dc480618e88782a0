"""Translating: the search as one value, resolved once (settings), greedy, beam and sampled
search over the KV cache (search) with the repetition guard and sampling (sampling), the beam
search that sentences join and leave (joinable), the one decode driver (translator), the
engines it drives (engines: aiayn's search or CTranslate2's, ct2), the batch budget (budget),
the output layer's kernel (kernels), attention maps of a translation (attention) and word
alignments from them (align).

May import: aiayn.errors, aiayn.util, aiayn.config, aiayn.model, aiayn.data, aiayn.runs.
"""
