"""`aiayn export`: the command (command), what both targets share (base), Hugging Face
Transformers (hf, with aiayn.hf_model) and CTranslate2 (ctranslate2), and the model card
every export writes (modelcard).

May import: aiayn.errors, aiayn.options, aiayn.util, aiayn.config, aiayn.model,
aiayn.hf_model, aiayn.data, aiayn.runs, aiayn.inspect.
"""
