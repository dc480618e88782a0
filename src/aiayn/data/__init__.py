"""Data: where sentence pairs come from (corpora, the spec registry; the Bible's SWORD
modules: bible; what every reader builds on: pairs), `aiayn prepare` (prepare), the
tokenizers (tokenizer), token ids on disk (tokenids), a prepared directory read back
(prepared), the length-bucketed batcher (batching), what changes with a side's language
(languages) and several corpora in one directory with the tags of their directions
(directions).

May import: aiayn.errors, aiayn.util, aiayn.config.
"""
