"""What the command line's options may name beside the config's settings (those stand in
aiayn.config): the devices, the engines, the export targets and CTranslate2's weight types,
and how many lines `aiayn translate -i` decodes at a time.

They stand here, in a module that imports nothing, so that aiayn.cli builds its parser
without torch: `aiayn --help` and a mistyped option answer in a fraction of a second. The
modules that act on them (aiayn.util.device, aiayn.inference.engines, aiayn.export,
aiayn.inference.files) take them from here.
"""

DEVICES = ("auto", "cpu", "cuda", "mps")  # --device (aiayn.util.device.choose_device)
ENGINES = ("aiayn", "ctranslate2")  # --engine (aiayn.inference.engines.engine_class)
EXPORT_TARGETS = ("hf", "ctranslate2")  # aiayn export --to
# CTranslate2's weight types (its Converter's --quantization); none keeps float32.
QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16",
                 "bfloat16", "float32")
# aiayn translate --chunk-lines: input lines decoded, written and recorded at once. At the end
# of a chunk the CPU streams wait for its last batches: 2,000 lines lost 7-9% of the lines/s
# of one call, 10,000 0-4% (docs/translating.md#large-files-progress-and-resume).
CHUNK_LINES = 10_000
