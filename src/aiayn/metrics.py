"""Translation metrics: sacreBLEU's corpus BLEU and chrF, and character/word error rates."""

from __future__ import annotations

from dataclasses import dataclass

import sacrebleu


@dataclass
class Scores:
    bleu: float
    chrf: float
    cer: float
    wer: float
    bleu_signature: str
    chrf_signature: str

    def summary(self) -> str:
        return (f"BLEU {self.bleu:.2f}  chrF {self.chrf:.2f}  CER {self.cer:.2%}  "
                f"WER {self.wer:.2%}")


def edit_distance(a: list, b: list) -> int:
    """Levenshtein distance (insertions, deletions, substitutions each cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def error_rate(hypotheses: list[str], references: list[str], unit: str) -> float:
    """Corpus-level CER (unit="char") or WER (unit="word"): total edits / reference length."""
    split = list if unit == "char" else str.split
    edits = sum(edit_distance(split(h), split(r)) for h, r in zip(hypotheses, references))
    length = sum(len(split(r)) for r in references)
    return edits / max(length, 1)


def score(hypotheses: list[str], references: list[str]) -> Scores:
    """Corpus BLEU and chrF (sacreBLEU defaults, 13a tokenisation) plus CER and WER."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    bleu = sacrebleu.metrics.BLEU()
    chrf = sacrebleu.metrics.CHRF()
    b = bleu.corpus_score(hypotheses, [references])
    c = chrf.corpus_score(hypotheses, [references])
    return Scores(
        bleu=b.score,
        chrf=c.score,
        cer=error_rate(hypotheses, references, "char"),
        wer=error_rate(hypotheses, references, "word"),
        bleu_signature=str(bleu.get_signature()),
        chrf_signature=str(chrf.get_signature()),
    )
