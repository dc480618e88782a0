"""aiayn's C kernels against another revision's, both in one process: a serving lane's int8
decoding over the same sentences with each library in turn, the CPU time compared pair by pair.

On a shared machine whose speed swings by a third within minutes, separate runs cannot see
a change of a few percent in a kernel; passes alternated in one process, each compared with
its neighbour, can. The pass is `lane_steps.py`'s (a ``JoinableSearch`` on one thread, N
sentences in it at a time, a new one joining as one is done); the libraries are this
checkout's and the one built from REV's C sources (``git show REV:src/aiayn/inference/...``,
compiled beside it as ``aiayn.inference.native`` builds its own). REV's kernels must take the
arguments this checkout passes (the same functions and signatures): a change to the C
interface is measured with the Python around it, by runs of the two checkouts. Each row says
whether the two libraries gave the same translations.

    python benchmarks/kernel_ab.py --run-dir runs/demo --against HEAD~1 --sizes 4,16 --limit 200
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    add_json_option,
    add_run_options,
    device_description,
    median,
    print_table,
    run_pairs,
    script_parser,
)

from aiayn.data.batching import pad  # noqa: E402
from aiayn.errors import AiaynError  # noqa: E402
from aiayn.inference import native  # noqa: E402
from aiayn.inference.joinable import JoinableSearch  # noqa: E402
from aiayn.inference.translator import Translator  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None):
    p = script_parser(__doc__)
    add_run_options(p)
    p.add_argument("--against", required=True, metavar="REV",
                   help="the git revision whose C kernels to compare with this checkout's")
    p.add_argument("--sizes", default="4,16",
                   help="sentences kept in the search, comma-separated (default 4,16)")
    p.add_argument("--pairs", type=int, default=10,
                   help="pairs of passes a size (the ratio is their median)")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--alpha", type=float, default=0.6)
    add_json_option(p)
    args = p.parse_args(argv)
    try:
        args.sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        p.error(f"--sizes: comma-separated numbers, got {args.sizes!r}")
    if not all(s >= 1 for s in args.sizes) or args.pairs < 1:
        p.error("--sizes and --pairs must be at least 1")
    return args


def library_of(rev: str, directory: Path):
    """The kernels' library built from ``rev``'s C sources (copied to ``directory``; the build
    kept where ``native.build`` keeps its own), loaded with this checkout's signatures
    (``native._library``'s, uncached)."""
    sources = []
    for source in native.SOURCES:
        path = directory / source.name
        relative = f"src/aiayn/inference/{source.name}"
        shown = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{relative}"],
                               capture_output=True, text=True)
        if shown.returncode:
            raise SystemExit(f"--against {rev}: git cannot show {relative}: "
                             f"{shown.stderr.strip().splitlines()[-1] if shown.stderr.strip() else ''}")
        path.write_text(shown.stdout, encoding="utf-8")
        sources.append(path)
    build = native.build
    native.build = lambda *_, **__: build(tuple(sources))
    try:
        return native._library.__wrapped__()
    except AttributeError as e:  # a function this checkout calls that REV's kernels lack
        raise SystemExit(f"--against {rev}: its kernels lack this checkout's interface ({e})") from None
    except AiaynError as e:
        raise SystemExit(f"--against {rev}: {e}") from None
    finally:
        native.build = build


def lane(translator: Translator, search, ids: list[list[int]], size: int) -> tuple[float, list]:
    """CPU seconds to decode ``ids`` as a lane does, ``size`` sentences at a time, and the
    best hypothesis' tokens of each sentence."""
    joinable, sent, best = JoinableSearch(translator.model, search, translator.kernel), 0, {}
    cpu = time.process_time()
    with torch.inference_mode():  # as a lane's process holds it
        while len(best) < len(ids):
            while sent < len(ids) and len(joinable) < size:
                joinable.add([sent], pad([ids[sent]]))
                sent += 1
            best.update((key, hyps[0].ids) for key, hyps in joinable.step())
    return time.process_time() - cpu, [best[i] for i in range(len(ids))]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    native.check_int8()
    torch.set_num_threads(1)  # a lane's process decodes on one thread
    with tempfile.TemporaryDirectory(prefix="aiayn-kernel-ab-") as directory:
        theirs = library_of(args.against, Path(directory))
    libraries = {"this": native._library(), "theirs": theirs}
    cached = native._library
    translator = Translator.from_pretrained(args.run_dir, args.weights, int8=True)
    search = translator.resolve(beam=args.beam, alpha=args.alpha)
    ids = translator.tokenizers.encode_src(translator.tagged([s for s, _ in run_pairs(args)]))
    rows = []
    try:
        for size in args.sizes:
            ratios, same = [], True
            for i in range(args.pairs + 1):  # the first pair warms both up, uncounted
                passes = {}
                for name in (("this", "theirs") if i % 2 else ("theirs", "this")):
                    native._library = lambda name=name: libraries[name]
                    passes[name] = lane(translator, search, ids, size)
                same = same and passes["this"][1] == passes["theirs"][1]
                if i:
                    ratios.append(passes["this"][0] / passes["theirs"][0])
            ratios.sort()
            rows.append([str(size), f"{median(ratios):.3f}", f"{ratios[0]:.3f}-{ratios[-1]:.3f}",
                         str(args.pairs), "yes" if same else "no"])
    finally:
        native._library = cached
    conditions = (f"{len(ids)} {args.split} sentences of {args.run_dir} ({args.weights}), int8, beam "
                  f"{args.beam}, alpha {args.alpha}, one thread; this checkout's kernels ({REPO}) "
                  f"against those of {args.against}, alternating in one process, each pass's CPU "
                  f"time over its neighbour's\ndevice: {device_description()}")
    print_table(["sentences in the search", "CPU this / theirs (median)", "range", "pairs",
                 "same translations"], rows, conditions, args.json)


if __name__ == "__main__":
    main()
