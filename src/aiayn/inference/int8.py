"""Decoding in int8 on a CPU (`--int8`), aiayn's own engine: every linear layer of the encoder
and the decoder and the output layer compute x W^T + b with W in 7-bit integers (one scale per
output row) and each row of x quantized to 7 bits on its own scale
(``aiayn.inference.native.PackedInt8``); a step's attention, QK-norm and log-softmax run in
aiayn's C kernels too, over a cache that beams read in place (``aiayn.cache.Store``), its keys
and values in float16, and after a search's first step each decoder layer is one call of
them (``NativeDecoderLayer``); each encoder layer is one call too (``NativeTransformer.encode``),
its attention and norms in fp32.

``int8_decoding`` gives both pieces a search needs: ``int8_model``'s copy of the model, which
computes so (the model given does not change: the copy shares its other modules and
weights), and ``Int8Output``, the output layer's product and softmax as a
``model.OutputKernel``, as ``aiayn.inference.kernels``' oneDNN product is: the searches and
the model do not change. Both pack the weights once, so the weights must not change while
they decode (a loaded run's do not).

int8 changes the translations a little (held to a BLEU and agreement tolerance, not to
exactness: tests/inference/test_int8.py); fp32 stays the reference of every exactness test.
The figures: docs/translating.md#int8-decoding. At about 670 lines the module is over the
house's ~500: the int8 model's modules, its whole-step and joining calls and the places and
weights those calls read are one contract with the kernels, and read best together.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.inference import native
from aiayn.inference.native import PackedInt8
from aiayn.model import DecoderLayer, EncoderLayer, HeadNorm, MultiHeadAttention, Transformer, padding_mask


class Int8Output:
    """The output layer's product (``model.OutputKernel``) in int8 for one generator whose
    weights do not change while it decodes: its allowed rows are packed once, here, and every
    call computes with them. The weight a caller passes must be those rows (as
    ``Generator.output_logits`` passes them): a weight of another shape is refused."""

    def __init__(self, generator):
        weight, bias = generator.allowed_rows()
        self.shape = tuple(weight.shape)
        self.product = PackedInt8(weight, bias)

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        if tuple(weight.shape) != self.shape:
            raise ValueError(f"Int8Output packed a {self.shape} output layer, "
                             f"got {tuple(weight.shape)}")
        return self.product(x)

    def log_softmax(self, logits: Tensor) -> Tensor:
        """The softmax after the output layer, in aiayn's kernel (``native.log_softmax``):
        the searches and scoring call it (``aiayn.inference.kernels.log_softmax``)."""
        return native.log_softmax(logits)

    def top_log_softmax(self, logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """The k best log-probabilities of each row and their columns (a beam step's), the
        same floats as ``log_softmax`` and then topk: ``native.top_log_softmax``."""
        return native.top_log_softmax(logits, k)

    def mask_step(self, logits: Tensor, never, history, n: int, skip=None,
                  to_column: Tensor | None = None) -> None:
        """The columns a step may not choose, -inf in place (the never-generated pieces and the
        repetition guard's), in one call of aiayn's kernel (``native.mask_step``): the searches
        call it (``steps.DecoderState.next_logits``)."""
        native.mask_step(logits, never, history, n, skip, to_column)

    def beam_step(self, model: nn.Module, tokens: Tensor, scores: Tensor, src_pad: Tensor, cache,
                  history, never, n_gram: int, to_column: Tensor | None, ids: Tensor | None, width: int,
                  candidates: int, totals=None, most: int = 1, wake: int | None = None,
                  finished=None):
        """A whole beam step of ``model`` (``int8_model``'s) in one call of aiayn's kernel
        (``NativeTransformer.beam_step``): the step's decoding, masks (``never``, the guard's
        ``n_gram`` over ``history``), top ``width`` and ``candidates``; its answer
        (``beam_choose``'s, the rows followed, the cache's slot table and the ``StepAgain``
        that repeats the step), or None where it does not take it; with ``totals``, up to
        ``most`` steps while nothing ends or arrives on ``wake``, with ``finished`` also past
        hypotheses that end while no sentence is done (``StepAgain``'s).
        ``steps.DecoderState.beam_step`` calls it."""
        if not isinstance(model, NativeTransformer) or candidates > native.MAX_CANDIDATES:
            return None
        key = (tuple(never), n_gram, width, candidates)
        seen = self.__dict__.get("_choice")
        if seen is None or seen[0] != key or seen[1] is not to_column or seen[2] is not ids:
            seen = self._choice = (key, to_column, ids,
                                   native.choice(never, n_gram, to_column, ids, width, candidates))
        return model.beam_step(self.product, seen[3], tokens, scores, src_pad, cache, history, totals,
                               most, wake, finished)

    def beam_choose(self, best: Tensor, columns: Tensor, scores: Tensor, ids: Tensor | None,
                    width: int, candidates: int):
        """A beam step's candidates and survivors after the top-k, in one call of aiayn's
        kernel (``native.beam_choose``): ``steps.expand`` calls it."""
        return native.beam_choose(best, columns, scores, ids, width, candidates)


class Int8Linear(nn.Module):
    """An ``nn.Linear`` whose weights do not change, computed in int8 (``PackedInt8``). It
    keeps the linear's own weight and bias (the same tensors, not copies), so that its
    model's ``state_dict`` is the fp32 model's (a serving lane's process starts from it)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.product = PackedInt8(linear.weight, linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.product(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def _same_module(cls, module: nn.Module) -> nn.Module:
    """``module`` as an instance of its subclass ``cls``: a shallow copy sharing its
    submodules, parameters and buffers (so its ``state_dict`` is the module's)."""
    copy = cls.__new__(cls)
    copy.__dict__ = dict(module.__dict__)
    for name in ("_modules", "_parameters", "_buffers"):
        copy.__dict__[name] = dict(module.__dict__[name])
    return copy


class NativeHeadNorm(HeadNorm):
    """A ``model.HeadNorm`` (QK-norm) computed by aiayn's kernel (``native.rms_norm``) on float32
    CPU input of a multiple of 8 features, as the model computes it otherwise."""

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32 and x.is_cpu and x.size(-1) % 8 == 0 and not x.requires_grad:
            return native.rms_norm(x, self.weight, self.eps)
        return super().forward(x)


class StepAttention(MultiHeadAttention):
    """A ``model.MultiHeadAttention`` whose product of one new query per row, a decoding step's,
    runs in aiayn's kernel (``native.step_attention``: PyTorch's fused attention spends most of
    its time on setup at that size); every other product as the model computes it. Its
    self-attention reads an indirect cache's ``Store`` in place (``cache.KVCache``): a beam's
    reorder then copies no K/V. The keys and values it keeps (the Store's, the memory's) are
    float16: a step reads all of them, and reads half the bytes so (their rounding, 2^-11 of
    a value, is far below the products' 7-bit inputs'; a trained model's keys and values lie
    far inside float16's range of +-65,504)."""

    kept = torch.float16  # the dtype of the K/V it keeps between steps

    def forward(self, x: Tensor, memory: Tensor | None = None, mask: Tensor | None = None,
                is_causal: bool = False, cache: dict[str, Tensor] | None = None,
                need_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        store = None if cache is None or self.cross else cache.get("store")
        if store is None or x.size(1) != 1 or need_weights or self.record_weights or is_causal:
            return super().forward(x, memory, mask, is_causal, cache, need_weights)
        q, k, v = self.self_qkv(x)
        store.append(_as(k, self.kept), _as(v, self.kept))
        if not native.step_attention_fits(q, store.k, store.v, mask, store.length, store.ancestry):
            k, v = store.gather()
            return self.concat(self.attend(q, k, v, mask, False, False)[0])
        return self.concat(native.step_attention(q, store.k, store.v, mask, store.length,
                                                 store.ancestry))

    def memory_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        k, v = super().memory_kv(memory)
        if self.training or k.requires_grad:
            return k, v
        return _as(k, self.kept), _as(v, self.kept)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
               need_weights: bool) -> tuple[Tensor, Tensor | None]:
        if not (self.training or q.requires_grad):  # read as kept, by every pass alike
            k, v = _as(k, self.kept), _as(v, self.kept)
        if (need_weights or is_causal or self.training or q.requires_grad
                or not native.step_attention_fits(q, k, v, mask)):
            return super().attend(q, _as(k, q.dtype), _as(v, q.dtype), mask, is_causal, need_weights)
        return native.step_attention(q, k, v, mask), None


class NativeDecoderLayer(DecoderLayer):
    """A ``model.DecoderLayer`` whose step, one new position per row over an indirect cache (a
    search's, after its first step), runs in one call of aiayn's kernel
    (``native.decoder_layer_step``: ``layers.c``) with the same products, attention and
    QK-norm as its modules: at a serving lane's few rows, computing the layer module by module
    spent most of a step in Python. Every other call (a first step, a prefix, training, weights
    kept, a shape the kernel does not take) is the model's own ``forward``. Its modules must be
    ``int8_model``'s (``Int8Linear``, ``StepAttention``) and its weights must not change."""

    def forward(self, x: Tensor, memory: Tensor, src_mask: Tensor | None, self_mask: Tensor | None,
                is_causal: bool, cache: dict[str, dict[str, Tensor]] | None = None) -> Tensor:
        if x.dim() == 3 and x.size(1) == 1 and not is_causal:
            out = x.reshape(x.size(0), x.size(2)).clone()
            if self.step(out, src_mask, self_mask, cache):
                return out.view_as(x)
        return super().forward(x, memory, src_mask, self_mask, is_causal, cache)

    def step(self, x: Tensor, src_mask: Tensor | None, self_mask: Tensor | None,
             cache: dict[str, dict[str, Tensor]] | None) -> bool:
        """The layer's step in one call of the kernel, in place on x (rows, d_model), a tensor
        the caller owns: True; or False, x unchanged, where the kernel does not take it."""
        if (x.requires_grad or x.dim() != 2 or x.dtype != torch.float32 or not x.is_cpu
                or not x.is_contiguous()):
            return False
        places = self._places(x.size(0), src_mask, self_mask, cache)
        if places is None:
            return False
        native.decoder_layer_step(self._weights, places, x)
        cache["self"]["store"].length += 1
        return True

    @property
    def _weights(self) -> native.LayerWeights | None:
        """The layer's weights as the kernel takes them, gathered at the first step (None where
        the kernel cannot compute this layer)."""
        if "_native" not in self.__dict__:
            self.__dict__["_native"] = _layer_weights(self)
        return self.__dict__["_native"]

    def _places(self, B: int, src_mask: Tensor | None, self_mask: Tensor | None,
                cache: dict | None) -> native.StepPlaces | None:
        """Where the step of B rows reads and writes, or None where the kernel does not take it.
        (Called at every step of every layer: each shape and stride is read once.)"""
        modules = self._modules  # not through nn.Module's __getattr__, at every step
        if (cache is None or self.training or modules["self_attn"].record_weights
                or modules["cross_attn"].record_weights or self._weights is None):
            return None
        store, cross = cache["self"].get("store"), cache["cross"]
        if store is None or store.keys is None or store.keys.dtype != StepAttention.kept or store.rows != B:
            return None
        k, v = cross.get("k"), cross.get("v")
        if k is None or k.dtype not in (torch.float16, torch.float32) or v.dtype != k.dtype:
            return None
        sets, _, sources, _ = shape = k.shape
        k_strides, v_strides = k.stride(), v.stride()
        position = store.length
        if (v.shape != shape or k_strides[3] != 1 or v_strides[3] != 1 or B % sets
                or not _fits_mask(self_mask, B, position + 1) or not _fits_mask(src_mask, sets, sources)):
            return None
        ancestry = store.ancestry
        a_rows, a_columns = ancestry.shape
        if a_columns > 1 and ancestry.stride(1) != 1:
            return None
        store.reserve(B, position + 1)  # may move the store: its places are read after
        keys, values = store.keys, store.values
        slot_pos, slot_row = keys.stride()[:2]
        return native.StepPlaces(
            keys.data_ptr(), values.data_ptr(), slot_row, slot_pos, position,
            ancestry.data_ptr() if a_rows * a_columns else None, ancestry.stride(0), a_columns,
            *_mask_place(self_mask), k.data_ptr(), v.data_ptr(), *k_strides[:3], *v_strides[:3],
            sources, B // sets, int(k.dtype == torch.float16), *_mask_place(src_mask))


class NativeTransformer(Transformer):
    """``int8_model``'s copy of the model, whose decoding step after a search's first (one new
    position per row over an indirect cache) embeds its tokens in one call of aiayn's kernel
    (``native.embed_step``) and runs its ``NativeDecoderLayer``s' ``step`` in place on that
    embedding: at a serving lane's few rows the module calls and small tensor operations
    between the kernels cost as much as the kernels. The same floats as ``Transformer.decode``,
    which every other call (a first step, a prefix, training, autocast) is. Its encoder embeds
    so too and runs each layer in one call (``native.encoder_layer``: a sentence joining a
    serving lane's search spent ~2 ms in the modules' calls), equal to ``Transformer.encode``
    up to rounding (the attention is ``native.step_attention``'s, not PyTorch's)."""

    def encode(self, src: Tensor, src_pad: Tensor | None = None) -> Tensor:
        may_attend = self._kernel_encodes(src, src_pad) if self._encoder_weights is not None else None
        if may_attend is None:
            return super().encode(src, src_pad)
        n, S = src.shape
        x = native.embed_step(self.src_embed.embedding.weight, self.src_embed.scale, self.src_pos.table,
                              src.reshape(-1), torch.arange(S).repeat(n)).view(n, S, -1)
        for weights in self._encoder_weights:
            native.encoder_layer(weights, x, may_attend)
        norm = self.encoder.norm  # as encode_memory computes it (encoded_cache): the same floats
        if isinstance(norm, nn.LayerNorm) and norm.weight is not None and norm.bias is not None:
            return native.layer_norm(x, norm.weight, norm.bias, norm.eps)
        return norm(x)

    def _kernel_encodes(self, src: Tensor, src_pad: Tensor | None) -> Tensor | None:
        """The (n, S) uint8 may-attend mask the kernel's encoding takes for ``src``, or None
        where the modules encode it (training, gradients, autocast, not the CPU, an empty or
        over-long batch, attention recorded, a padding mask that broadcasts)."""
        if (self.training or not src.is_cpu or torch.is_grad_enabled() or torch.is_autocast_enabled("cpu")
                or src.dim() != 2 or 0 in src.shape or src.size(1) > self.src_pos.max_len
                or any(layer.self_attn.record_weights for layer in self.encoder.layers)):
            return None
        self._check_ids(src, "src")
        src_pad = self.src_pad_mask(src) if src_pad is None else src_pad
        if src_pad.shape != src.shape:  # a mask that broadcasts: the modules take it
            return None
        return (~src_pad).to(torch.uint8).contiguous()

    @property
    def _encoder_weights(self) -> list[native.LayerWeights] | None:
        """The encoder layers' weights as ``native.encoder_layer`` takes them, gathered at the
        first encoding (None where the kernel cannot compute one of them)."""
        if "_native_encoder" not in self.__dict__:
            weights = [_layer_weights(layer) for layer in self.encoder.layers]
            self.__dict__["_native_encoder"] = None if None in weights else weights
        return self.__dict__["_native_encoder"]

    def encoded_cache(self, src: Tensor, src_pad: Tensor | None = None):
        """``Transformer.encoded_cache``: with the kernel, the encoder and each decoder layer's
        cross-attention K/V in one call (``native.encode_memory``: ``encode`` and ``new_cache``
        made a dozen calls from Python, ~0.2 ms of a sentence joining a serving lane), the same
        floats as they give (``encode``'s final LayerNorm is the kernel's too)."""
        weights = self._memory_weights
        may_attend = None
        if weights is not None and not any(attn.record_weights for attn, _, _ in self._memory_layers):
            may_attend = self._kernel_encodes(src, src_pad)
        if may_attend is None:
            return super().encoded_cache(src, src_pad)
        cache = Transformer.new_cache(self)
        kept = native.encode_memory(weights, src, may_attend, self.cfg.d_model)
        for (k, v), layer_cache in zip(kept, cache.layers, strict=True):
            layer_cache["cross"].update(k=k, v=v)
        return cache

    @property
    def _memory_weights(self) -> native.MemoryWeights | None:
        """What ``native.encode_memory`` takes, gathered at the first call (None where the kernel
        cannot compute the encoder or a decoder layer's memory K/V)."""
        if "_native_memory_weights" not in self.__dict__:
            self.__dict__["_native_memory_weights"] = self._gather_memory_weights()
        return self.__dict__["_native_memory_weights"]

    def _gather_memory_weights(self) -> native.MemoryWeights | None:
        encoder, memory = self._encoder_weights, self._memory_layers
        norm = self.encoder.norm
        final = isinstance(norm, nn.LayerNorm) and norm.weight is not None and norm.bias is not None
        if (not encoder or memory is None or not (final or isinstance(norm, nn.Identity))
                or len({attn.n_heads for attn, _, _ in memory}) != 1
                or len({attn.k_norm.eps for attn, _, gain in memory if gain is not None}) > 1):
            return None
        embedding, table = self.src_embed.embedding.weight.detach(), self.src_pos.table
        if (embedding.dtype != torch.float32 or table.dtype != torch.float32 or not embedding.is_contiguous()
                or not table.is_contiguous()):
            return None
        gains = [gain for _, _, gain in memory]
        weights = native.MemoryWeights(
            (native.LayerWeights * len(encoder))(*encoder), len(encoder), embedding.data_ptr(),
            table.data_ptr(), embedding.size(0), table.size(0), self.src_embed.scale,
            norm.weight.data_ptr() if final else None, norm.bias.data_ptr() if final else None,
            norm.eps if final else 0.0, (native.Product * len(memory))(*(p for _, p, _ in memory)),
            (ctypes.c_void_p * len(memory))(*(None if g is None else g.data_ptr() for g in gains)),
            len(memory), memory[0][0].n_heads,
            next((attn.k_norm.eps for attn, _, gain in memory if gain is not None), 0.0))
        weights.keep = [embedding, table, gains, encoder, memory]  # alive with it
        return weights

    def new_cache(self, memory: Tensor | None = None):
        """``Transformer.new_cache``, with the memory's cross-attention K/V of each decoder layer
        in one call of aiayn's kernel (``native.memory_kv``: a sentence joining a serving lane
        spent ~0.25 ms in the modules' calls), the same floats as the modules compute."""
        layers = self._memory_layers
        if (memory is None or layers is None or self.training or torch.is_grad_enabled()
                or torch.is_autocast_enabled("cpu") or not memory.is_cpu or memory.dtype != torch.float32
                or memory.dim() != 3 or any(a.record_weights for a, _, _ in layers)):
            return super().new_cache(memory)
        cache, memory = super().new_cache(), memory.contiguous()
        for (attn, product, gain), layer_cache in zip(layers, cache.layers, strict=True):
            eps = 0.0 if gain is None else attn.k_norm.eps
            k, v = native.memory_kv(product, memory, attn.n_heads, gain, eps)
            layer_cache["cross"].update(k=k, v=v)
        return cache

    @property
    def _memory_layers(self) -> list[tuple[StepAttention, native.Product, Tensor | None]] | None:
        """Each decoder layer's cross-attention, its K/V product and its keys' QK-norm gain (or
        None) as ``native.memory_kv`` takes them, gathered at the first call (None where the
        kernel cannot compute one of them)."""
        if "_native_memory" not in self.__dict__:
            layers = []
            for layer in self.decoder.layers:
                attn = getattr(layer, "cross_attn", None)
                norm = getattr(attn, "k_norm", None)
                if (not isinstance(attn, StepAttention) or attn.kept != torch.float16
                        or not isinstance(attn.kv_proj, Int8Linear) or attn.d_k % 8
                        or not isinstance(norm, NativeHeadNorm | nn.Identity)
                        or (isinstance(norm, NativeHeadNorm) and (norm.weight is None
                                                                  or norm.weight.dtype != torch.float32))):
                    layers = None
                    break
                gain = norm.weight.detach() if isinstance(norm, NativeHeadNorm) else None
                layers.append((attn, native.Product.of(attn.kv_proj.product), gain))
            self.__dict__["_native_memory"] = layers
        return self.__dict__["_native_memory"]

    def _padding_mask(self, src_pad: Tensor) -> Tensor:
        """``padding_mask(src_pad)``, made again only when the search's source rows change (a
        search replaces its ``src_pad`` when sentences join or leave, never writes into it)."""
        seen = self.__dict__.get("_padding_seen")
        if seen is None or seen[0] is not src_pad:
            seen = self.__dict__["_padding_seen"] = (src_pad, padding_mask(src_pad))
        return seen[1]

    def beam_step(self, output: PackedInt8, choice: native.Choice, tokens: Tensor, scores: Tensor,
                  src_pad: Tensor, cache, history, totals=None, most: int = 1,
                  wake: int | None = None, finished=None) -> tuple | None:
        """A whole beam step in one call of aiayn's kernel (``native.beam_step``): the (A*K,)
        newest tokens through the decoder and ``output`` (the output layer's product), the
        search's ``choice`` with its (A, K) live scores, the rows' ``history`` and ``totals``
        -> ``native.beam_step``'s answer (``beam_choose``'s and the rows followed, or None),
        the cache's slot table after the choice (what its ``reorder`` makes of the rows the
        choice follows: ``KVCache.reorder``'s ``ancestry``) and the ``StepAgain`` that takes
        the next step while the cache only follows, the cache as many positions longer as the
        call took steps; or None, nothing done, where the kernel does not take it (then
        ``decode`` and the search's own steps). The same kernels as ``decode``'s step and
        ``Int8Output``'s calls, in one: at a serving lane's few rows the calls between them
        cost as much as the kernels. ``most``, ``wake``, ``finished``: ``StepAgain``'s, from
        this first step on (a lane's step after a sentence joined or left need not be a call of
        its own)."""
        if (cache is None or not cache.indirect or cache.length == 0 or self.training
                or torch.is_grad_enabled() or torch.is_autocast_enabled("cpu") or tokens.dtype != torch.long
                or not tokens.is_cpu or scores.dtype != torch.float32 or not scores.is_cpu):
            return None
        decoder = self._decoder_weights(output)
        src_mask = self._padding_mask(src_pad)  # held by the step: the places point into it, and
        # a search in another thread may replace the model's copy while this one's call runs
        places = self._step_places(tokens.numel(), src_mask, cache) if decoder is not None else None
        if places is None:
            return None
        return StepAgain(decoder, choice, cache, src_mask)(tokens.contiguous(), scores.contiguous(),
                                                          history, totals, most, wake, finished)

    def _step_places(self, rows: int, src_mask: Tensor, cache) -> ctypes.Array | None:
        """Each decoder layer's places for a step of ``rows`` rows (their self-attention masks
        left to the kernel, which makes them from ``cache.start``), or None. Kept on the cache
        while they point into the same tensors: a step then only moves layer 0's position and
        slot table, which the kernel reads for every layer (``layers.c``'s decoder_step). At a
        serving lane's few rows, making every layer's places anew took ~5% of a step."""
        kept = cache.kernel_places
        if kept is not None and kept[0] == _pointing(rows, src_mask, cache)[0]:
            places = _moved(kept, cache, rows)
            if places is not None:
                return places
        made = []
        for layer, layer_cache in zip(self.decoder.layers, cache.layers, strict=True):
            place = layer._places(rows, src_mask, None, layer_cache)
            if place is None:
                cache.kernel_places = None
                return None
            made.append(place)
        places = (native.StepPlaces * len(made))(*made)
        stores = [layer_cache["self"]["store"].keys.shape for layer_cache in cache.layers]
        room = (min(shape[1] for shape in stores), min(shape[0] for shape in stores))
        cache.kernel_places = (*_pointing(rows, src_mask, cache), room, places)
        return places

    def _decoder_weights(self, output: PackedInt8) -> native.DecoderWeights | None:
        """The decoder's weights with ``output`` as ``native.beam_step`` takes them, gathered
        once per output product (None where the kernel cannot compute this decoder)."""
        seen = self.__dict__.get("_native_decoder")
        if seen is not None and seen[0] is output:
            return seen[1]
        layers = [layer._weights if isinstance(layer, NativeDecoderLayer) else None
                  for layer in self.decoder.layers]
        norm, embedding, table = self.decoder.norm, self.tgt_embed.embedding.weight, self.tgt_pos.table
        layer_norm = isinstance(norm, nn.LayerNorm) and norm.weight is not None and norm.bias is not None
        weights = None
        if (None not in layers and (layer_norm or isinstance(norm, nn.Identity))
                and output.k == embedding.size(1)
                and all(t.dtype == torch.float32 and t.is_contiguous() for t in (embedding, table))):
            array = (native.LayerWeights * len(layers))(*layers)  # copies: the layers keep their tensors
            weights = native.DecoderWeights(
                array, len(layers), embedding.data_ptr(), table.data_ptr(), embedding.size(0), table.size(0),
                self.tgt_embed.scale, norm.weight.data_ptr() if layer_norm else None,
                norm.bias.data_ptr() if layer_norm else None, norm.eps if layer_norm else 0.0,
                native.Product.of(output))
            weights.keep = [array, output, embedding, table, norm]  # what it points into, alive
        self.__dict__["_native_decoder"] = (output, weights)
        return weights

    def decode(self, tgt: Tensor, memory: Tensor, src_pad: Tensor, cache=None) -> Tensor:
        decoder = self.decoder
        if (cache is None or not cache.indirect or cache.length == 0 or tgt.dim() != 2
                or tgt.size(1) != 1 or self.training or not tgt.is_cpu
                or torch.is_autocast_enabled("cpu") or torch.is_grad_enabled()):
            return super().decode(tgt, memory, src_pad, cache)
        positions = cache.positions()
        positions = (positions if isinstance(positions, Tensor)
                     else torch.full((tgt.size(0),), positions, dtype=torch.long))
        x = native.embed_step(self.tgt_embed.embedding.weight, self.tgt_embed.scale,
                              self.tgt_pos.table, tgt[:, 0], positions)  # (B, d): ours, in place
        src_mask = self._padding_mask(src_pad)
        self_mask = cache.self_mask(1, tgt.device) if cache.start is not None else None
        for layer, layer_cache in zip(decoder.layers, cache.layers, strict=True):
            # a layer the kernel does not take: its module's forward, on the rows as (B, 1, d)
            native_layer = isinstance(layer, NativeDecoderLayer)
            if not (native_layer and layer.step(x, src_mask, self_mask, layer_cache)):
                x = layer.forward(x.unsqueeze(1), memory, src_mask, self_mask, False, layer_cache)[:, 0]
                x = x.contiguous()
        x = x.unsqueeze(1)
        cache.length += 1
        norm = decoder.norm  # pre-norm's LayerNorm (post-norm's Identity); not through its module
        if isinstance(norm, nn.LayerNorm):
            return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
        return norm(x)


def _pointing(rows: int, src_mask: Tensor, cache) -> tuple[tuple[int, ...], list[Tensor]]:
    """What a step's places point into besides the slot table: the rows and the tensors' ids
    (equal while they are the same objects, which whoever compares keeps alive), the tensors."""
    pointed = [src_mask]
    for layer_cache in cache.layers:
        store, cross = layer_cache["self"]["store"], layer_cache["cross"]
        pointed += (store.keys, store.values, cross.get("k"), cross.get("v"))
    return (rows, *map(id, pointed)), pointed


def _moved(kept: tuple, cache, rows: int) -> ctypes.Array | None:
    """The kept places (``NativeTransformer._step_places``'s) moved to this step of ``rows``
    rows: layer 0's position and slot table, which the kernel reads for every layer; None
    where a store has no room left for it or its slot table is not laid out for the kernel."""
    store, (room_rows, room_positions) = cache.layers[0]["self"]["store"], kept[2]
    ancestry = store.ancestry
    a_rows, a_columns = ancestry.shape
    if (store.rows != rows or rows > room_rows or store.length >= room_positions
            or (a_columns > 1 and ancestry.stride(1) != 1)):
        return None
    first = kept[3][0]
    first.position = store.length
    first.ancestry = ancestry.data_ptr() if a_rows * a_columns else None
    first.ancestry_row, first.written = ancestry.stride(0), a_columns
    return kept[3]


class StepAgain:
    """A search's whole beam step bound to what ``NativeTransformer.beam_step`` checked: the
    decoder's weights, the search's choice, the cache and the places kept on it, the padding
    mask they point into (held here). Called with a step's (A*K,) tokens, (A, K) scores,
    history and totals it takes that step, as ``beam_step`` would, while the cache keeps
    those places (a search whose rows only follow their beams: every step of a serving lane
    between a sentence joining and one leaving); else None, nothing done. At a lane's few
    rows the Python around a step's call still weighs (docs/serving.md#lanes): this skips
    its checks. ``DecoderState.beam_step`` keeps it and drops it at any other change."""

    __slots__ = ("decoder", "choice", "cache", "src_mask", "kept", "keys", "memory")

    def __init__(self, decoder: native.DecoderWeights, choice: native.Choice, cache, src_mask: Tensor):
        self.decoder, self.choice, self.cache, self.src_mask = decoder, choice, cache, src_mask
        self.kept, self.keys = cache.kernel_places, cache.layers[0]["self"]["store"].keys
        self.memory = cache.layers[0]["cross"].get("k")

    def __call__(self, tokens: Tensor, scores: Tensor, history, totals=None, most: int = 1,
                 wake: int | None = None, finished=None) -> tuple | None:
        """The step; with ``totals`` and ``most`` > 1, up to ``most`` steps in one call of the
        kernel while nothing ends (``native.beam_steps``; with ``finished``, each sentence's
        finished hypotheses, also past steps at which hypotheses end but no sentence is done),
        the cache as long again: the last step's answer, with the rows' history and totals
        before it (None: it was the only) and the hypotheses that ended before it or at it
        (None: none)."""
        cache, rows = self.cache, tokens.numel()
        store = cache.layers[0]["self"]["store"]  # every layer's store has the same slots
        # Whoever changes the cache otherwise drops this (``DecoderState``); these guard the
        # changes a step can see at no cost: places made again, rows, a store moved or trimmed,
        # memory rows replaced, inputs that are not the last call's kind of output.
        if (cache.kernel_places is not self.kept or self.kept[0][0] != rows or store.keys is not self.keys
                or cache.layers[0]["cross"].get("k") is not self.memory or not scores.is_contiguous()
                or torch.is_grad_enabled() or torch.is_autocast_enabled("cpu")):
            return None
        places = _moved(self.kept, cache, rows)
        if places is None:
            return None
        start = None if cache.start is None else cache.start.contiguous()
        most = min(most, self.kept[2][1] - store.length)  # positions the stores have room for
        if totals is None or most <= 1:
            followed = torch.empty(rows, store.length + 1, dtype=torch.long)
            host, alive_scores, alive_tokens, rows = native.beam_step(
                self.decoder, places, self.choice, tokens, start, scores, history,
                store.ancestry, followed, totals)
            _lengthen(cache, 1)
            return host, alive_scores, alive_tokens, rows, followed, self, None, None
        host, alive_scores, alive_tokens, rows, followed, taken, earlier, ended = native.beam_steps(
            self.decoder, places, self.choice, tokens, start, scores, history, totals,
            store.ancestry, store.length, most, wake, finished=finished)
        if earlier is not None:  # the steps before the last only followed their beams
            _lengthen(cache, taken - 1)
            cache.follow(earlier[2])
        _lengthen(cache, 1)
        return host, alive_scores, alive_tokens, rows, followed, self, earlier and earlier[:2], ended


def _lengthen(cache, positions: int) -> None:
    """An indirect cache whose stores a fused step wrote ``positions`` more positions into."""
    for layer_cache in cache.layers:
        layer_cache["self"]["store"].length += positions
    cache.length += positions


def _fits_mask(mask: Tensor | None, sets: int, keys: int) -> bool:
    """None, or a bool (1 or ``sets``, 1, 1, ``keys``) may-attend mask read row by row."""
    if mask is None:
        return True
    shape = mask.shape
    return (mask.dtype == torch.bool and len(shape) == 4 and shape[1:] == (1, 1, keys)
            and shape[0] in (1, sets) and mask.stride(3) == 1)


def _mask_place(mask: Tensor | None) -> tuple[int | None, int]:
    if mask is None:
        return None, 0
    return mask.data_ptr(), mask.stride(0) if mask.size(0) > 1 else 0


def _layer_weights(layer: DecoderLayer | EncoderLayer) -> native.LayerWeights | None:
    """``layer``'s weights for ``native.decoder_layer_step`` (a decoder layer) or
    ``native.encoder_layer`` (an encoder layer: no cross-attention), or None where the kernel
    cannot compute it (modules other than ``int8_model``'s, norms without a gain or bias,
    sizes that are not multiples of 8)."""
    attn, ff = layer.self_attn, layer.feed_forward
    cross = getattr(layer, "cross_attn", None)
    sublayers = [layer.sublayer1, layer.sublayer2] + ([layer.sublayer3] if cross is not None else [])
    linears = [attn.qkv_proj, attn.out_proj, ff.linear1, ff.linear2]
    if cross is not None:
        linears[2:2] = [cross.q_proj, cross.out_proj]
    norms = [s.norm for s in sublayers]
    head_norms = [n for n in (attn.q_norm, attn.k_norm, getattr(cross, "q_norm", None))
                  if isinstance(n, HeadNorm)]
    steps = cross is None or (isinstance(attn, StepAttention) and isinstance(cross, StepAttention))
    if (not isinstance(attn, MultiHeadAttention) or not steps
            or not all(isinstance(linear, Int8Linear) for linear in linears)
            or any(n.weight is None or n.bias is None or n.weight.dtype != torch.float32 for n in norms)
            or len({n.eps for n in norms}) != 1 or len({n.eps for n in head_norms}) > 1
            or attn.d_k % 8 or attn.d_k > 128 or attn.d_model % 8 or ff.linear1.out_features % 8):
        return None

    def gain(norm: nn.Module | None) -> int | None:
        return norm.weight.data_ptr() if isinstance(norm, HeadNorm) else None

    products = [native.Product.of(linear.product) for linear in linears]
    if cross is None:  # no cross-attention: its two products unused
        products[2:2] = [native.Product(), native.Product()]
    padded = norms + [None] * (3 - len(norms))
    weights = native.LayerWeights(
        *products,
        (ctypes.c_void_p * 3)(*(None if n is None else n.weight.data_ptr() for n in padded)),
        (ctypes.c_void_p * 3)(*(None if n is None else n.bias.data_ptr() for n in padded)),
        gain(attn.q_norm), gain(attn.k_norm), gain(getattr(cross, "q_norm", None)),
        int(getattr(cross, "whole_query", False)), attn.d_model, attn.n_heads,
        ff.linear1.out_features, int(layer.sublayer1.norm_first), norms[0].eps,
        head_norms[0].eps if head_norms else 0.0)
    weights.keep = [n.weight for n in norms + head_norms] + [n.bias for n in norms]  # alive with it
    return weights


def _as(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x in ``dtype`` (x itself where it is: at every step, a call to ``to`` is not free)."""
    return x if x.dtype == dtype else x.to(dtype)


def int8_model(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose encoder's and decoder's linear layers compute in int8
    (``Int8Linear``), whose QK-norm runs in aiayn's kernel (``NativeHeadNorm``), whose
    decoder's attention of a decoding step does too (``StepAttention``) and whose decoder
    layers compute a step in one call (``NativeDecoderLayer``), as its encoder's layers do an
    encoding (``NativeTransformer``), sharing every other module and weight with ``model``,
    which does not change."""
    def swap(name: str, module: nn.Module) -> nn.Module | None:
        if not name.startswith(("encoder.", "decoder.")):
            return None
        if isinstance(module, nn.Linear):
            return Int8Linear(module)
        if isinstance(module, HeadNorm):
            return _same_module(NativeHeadNorm, module)
        return None

    def attention(name: str, module: nn.Module) -> nn.Module | None:
        if name.startswith("decoder.") and isinstance(module, MultiHeadAttention):
            return _same_module(StepAttention, module)
        return None

    def layer(name: str, module: nn.Module) -> nn.Module | None:
        if name.startswith("decoder.layers.") and isinstance(module, DecoderLayer):
            return _same_module(NativeDecoderLayer, module)
        return None

    copy = _replaced(_replaced(_replaced(model, swap), attention), layer)
    if type(copy) is Transformer:  # its step's embedding in aiayn's kernel too
        copy = _same_module(NativeTransformer, copy)
    copy.indirect_cache = True  # read in place by StepAttention
    return copy


def int8_decoding(model: nn.Module) -> tuple[nn.Module, Int8Output]:
    """What an int8 search decodes with: the ``int8_model`` copy of ``model`` and its output
    layer's ``Int8Output``; an AiaynError in one line where the kernels cannot run here."""
    native.check_int8(next(model.parameters()).device)
    copy = int8_model(model)
    return copy, Int8Output(copy.generator)


def _replaced(module: nn.Module, swap, prefix: str = "") -> nn.Module:
    """``module``, or a shallow copy of it in which the submodules that ``swap(name, module)``
    answers for (with a module; None keeps it) are replaced, at any depth; the rest shared."""
    children = {}
    for name, child in module.named_children():
        new = swap(prefix + name, child)
        children[name] = new if new is not None else _replaced(child, swap, f"{prefix}{name}.")
    if all(children[name] is child for name, child in module.named_children()):
        return module
    copy = _same_module(type(module), module)
    copy._modules.update(children)
    return copy
