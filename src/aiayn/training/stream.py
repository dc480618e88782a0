"""What a training run reads: the prepared data and the stream of batches drawn from it.

    resolve_config, restrict_outputs                the model the data sets (vocabulary
                                                    sizes, the pieces it may output; the
                                                    model itself: aiayn.runs.directory's
                                                    build_model)
    TrainData, load_data                            the encoded splits and this rank's sampler
    BatchStream, collates_ahead                     micro-batches epoch after epoch, their
                                                    position saved with the train state

The loop (aiayn.training.loop) draws every update's micro-batches from a ``BatchStream``;
the notebooks' toy tasks (aiayn.training.toy) reuse it on their own data.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from aiayn.config import Config
from aiayn.data.batching import Example, TokenBatchSampler, collate
from aiayn.data.prepared import EncodedSplit, load_prepared
from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizers
from aiayn.errors import AiaynError
from aiayn.model import Transformer
from aiayn.training.distributed import Dist


# ---------------------------------------------------------------- the model the data sets
def resolve_config(config: Config, tokenizers, data_dir: Path) -> Config:
    """Set the model's vocabulary sizes from the prepared tokenizers.

    ``tie_embeddings: all`` needs one vocabulary for both sides; with separate ones this
    refuses to guess and says which setting to change.
    """
    if config.model.tie_embeddings == "all" and not tokenizers.joint:
        raise AiaynError(
            f"model.tie_embeddings='all' needs a joint vocabulary, but the data in {data_dir} "
            f"has separate source/target tokenizers; prepare it with data.joint_vocab=true, "
            f"or train with --set model.tie_embeddings=decoder"
        )
    config.model.src_vocab_size = int(tokenizers.src_vocab_size)
    config.model.tgt_vocab_size = int(tokenizers.tgt_vocab_size)
    return config.validate(f"{data_dir} (vocabulary sizes)")


def restrict_outputs(model: Transformer, train: EncodedSplit, log=print) -> None:
    """model.output_vocab "targets": the generator scores only the pieces that occur in the
    training targets (their labels: tokens and [EOS], not [BOS] or padding)."""
    vocab_size = model.cfg.tgt_vocab_size
    seen = train.ids.tgt.id_counts(vocab_size) > 0
    seen[[PAD_ID, BOS_ID]] = False
    seen[EOS_ID] = True
    model.generator.set_outputs(torch.from_numpy(np.flatnonzero(seen)).to(
        model.generator.output_mask.device))
    log(f"output: {int(seen.sum())} of the {vocab_size} target pieces occur in the training "
        "targets; the output layer scores those alone (model.output_vocab: targets)")


# ---------------------------------------------------------------- data
@dataclass
class TrainData:
    """Encoded training examples with this rank's sampler, and the dev split."""

    train: EncodedSplit
    sampler: TokenBatchSampler
    dev: list[Example]
    dev_pairs: list[tuple[str, str]]
    tokenizers: Tokenizers
    bleu_tokenize: str = "13a"  # the validation's (aiayn.data.prepared.Prepared.bleu_tokenize)


