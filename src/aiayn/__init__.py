"""aiayn: the Transformer of "Attention Is All You Need" (Vaswani et al., 2017), from its parts.

The commands are reachable from Python too (imported on first use, so ``import aiayn``
stays light)::

    import aiayn

    aiayn.prepare_from_run("runs/web", "data/kjv-spa", corpus="bible:kjv-spa")
    aiayn.train(None, "data/kjv-spa", "runs/ft", init_from="runs/web:best")  # `aiayn train`
    print(aiayn.doctor("runs/ft"))                     # `aiayn doctor`; .ok is the verdict
    aiayn.run_info("runs/ft")["best"]                  # `aiayn info --json`
    aiayn.Translator.from_pretrained("runs/ft").translate(["In the beginning."])
"""

from importlib import import_module

from aiayn.config import Config, DataConfig, ModelConfig, TrainConfig
from aiayn.errors import AiaynError

# name -> module that defines it (loaded by __getattr__ when first asked for: torch too)
_LAZY = {"Transformer": "aiayn.model", "train": "aiayn.training.loop", "doctor": "aiayn.inspect.doctor",
         "run_info": "aiayn.inspect.info", "prepare_from_run": "aiayn.training.transfer",
         "Translator": "aiayn.inference.translator", "load_run": "aiayn.runs.directory",
         "evaluate_run": "aiayn.evaluation.evaluate"}

__all__ = ["AiaynError", "Config", "DataConfig", "ModelConfig", "TrainConfig", *_LAZY]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'aiayn' has no attribute {name!r}")
