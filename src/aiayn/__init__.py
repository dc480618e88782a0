"""aiayn: the Transformer of "Attention Is All You Need" (Vaswani et al., 2017), from its parts."""

from aiayn.config import Config, DataConfig, ModelConfig, TrainConfig
from aiayn.errors import AiaynError
from aiayn.model import Transformer

__all__ = ["AiaynError", "Config", "DataConfig", "ModelConfig", "TrainConfig", "Transformer"]
__version__ = "0.1.0"
