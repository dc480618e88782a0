"""aiayn's Transformer as a Transformers model: a thin wrapper over ``model.py``.

``aiayn export RUN --to hf`` copies this file, ``model.py``, ``cache.py`` and ``loss.py``
(verbatim) beside the weights of a model that Transformers' Marian cannot express
(pre-norm, QK-norm). ``config.json`` names the classes below in ``auto_map``, so that

    AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True)

builds aiayn's own ``Transformer`` and ``generate`` decodes with it. The architecture lives
in ``model.py`` alone; this file only translates between Transformers' calling conventions
(attention masks, encoder outputs, a cache that beam search reorders) and aiayn's. It
imports nothing of aiayn but those three files (torch alone), so the folder works where
aiayn is not installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import Tensor, nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput
from transformers.utils import ModelOutput

from .cache import KVCache
from .model import PositionalEncoding, Transformer, sinusoid_table


class AiaynConfig(PretrainedConfig):
    """``aiayn``: the fields of aiayn's ModelConfig, as the run's config.yaml has them."""

    model_type = "aiayn"

    def __init__(self, aiayn: dict | None = None, **kwargs):
        self.aiayn = dict(aiayn or {})
        kwargs.setdefault("is_encoder_decoder", True)
        kwargs.setdefault("vocab_size", self.aiayn.get("tgt_vocab_size"))
        super().__init__(**kwargs)


@dataclass
class AiaynOutput(ModelOutput):
    """Logits over the target vocabulary; ``cache``: aiayn's KVCache, for the next step."""

    loss: Tensor | None = None
    logits: Tensor | None = None
    cache: KVCache | None = None
    encoder_last_hidden_state: Tensor | None = None


class AiaynEncoder(nn.Module):
    """What ``generate`` runs once per batch: source ids -> encoder memory."""

    main_input_name = "input_ids"

    def __init__(self, model: Transformer):
        super().__init__()
        self.transformer = [model]  # a list: not a second registered copy of the weights

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                **kwargs) -> BaseModelOutput:
        model = self.transformer[0]
        src_pad = source_padding(model, input_ids, attention_mask, input_ids.shape)
        return BaseModelOutput(last_hidden_state=model.encode(input_ids, src_pad))


def source_padding(model: Transformer, input_ids: Tensor | None, attention_mask: Tensor | None,
                   shape: torch.Size) -> Tensor:
    """(B, S) True at padding: from Transformers' attention mask, else from the pad id, else
    none (a step of ``generate`` that was given neither)."""
    if attention_mask is not None:
        return attention_mask.eq(0)
    if input_ids is not None:
        return model.src_pad_mask(input_ids)
    return torch.zeros(shape, dtype=torch.bool)


class AiaynForConditionalGeneration(PreTrainedModel, GenerationMixin):
    """aiayn's encoder-decoder Transformer behind Transformers' seq2seq interface."""

    config_class = AiaynConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"

    def __init__(self, config: AiaynConfig):
        super().__init__(config)
        cfg = SimpleNamespace(**config.aiayn)
        self.model = Transformer(cfg)
        self.encoder = AiaynEncoder(self.model)
        # The matrices aiayn shares (model.tie_embeddings), stored once in the weights file.
        target = "model.tgt_embed.embedding.weight"
        tied = {"decoder": ["model.generator.proj.weight"],
                "all": ["model.generator.proj.weight", "model.src_embed.embedding.weight"]}
        self._tied_weights_keys = dict.fromkeys(tied.get(cfg.tie_embeddings, []), target)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """The weights come from the file (aiayn's own initialisation is Transformer's); the
        positional table, a formula, is computed again (Transformers builds it empty)."""
        if isinstance(module, PositionalEncoding):
            with torch.no_grad():
                module.table.copy_(sinusoid_table(*module.table.shape))

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """Transformers' loading, then the index that aiayn derives from the loaded mask."""
        model = super().from_pretrained(*args, **kwargs)
        model.model.generator._index()
        return model

    def get_encoder(self, *args, **kwargs) -> AiaynEncoder:
        return self.encoder

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # aiayn's KVCache, made by forward and reordered by _reorder_cache

    def _reorder_cache(self, cache: KVCache, beam_idx: Tensor) -> KVCache:
        cache.reorder(beam_idx)
        return cache

    def prepare_inputs_for_generation(self, input_ids: Tensor, cache: KVCache | None = None,
                                      attention_mask: Tensor | None = None,
                                      encoder_outputs=None, use_cache: bool | None = None,
                                      **kwargs) -> dict:
        """The decoder ids not yet in the cache (all of them at the first step)."""
        if cache is not None:
            input_ids = input_ids[:, cache.length:]
        return {"decoder_input_ids": input_ids, "cache": cache, "attention_mask": attention_mask,
                "encoder_outputs": encoder_outputs, "use_cache": use_cache}

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                decoder_input_ids: Tensor | None = None, encoder_outputs=None,
                cache: KVCache | None = None, use_cache: bool | None = None,
                labels: Tensor | None = None, **kwargs) -> AiaynOutput:
        """Teacher forcing (``labels`` gives the summed cross-entropy over real tokens, as
        aiayn's loss with no smoothing, divided by their count) or one decoding step."""
        model = self.model
        if encoder_outputs is None:
            encoder_outputs = self.encoder(input_ids, attention_mask)
        memory = encoder_outputs[0]
        src_pad = source_padding(model, input_ids, attention_mask, memory.shape[:2]).to(memory.device)
        if decoder_input_ids is None and labels is not None:
            decoder_input_ids = shift_right(labels, self.config.decoder_start_token_id,
                                            model.cfg.pad_id)
        if use_cache and cache is None:
            cache = model.new_cache()
        hidden = model.decode(decoder_input_ids, memory, src_pad, cache if use_cache else None)
        logits = model.generator(hidden)
        loss = None
        if labels is not None:
            real = labels.ne(model.cfg.pad_id) & labels.ne(-100)
            loss = torch.nn.functional.cross_entropy(logits[real], labels[real])
        return AiaynOutput(loss=loss, logits=logits, cache=cache if use_cache else None,
                           encoder_last_hidden_state=memory)


def shift_right(labels: Tensor, start_id: int, pad_id: int) -> Tensor:
    """Decoder input for labels: [start] + labels[:-1], Transformers' -100 read as padding."""
    shifted = labels.new_full(labels.shape, pad_id)
    shifted[:, 1:] = labels[:, :-1].masked_fill(labels[:, :-1].eq(-100), pad_id)
    shifted[:, 0] = start_id
    return shifted
