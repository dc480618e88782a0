"""The model card (README.md) that every `aiayn export` writes beside the model.

Everything on it is read from the run's own files, never typed in: the architecture and
parameter count (config.yaml, as `aiayn info` gives them), the training data (data_dir.txt
and the prepared directory's stats.json), the steps and minutes (train_state.pt), the dev
figures (metrics.jsonl) and every test evaluation (eval/test.*.json, with sacreBLEU's
signatures), the search (config.yaml's decode section), the directions of a model that
translates into several languages (its tokenizer's tags, and the corpus lines of each from
stats.json). What the run does not hold is said plainly ("not evaluated on the test
split"), never filled in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aiayn.config import Config, load_config
from aiayn.data.prepared import STATS_FILE
from aiayn.data.tokenizer import META_FILE, Tokenizers
from aiayn.errors import AiaynError
from aiayn.export.base import without_local_paths
from aiayn.export.hf import HF_CODE
from aiayn.inspect.info import run_info
from aiayn.runs.checkpoint import weights_fingerprint
from aiayn.runs.directory import resolve_weights

CARD_FILE = "README.md"


def read_test_evaluations(run_dir: str | Path) -> list[dict[str, Any]]:
    """The summaries `aiayn evaluate --split test` wrote (eval/test.*.json), by file name;
    a file that is not such a summary is left out."""
    rows = []
    for path in sorted((Path(run_dir) / "eval").glob("test.*.json")):
        try:
            summary = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(summary, dict) and summary.get("split") == "test" and \
                isinstance(summary.get("bleu"), (int, float)):
            rows.append({**summary, "file": path.name})
    return rows


def read_data_stats(data_dir: str | None) -> dict[str, Any] | None:
    """The prepared directory's stats.json, or None where it cannot be read."""
    if not data_dir:
        return None
    try:
        return json.loads((Path(data_dir) / STATS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def model_card(run_dir: str | Path, target: str, weights: str | Path = "best",
               quantization: str | None = None, marian: bool = True,
               weights_sha256: str | None = None) -> str:
    """The README.md of an export of ``run_dir`` to ``target`` ("hf" or "ctranslate2"):
    ``weights`` exported, CTranslate2's ``quantization``; ``marian``: a Transformers export
    as MarianMTModel (else aiayn's own code, loaded with trust_remote_code);
    ``weights_sha256``: the fingerprint of the weights exported, as they were loaded
    (default: the file's now)."""
    run_dir = Path(run_dir)
    info = run_info(run_dir)
    config = load_config(run_dir / "config.yaml")
    stats = read_data_stats(info["data_dir"])
    tags = _tags(run_dir)
    sections = [
        _front_matter(target),
        f"# {_title(config, stats)}\n\nAn encoder-decoder Transformer (\"Attention Is All You "
        f"Need\") trained with aiayn and exported for "
        f"{'Hugging Face Transformers' if target == 'hf' else 'CTranslate2'} by "
        f"`aiayn export --to {target}`. Every figure below is read from the run's files.",
        *([_directions(tags, stats, target)] if tags else []),
        _architecture(info, config, target, quantization, marian),
        _data(info, stats),
        _training(info, weights),
        _evaluation(run_dir, weights_sha256 or weights_fingerprint(resolve_weights(run_dir, weights))),
        _decoding(config, target),
        _use_and_limits(config, stats),
        _loading(target, config, marian, _tokenizer_files(run_dir), tags),
    ]
    return "\n\n".join(s.strip("\n") for s in sections) + "\n"


def _tags(run_dir: Path) -> dict[str, str]:
    """Target language -> direction tag (aiayn.data.directions), sorted by language; empty
    for a model of one direction (or a run whose tokenizer cannot be read)."""
    try:
        tags = Tokenizers.load(run_dir / "tokenizer").tags
    except AiaynError:
        return {}
    return dict(sorted(tags.items()))


def _directions(tags: dict[str, str], stats: dict | None, target: str) -> str:
    """The target languages with their tags and corpora, and how each library asks for one
    (the first language as the example)."""
    corpora: dict[str, list[str]] = {}
    for c in (stats or {}).get("corpora") or []:
        if isinstance(c, dict) and c.get("tag"):
            langs = c.get("languages") or {}
            corpora.setdefault(c["tag"], []).append(
                f"`{without_local_paths(str(c.get('line')))}` ({langs.get('src', '?')} → "
                f"{langs.get('tgt', '?')})")
    lang, tag = next(iter(tags.items()))
    rows = [f"| {lang_} | `{tag_}` |" + (f" {', '.join(corpora.get(tag_, ['?']))} |"
                                         if corpora else "") for lang_, tag_ in tags.items()]
    aiayn = (f'`aiayn translate THIS_DIR --engine ctranslate2 --to {lang}`; in Python '
             f'`Translator.from_pretrained("THIS_DIR", engine="ctranslate2", to="{lang}")`'
             if target == "ctranslate2" else
             f'on the run this was exported from, `aiayn translate RUN_DIR --to {lang}`; in '
             f'Python `Translator.from_pretrained("RUN_DIR", to="{lang}")`')
    return "\n".join([
        "## Directions", "",
        f"This model translates into {len(tags)} languages. Each source sentence starts with "
        "the direction tag of the language to write, one special token of the tokenizer "
        "(never split), as every sentence it was trained on did:", "",
        "| target language | tag |" + (" trained on |" if corpora else ""),
        "|---|---|" + ("---|" if corpora else ""), *rows, "",
        f"To ask for one, here {lang}:", "",
        f"- aiayn adds the tag itself: {aiayn}.",
        f'- Transformers{"" if target == "hf" else " (an export `--to hf` of the run)"}: '
        f'the tag and a space before the source text, `"{tag} " + text`.',
        f'- CTranslate2{"" if target == "ctranslate2" else " (an export `--to ctranslate2`)"}: '
        f'the tag token before the source tokens, `["{tag}"] + tokens` (CTranslate2 '
        "appends [EOS]).", "",
        "aiayn refuses a sentence without a tag when it is not told the language; the other "
        "libraries pass it on, and the model, which never saw one in training, writes no "
        "language in particular.",
    ])


def _code_files() -> str:
    """The Python files an export with aiayn's own model ships (and trust_remote_code runs),
    as the card names them: taken from the list the export copies."""
    return ", ".join(f"`{name}`" for name in HF_CODE)


def _front_matter(target: str) -> str:
    library = "transformers" if target == "hf" else "ctranslate2"
    return f"---\nlibrary_name: {library}\npipeline_tag: translation\ntags:\n- translation\n" \
           f"- aiayn\n---"


def _title(config: Config, stats: dict | None) -> str:
    description = (stats or {}).get("description")
    corpus = (stats or {}).get("corpus") or config.data.corpus
    return without_local_paths(f"Translation model: {description or corpus}")


def _architecture(info: dict, config: Config, target: str, quantization: str | None,
                  marian: bool) -> str:
    m, v = info["model"], info["vocabulary"]
    if target == "hf":
        form = ("`MarianMTModel` (Transformers' own code)" if marian else
                f"aiayn's own model code ({_code_files()}; `trust_remote_code`)")
    else:
        form = f"CTranslate2 `TransformerSpec`, weights {quantization or 'float32'}"
    return "\n".join([
        "## Model", "",
        "| | |", "|---|---|",
        f"| parameters | {m['parameters']:,} |",
        f"| layers | {m['encoder_layers']} encoder + {m['decoder_layers']} decoder |",
        f"| d_model / heads / d_ff | {m['d_model']} / {m['n_heads']} / {m['d_ff']} |",
        f"| normalisation | {'pre-norm' if m['norm_first'] else 'post-norm (as the paper)'}"
        f"{', QK-norm' if config.model.qk_norm else ''} |",
        f"| tied embeddings | {m['tie_embeddings']} |",
        f"| max length | {m['max_len']} tokens per sentence |",
        f"| vocabulary | {v['src']} source / {v['tgt']} target ({v['tokenizer']}) |",
        f"| exported as | {form} |",
    ])


def _data(info: dict, stats: dict | None) -> str:
    # The prepared directory's name only: the card is meant for a public page, and the
    # absolute path says where the trainer's files are (and their user name).
    prepared = Path(info["data_dir"]).name if info["data_dir"] else None
    # Several corpora (one a line of data.corpus) are named one after another.
    corpus = "`, `".join(without_local_paths(line.strip())
                         for line in str(info["corpus"]).splitlines() if line.strip())
    lines = ["## Training data", "", f"Corpus `{corpus}`"
             + (f", prepared by `aiayn prepare` (a directory named `{prepared}`)." if prepared
                else " (the run records no prepared data directory).")]
    if stats is None:
        lines += ["", "The prepared data's stats.json could not be read, so its size is not "
                  "given here."]
        return "\n".join(lines)
    if stats.get("description"):
        lines += ["", without_local_paths(stats["description"]) + "."]
    pairs, splits = stats.get("pairs") or {}, stats.get("splits") or {}
    tokens = stats.get("tokens") or {}
    if pairs:
        dropped = ", ".join(f"{k.replace('_', ' ')} {n:,}" for k, n in
                            (pairs.get("dropped") or {}).items() if n)
        lines += ["", f"{pairs.get('read', 0):,} sentence pairs read, {pairs.get('kept', 0):,} "
                  f"kept" + (f" (dropped: {dropped})" if dropped else "") + "."]
    if splits:
        lines += ["", "| split | pairs | source tokens | target tokens |", "|---|---|---|---|"]
        for name, count in splits.items():
            side = tokens.get(name) or {}
            lines.append(f"| {name} | {count:,} | {_count(side.get('src'))} | "
                         f"{_count(side.get('tgt'))} |")
    if stats.get("split_rule"):
        lines += ["", f"Split: {without_local_paths(stats['split_rule'])}."]
    return "\n".join(lines)


def _count(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else "?"


def _training(info: dict, weights: str | Path) -> str:
    t = info["training"]
    lines = ["## Training", ""]
    if t:
        tokens = f", {t['tokens']:,} target tokens" if isinstance(t.get("tokens"), int) else ""
        lines.append(f"{t['step']:,} steps ({t['epoch']} epochs{tokens}) in "
                     f"{t['minutes']:.1f} minutes on {t['world_size']} "
                     f"process{'' if t['world_size'] == 1 else 'es'}.")
    else:
        lines.append("The run holds no train_state.pt: its steps and time are not known.")
    step = _weights_step(info, weights)
    lines += ["", f"Exported weights: `{without_local_paths(str(weights))}`"
              + (f" (step {step:,})." if step else ".")]
    best = info["best"]
    if best and isinstance(best.get("bleu"), (int, float)):
        chrf = (f", chrF {best['chrf']:.2f}" if isinstance(best.get("chrf"), (int, float))
                else "")
        lines.append(f"The best validation (by dev {best['metric']}) was at step "
                     f"{best['step']}: BLEU {best['bleu']:.2f}{chrf} on "
                     f"{best.get('n_sentences') or '?'} dev sentences.")
    return "\n".join(lines)


def _weights_step(info: dict, weights: str | Path) -> int | None:
    name = Path(str(weights)).name
    name = name if name.endswith(".safetensors") else f"{name}.safetensors"
    return next((w["step"] for w in info["weights"] if Path(w["file"]).name == name), None)


def _evaluation(run_dir: Path, exported: str) -> str:
    rows, left_out = _current_evaluations(run_dir)
    lines = ["## Evaluation", ""]
    if not rows:
        lines.append("Not evaluated on the test split: the run has no test evaluation "
                     "(eval/test.*.json) of the weights it holds. `aiayn evaluate RUN_DIR "
                     "--split test` writes one; export again after it to have its figures here.")
        return "\n".join(lines + left_out)
    lines += ["Test split, scored by sacreBLEU (`aiayn evaluate --split test`):", "",
              "| weights | search | sentences | BLEU | chrF |", "|---|---|---|---|---|"]
    signatures: dict[str, None] = {}  # in order, each once
    for r in rows:
        search = "greedy" if r.get("beam") == 1 else f"beam {r.get('beam')}, alpha {r.get('alpha')}"
        search += ", int8 decoding" if r.get("int8") else ""  # not what the export computes
        step = f" (step {r['weights_step']})" if r.get("weights_step") else ""
        mark = " (exported)" if r["weights_sha256"] == exported and not r.get("int8") else ""
        chrf = f"{r['chrf']:.2f}" if isinstance(r.get("chrf"), (int, float)) else "?"
        lines.append(f"| {without_local_paths(str(r.get('weights')))}{step}{mark} | {search} | "
                     f"{r.get('sentences')} | {r['bleu']:.2f} | {chrf} |")
        for key, label in (("bleu_signature", "BLEU"), ("chrf_signature", "chrF")):
            if r.get(key):
                signatures[f"{label} `{r[key]}`"] = None
    if signatures:
        lines += ["", "sacreBLEU signatures: " + "; ".join(signatures) + "."]
    return "\n".join(lines + left_out)


def _current_evaluations(run_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The test evaluations of the whole split whose weights file still holds the weights
    they scored (the sha256 they recorded), and a line for those left out: a figure on the
    card is always one that the run's weights give."""
    fingerprints: dict[Path, str] = {}

    def current(name: str) -> str | None:
        try:
            path = resolve_weights(run_dir, name).resolve()
        except AiaynError:
            return None
        if path not in fingerprints:
            fingerprints[path] = weights_fingerprint(path)
        return fingerprints[path]

    rows, partial, replaced = [], 0, 0
    for r in read_test_evaluations(run_dir):
        if r.get("limit"):
            partial += 1
        elif r.get("weights_sha256") and r["weights_sha256"] == current(str(r.get("weights"))):
            rows.append(r)
        else:
            replaced += 1
    left_out = []
    if partial:
        left_out.append(f"{partial} evaluation(s) of the first sentences only (`--limit`)")
    if replaced:
        left_out.append(f"{replaced} of weights the run no longer holds under that name (saved "
                        "again since, or evaluated before aiayn recorded which weights it scored)")
    note = ["", f"Left out: {'; '.join(left_out)}."] if left_out else []
    return rows, note


def _decoding(config: Config, target: str) -> str:
    d = config.decode
    engine = "Transformers' `generate`" if target == "hf" else "CTranslate2"
    return "\n".join([
        "## Decoding settings", "",
        f"The run searches with beam {d.beam} and length penalty alpha {d.alpha} "
        f"({'greedy search' if d.beam == 1 else 'GNMT: ((5 + length) / 6)^alpha'}); the "
        f"export keeps them ({'generation_config.json' if target == 'hf' else 'config.yaml'}"
        f"). {engine} divides a hypothesis's log-probability by length^alpha instead, so its "
        "beam search may rank finished hypotheses differently; with alpha 0, or greedy, the "
        "searches agree token for token. A translation is at most "
        f"{config.model.max_len - 1} tokens; a longer source sentence is truncated."
        + (f" The repetition guard is on: no translation holds the same {d.no_repeat_ngram} "
           "pieces in a row twice (Transformers' and CTranslate2's `no_repeat_ngram_size`)."
           if d.no_repeat_ngram else ""),
    ])


def _use_and_limits(config: Config, stats: dict | None) -> str:
    corpus = without_local_paths((stats or {}).get("description") or config.data.corpus)
    return "\n".join([
        "## Intended use and limits", "",
        f"Translating text like its training data ({corpus}), one sentence at a time, for "
        "study, teaching and experiments. It knows only what that corpus holds: text from "
        "other domains, registers or times, names and words it has not seen, and long "
        "sentences come out worse, sometimes fluent and wrong. The test figures above are "
        "on held-out text of the same corpus, not on other text. No filtering of harmful or "
        "biased output is done. Do not use it where a wrong translation can harm someone "
        "(medical, legal, safety) without a person checking every output.",
    ])


def _loading(target: str, config: Config, marian: bool, files: dict[str, str],
             tags: dict[str, str] | None = None) -> str:
    """The loading code; for a model of several directions, asking for the first."""
    beam, alpha, guard = config.decode.beam, config.decode.alpha, config.decode.no_repeat_ngram
    lang, tag = next(iter(tags.items())) if tags else (None, None)
    text = f"{tag} A sentence to translate." if tag else "A sentence to translate."
    to = f" --to {lang}" if lang else ""
    tokens = f'["{tag}"] + ' if tag else ""
    if target == "hf":
        trust = "" if marian else ", trust_remote_code=True"
        lines = [
            "## How to load", "",
            "With Transformers (and torch), from this directory:", "",
            "```python",
            "from transformers import AutoModelForSeq2SeqLM, AutoTokenizer",
            "",
            f'model = AutoModelForSeq2SeqLM.from_pretrained("THIS_DIR"{trust})',
            f'tokenizer = AutoTokenizer.from_pretrained("THIS_DIR"{trust})',
            f'batch = tokenizer(["{text}"], return_tensors="pt", padding=True)',
            "print(tokenizer.batch_decode(model.generate(**batch), skip_special_tokens=True))",
            "```",
        ]
        if not marian:
            lines += ["", f"`trust_remote_code=True` runs this directory's Python files, "
                      f"{_code_files()}, on your machine: read them first."]
        return "\n".join(lines)
    tokenizer, target_tokenizer = files["src"], files["tgt"]
    return "\n".join([
        "## How to load", "",
        "With aiayn (`pip install 'aiayn[export]'`), which reads the config and tokenizer "
        "beside the model:", "",
        "```bash",
        f"aiayn translate THIS_DIR --engine ctranslate2{to} -i input.txt -o output.txt",
        "```", "",
        "With CTranslate2 and the `tokenizers` library alone:", "",
        "```python",
        "import ctranslate2",
        "from tokenizers import Tokenizer",
        "",
        'translator = ctranslate2.Translator("THIS_DIR")',
        f'source = Tokenizer.from_file("THIS_DIR/tokenizer/{tokenizer}")',
        f'target = Tokenizer.from_file("THIS_DIR/tokenizer/{target_tokenizer}")',
        f'tokens = {tokens}source.encode("A sentence to translate.").tokens  # [EOS] is added '
        "by CTranslate2",
        f"result = translator.translate_batch([tokens], beam_size={beam}, "
        f"length_penalty={alpha},",
        *([f"                                    no_repeat_ngram_size={guard},"] if guard else []),
        '                                    suppress_sequences=[["[PAD]"], ["[BOS]"]])',
        "ids = [target.token_to_id(t) for t in result[0].hypotheses[0]]",
        "print(target.decode(ids, skip_special_tokens=False))  # [UNK] shown, as aiayn does",
        "```",
    ])


def _tokenizer_files(run_dir: Path) -> dict[str, str]:
    """The tokenizer file of each side (tokenizer/meta.json), as the export copies them."""
    try:
        files = json.loads((run_dir / "tokenizer" / META_FILE).read_text(encoding="utf-8"))["files"]
        return {"src": str(files["src"]), "tgt": str(files["tgt"])}
    except (OSError, ValueError, KeyError, TypeError):
        return {"src": "joint.json", "tgt": "joint.json"}