def load_data(data_dir: Path, config: Config, world: Dist, log=print) -> TrainData:
    """Map the prepared ids of the train and dev splits (aiayn.data.prepared.Prepared.encoded: no
    re-encoding, memory independent of the corpus size); long training pairs follow
    data.long_policy, long dev sources are truncated (the dev score covers every dev pair)."""
    prepared = load_prepared(data_dir, log=log)
    m, t = config.model, config.train
    train = prepared.encoded("train", m.max_len, config.data.long_policy)
    dev, dev_pairs = prepared.validation_split(m.max_len)
    if not len(train):
        raise AiaynError(f"{data_dir}: no training pairs fit model.max_len={m.max_len}")
    if not dev:
        raise AiaynError(f"{data_dir}: the dev split is empty")
    corpora = prepared.corpora
    weights = [c["weight"] for c in corpora] if corpora[0].get("weight") else None
    groups = None
    if weights:  # the corpus of each kept pair: the train split holds them one after another
        ends = np.cumsum([c["splits"]["train"] for c in corpora])
        groups = np.searchsorted(ends, train.positions, side="right")
    start = t.curriculum_start if t.curriculum == "length" else None
    sampler = TokenBatchSampler(train.src_lens, train.tgt_lens,
                                t.max_tokens, shuffle=True, seed=t.seed,
                                rank=world.rank, world_size=world.world_size,
                                groups=groups, weights=weights, curriculum_start=start)
    log(f"data: {len(train)} training pairs ({_describe(train.counts)}), {len(dev)} dev pairs, "
        f"{len(sampler)} batches per epoch per rank")
    if start is not None:
        log(f"curriculum: the first pass from its narrowest batches up (train.curriculum length: "
            f"its first steps draw among the narrowest {start:.0%}, its last among all), the "
            "others shuffled")
    if weights:
        log("corpora: " + "; ".join(
            f"{c['line']}: {n} of an epoch's batches" for c, n in zip(corpora, sampler.shares,
                                                                      strict=True)))
    return TrainData(train, sampler, dev, dev_pairs, prepared.tokenizers,
                     prepared.bleu_tokenize(config.data.bleu_tokenize))


def _describe(stats: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in stats.items()) or "nothing dropped"


class BatchStream:
    """Micro-batches epoch after epoch, until ``max_epochs`` are done (then None).

    Its position is the sampler's. ``prefetch()`` draws and collates the next batch early
    (on a GPU, while the device still computes the step before: the loop waited for it
    otherwise, docs/findings.md#the-training-loop-on-a-gpu); that batch is not yet trained
    on, so ``state_dict`` and ``epoch`` keep naming the position before it, and a resume
    draws it again.
    """

    def __init__(self, data: TrainData, pad_id: int, device: torch.device, max_epochs: int,
                 multiple: int = 1):
        self.data, self.pad_id, self.device = data, pad_id, device
        self.multiple = multiple  # lengths padded to it (aiayn.data.batching.length_multiple)
        self.max_epochs = max_epochs
        self._epoch = 0
        self._ahead: list = []  # [(the batch drawn early, the state before it)], or []
        self.data.sampler.set_epoch(self._epoch)
        self._it = iter(self.data.sampler)

    @property
    def epoch(self) -> int:
        """The epoch of the batches handed out so far."""
        return self._ahead[0][1]["epoch"] if self._ahead else self._epoch

    def next(self):
        if self._ahead:
            batch, _ = self._ahead.pop()
            return batch
        return self._draw()

    def prefetch(self) -> None:
        """Draw the next batch now; ``next`` hands it out."""
        if not self._ahead:
            before = self.state_dict()
            self._ahead.append((self._draw(), before))

    def _draw(self):
        positions = next(self._it, None) if self._epoch < self.max_epochs else None
        if positions is None:  # the epoch is over: reshuffle for the next one
            self._epoch += 1
            if self._epoch >= self.max_epochs:
                self._epoch = self.max_epochs
                return None
            self.data.sampler.set_epoch(self._epoch)
            self._it = iter(self.data.sampler)
            positions = next(self._it)
        batch = collate([self.data.train[i] for i in positions], self.pad_id, self.multiple)
        return batch.to(self.device, non_blocking=True)

    def restart_epoch(self, epoch: int) -> None:
        """Go to the start of ``epoch`` (a resume with another number of ranks)."""
        self._ahead.clear()
        self._epoch = epoch
        self.data.sampler.load_state_dict({**self.data.sampler.state_dict(), "epoch": epoch,
                                           "batches_yielded": 0})
        self._it = iter(self.data.sampler)

    def state_dict(self) -> dict:
        if self._ahead:
            return self._ahead[0][1]
        return {"epoch": self._epoch, "sampler": self.data.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._ahead.clear()
        self._epoch = int(state["epoch"])
        self.data.sampler.load_state_dict(state["sampler"])
        self._it = iter(self.data.sampler)


def collates_ahead(device: torch.device) -> bool:
    """Whether the loop collates the next batch while the step before still computes: where a
    device computes beside the host; on a CPU that is the same cores, and nothing is gained."""
    return device.type == "cuda"
