"""The few steps of benchmarks/peers/run.py that must run inside a peer's virtual environment
(its torch, sentencepiece and toolkit; nothing from aiayn):

    python in_venv.py spm-train --prefix DIR/spm --vocab-size 8000 FILE...
    python in_venv.py spm-count MODEL FILE         # pieces in FILE, one EOS a line added
    python in_venv.py joey-stats CHECKPOINT        # {"updates", "target_tokens"} as JSON
    python in_venv.py onmt-train CONFIG            # onmt_train that SIGUSR1 stops cleanly

``onmt-train`` is OpenNMT-py's own ``onmt_train -config CONFIG`` with additions made from
outside: after SIGUSR1 the trainer's batch stream ends before the next update, so the
training loop leaves normally and OpenNMT-py saves its final checkpoint of the last update
(it has no time limit, and an interrupt saves nothing). It prints ``PEERS-FIRST-UPDATE``
when the first batch is ready (the budget starts there) and at the end one line,
``PEERS-TOTALS {"updates": N, "target_tokens": M}``, from the trainer's own statistics.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

TOTALS_MARK = "PEERS-TOTALS"
FIRST_UPDATE_MARK = "PEERS-FIRST-UPDATE"


def spm_train(files: list[str], prefix: str, vocab_size: int, threads: int) -> None:
    """BPE on ``files`` (both sides' for a joint vocabulary); ids 0-3 are <unk> <pad> <s>
    </s> (JoeyNMT's order). The text is already NFC, so SentencePiece normalises nothing ("identity")."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        input=files, model_prefix=prefix, model_type="bpe", vocab_size=vocab_size,
        character_coverage=1.0, normalization_rule_name="identity",
        unk_id=0, pad_id=1, bos_id=2, eos_id=3, input_sentence_size=0,
        num_threads=threads, minloglevel=1)


def spm_count(model: str, path: str) -> int:
    """Pieces in the lines of ``path`` plus one EOS per line: the target tokens of one pass
    over it, as the toolkits count them (no BOS, no padding)."""
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_file=model)
    with open(path, encoding="utf-8") as f:
        return sum(len(ids) + 1 for ids in processor.encode(f.read().splitlines()))


def joey_stats(checkpoint: str) -> dict:
    """Updates and target tokens that JoeyNMT counted, from its checkpoint's stats_state."""
    import torch

    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["stats_state"]
    return {"updates": int(state["steps"]), "target_tokens": int(state["total_tokens"])}


def onmt_train(config: str) -> None:
    """onmt_train -config CONFIG, stoppable with SIGUSR1 (see the module docstring)."""
    from onmt.bin import train as onmt_bin_train
    from onmt.trainer import Trainer

    stop = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: stop.append(signum))
    accum_batches, train = Trainer._accum_batches, Trainer.train

    def accum_until_stopped(self, iterator):
        for i, item in enumerate(accum_batches(self, iterator)):
            if stop:
                return
            if i == 0:  # OpenNMT-py filled its first bucket of examples: update 1 is next
                print(FIRST_UPDATE_MARK, flush=True)
            yield item

    def train_and_report(self, *args, **kwargs):
        stats = train(self, *args, **kwargs)
        totals = {"updates": self.optim.training_step - 1, "target_tokens": int(stats.n_words)}
        print(TOTALS_MARK, json.dumps(totals), flush=True)
        return stats

    Trainer._accum_batches, Trainer.train = accum_until_stopped, train_and_report
    sys.argv = ["onmt_train", "-config", config]
    onmt_bin_train.main()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("spm-train")
    p.add_argument("files", nargs="+")
    p.add_argument("--prefix", required=True)
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--threads", type=int, default=2)
    p = sub.add_parser("spm-count")
    p.add_argument("model")
    p.add_argument("file")
    sub.add_parser("joey-stats").add_argument("checkpoint")
    sub.add_parser("onmt-train").add_argument("config")
    args = parser.parse_args()
    if args.command == "spm-train":
        spm_train(args.files, args.prefix, args.vocab_size, args.threads)
    elif args.command == "spm-count":
        print(spm_count(args.model, args.file))
    elif args.command == "joey-stats":
        print(json.dumps(joey_stats(args.checkpoint)))
    else:
        onmt_train(args.config)


if __name__ == "__main__":
    main()
