"""What a serving lane's decoding step costs with N sentences in it: the part that does not
shrink with the rows.

A lane of `aiayn serve` (``aiayn.serving.lanes``) holds about K / L of K clients' sentences in
one ``JoinableSearch`` on one thread, a new one joining as one is done. This script keeps a
search at each size N of ``--sizes``, as a lane does, over the same sentences of the run's
split, the sizes interleaved in each repetition (``benchmarks/common.py``), and reports a
step's milliseconds and a sentence's: where a step of few sentences costs a sentence far more
than a step of many, the lane at few clients is bound by that fixed part (Python, calls, the
weights read once per step), not by its arithmetic (docs/serving.md#batching). With int8 it
also says what share of the time a step spends in the kernels' one call (the rest of a step
is Python around it), what share joining sentences (encoding each, adding its rows), and the
microseconds of Python around the call at a quiet step (the search only follows its beams)
and at a step where sentences end or just joined or ended (settling them, taking them out of
the rows and the cache, making the kernel's places again). As a lane's process does, a call
takes up to ``--quiet-steps`` steps while no sentence is done (a call's Python is shared by
its steps); ``--quiet-steps 1`` times one step a call.

    python benchmarks/lane_steps.py --run-dir runs/demo --int8 --limit 120 --sizes 1,4,16,32
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    add_json_option,
    add_repeats_option,
    add_run_options,
    device_description,
    interleave,
    print_table,
    run_pairs,
    script_parser,
)

from aiayn.data.batching import pad  # noqa: E402
from aiayn.inference import native  # noqa: E402
from aiayn.inference.joinable import JoinableSearch  # noqa: E402
from aiayn.inference.translator import Translator  # noqa: E402
from aiayn.serving.lanes import QUIET_STEPS  # noqa: E402


def parse_args(argv: list[str] | None = None):
    p = script_parser(__doc__)
    add_run_options(p)
    p.add_argument("--sizes", default="1,4,16,32",
                   help="sentences kept in the search, comma-separated (default 1,4,16,32)")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--alpha", type=float, default=0.6)
    p.add_argument("--int8", action="store_true", help="decode with aiayn's int8 engine")
    p.add_argument("--quiet-steps", type=int, default=QUIET_STEPS,
                   help="steps a call may take while no sentence is done (int8; default the lanes' "
                        f"{QUIET_STEPS}; 1: a call a step)")
    add_repeats_option(p, 3)
    add_json_option(p)
    return p.parse_args(argv)


class Clock:
    """Seconds spent in a lane's parts: its sentences' joining (``JoinableSearch.add``) and,
    with int8, inside the kernels' one call a step (``native.beam_step``, wrapped while a
    ``Clock`` is on): the rest of a step is the Python around that call, counted apart for
    the steps at which nothing joined or ended since the last (``quiet``: the search only
    follows its beams) and the others (``changed``: a sentence ended at it, or one joined
    or ended just before it), as (steps, seconds). A call that starts at a change and goes
    on with quiet steps counts its Python at its first step, its other steps as quiet ones
    with none of their own."""

    def __init__(self):
        self.joining = self.kernel = 0.0
        self.quiet, self.changed = [0, 0.0], [0, 0.0]

    def __enter__(self) -> Clock:
        self.calls = {name: getattr(native, name) for name in ("beam_step", "beam_steps")}
        for name, call in self.calls.items():
            setattr(native, name, self._timed(call))
        return self

    def _timed(self, call):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.kernel += time.perf_counter() - start
        return timed

    def __exit__(self, *exc) -> None:
        for name, call in self.calls.items():
            setattr(native, name, call)


def lane(translator: Translator, search, ids: list[list[int]], size: int, most: int,
         clock: Clock | None = None) -> int:
    """Decode ``ids`` as a lane does, ``size`` sentences in the search at a time, up to
    ``most`` quiet steps a call; the steps. ``clock``: add the joining's seconds and each
    call's Python to it (a call of several steps counts them all)."""
    joinable, sent, done, steps = JoinableSearch(translator.model, search, translator.kernel), 0, 0, 0
    changed = True  # a step after sentences joined or ended
    with torch.inference_mode():  # as a lane's process holds it
        while done < len(ids):
            while sent < len(ids) and len(joinable) < size:
                start = time.perf_counter()
                joinable.add([sent], pad([ids[sent]]))
                if clock is not None:
                    clock.joining += time.perf_counter() - start
                sent += 1
                changed = True
            start, kernel = time.perf_counter(), clock.kernel if clock is not None else 0.0
            ended = joinable.step(most)
            if clock is not None:  # a call after a change: its first step changed, the rest quiet
                python = time.perf_counter() - start - (clock.kernel - kernel)
                if changed or ended:
                    clock.changed[0], clock.changed[1] = clock.changed[0] + 1, clock.changed[1] + python
                    clock.quiet[0] += joinable.taken - 1
                else:
                    clock.quiet[0], clock.quiet[1] = clock.quiet[0] + joinable.taken, clock.quiet[1] + python
            done, steps, changed = done + len(ended), steps + joinable.taken, bool(ended)
    return steps
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # a lane's process decodes on one thread
    translator = Translator.from_pretrained(args.run_dir, args.weights, int8=args.int8)
    search = translator.resolve(beam=args.beam, alpha=args.alpha)
    sources = [src for src, _ in run_pairs(args)]
    ids = translator.tokenizers.encode_src(translator.tagged(sources))
    sizes = [int(s) for s in args.sizes.split(",")]
    most = args.quiet_steps
    steps = {size: lane(translator, search, ids, size, most) for size in sizes}  # also the warm-up
    times = interleave({size: (lambda size=size: lane(translator, search, ids, size, most))
                        for size in sizes}, args.repeats, warmup=0)
    seconds = {size: median(sum(rep) for rep in times[size]) for size in sizes}
    per_sentence = {size: 1e3 * seconds[size] / len(ids) for size in sizes}
    parts = {}  # one more run of each size, its parts timed (the wrapping costs a call a step)
    for size in sizes:
        with Clock() as clock:
            start = time.perf_counter()
            lane(translator, search, ids, size, most, clock)
            parts[size] = (clock, time.perf_counter() - start)
    rows = [[str(size), str(steps[size]), f"{1e3 * seconds[size] / steps[size]:.3f}",
             (f"{clock.kernel / total:.0%}" if clock.kernel else "–"),
             f"{clock.joining / total:.0%}", f"{1e3 * clock.joining / len(ids):.2f}",
             *((f"{1e6 * seconds / max(1, n):.0f}" if clock.kernel else "–")
               for n, seconds in (clock.quiet, clock.changed)),
             f"{per_sentence[size]:.2f}", f"{per_sentence[size] / per_sentence[sizes[-1]]:.2f}x"]
            for size in sizes for clock, total in [parts[size]]]
    conditions = (f"{len(ids)} {args.split} sentences of {args.run_dir} ({args.weights}), beam "
                  f"{args.beam}, alpha {args.alpha}, {'int8' if args.int8 else 'fp32'}, one thread; "
                  f"median of {args.repeats} interleaved repetitions (a sentence's time includes "
                  f"its joining); the shares of the time in the kernels' one call a step (int8) "
                  f"and in joining, and a step's Python around that call (int8, up to {most} quiet "
                  f"steps a call: a quiet step, nothing joined or ended since the last; a step at "
                  f"or after a change), from one "
                  f"more run of each size\ndevice: {device_description()}")
    print_table(["sentences in the search", "steps", "ms a step", "in the kernels' call",
                 "joining", "ms joining a sentence", "us of Python a quiet step",
                 "a step at a change", "ms a sentence",
                 f"a sentence / at {sizes[-1]}"], rows, conditions, args.json)


if __name__ == "__main__":
    main()
