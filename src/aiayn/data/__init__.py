"""Data: where sentence pairs come from (corpora, the spec registry; the Bible's SWORD
modules: bible; what every reader builds on: pairs), `aiayn prepare` (prepare), the
tokenizers (tokenizer), token ids on disk (tokenids), a prepared directory read back
(prepared), the length-bucketed batcher (batching) and what changes with a side's language
(languages).

May import: aiayn.errors, aiayn.util, aiayn.config.
"""
