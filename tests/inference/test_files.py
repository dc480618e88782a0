"""`aiayn translate -i IN -o OUT` on files of any length (aiayn.inference.files): lazy
reading by the old rules, output written chunk by chunk into OUT.partial with its record,
--resume after an interruption (a kill -9 too) ending byte-identical to an uninterrupted
run without translating again what was done, and the refusals that change nothing.

The fast tests drive the module with a stand-in translator whose ``translate_lines`` keeps
the real one's contract (one string per chunk of input lines, in order); the slow ones run
the command on a real tiny run."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from itertools import islice
from pathlib import Path

import pytest
from helpers import error_line, random_sentence, run_cli, snapshot

from aiayn.errors import AiaynError
from aiayn.inference import files
from aiayn.inference.files import Job
from aiayn.inference.lines import read_lines, scan_input, stream_lines, text_lines
from aiayn.inference.settings import Sampling, Search

RUN = {"run_dir": "/runs/x", "weights": "best", "engine": "aiayn", "device": "cpu",
       "decode_tokens": None}


class Upper:
    """A translator: each line numbered (from ``first_line``, as the real one numbers n-best
    rows) and upper-cased, ``chunk`` lines a string; counts what it read."""

    def __init__(self, stop_after: int | None = None, during=None):
        self.read, self.chunks, self.stop_after, self.during = 0, 0, stop_after, during
        self.calls: list[dict] = []

    def translate_lines(self, lines, search=None, chunk=2000, first_line=0, **modes):
        self.calls.append({"search": search, "chunk": chunk, **modes})
        lines, number = iter(lines), first_line
        while part := list(islice(lines, chunk)):
            self.read += len(part)
            if self.stop_after is not None and self.chunks == self.stop_after:
                raise KeyboardInterrupt
            if self.during is not None:
                self.during(self.chunks)
            self.chunks += 1
            yield "".join(f"{n}:{line.upper()}|{len(part)}\n"
                          for n, line in enumerate(part, number))
            number += len(part)


def reference_lines(data: bytes) -> list[str]:
    """`aiayn translate`'s rules as they were written for a file read whole."""
    lines = data.decode("utf-8-sig").split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


@pytest.mark.parametrize("data", [
    b"", b"\n", b"\n\n", b"a", b"a\n", b"a\r\nb\r\n", b"a\rb\n", b"\xef\xbb\xbf",
    b"\xef\xbb\xbfa\nb", b"\xef\xbb\xbf\n", "x\u2028y\x0cz\n\u0085\n".encode(), b"\r\n\r",
    "caf\u00e9\n\ufeffmid\n".encode(),
])
def test_lazy_reading_keeps_the_rules_of_reading_whole(tmp_path, data):
    path = tmp_path / "in.txt"
    path.write_bytes(data)
    assert list(read_lines(path)) == reference_lines(data)
    assert scan_input(path).lines == len(reference_lines(data))
    # stdin's readers, whole and line by line (--interactive), and `aiayn score`'s
    assert text_lines(data, "stdin") == reference_lines(data)
    assert list(stream_lines(io.BytesIO(data), "stdin")) == reference_lines(data)


@pytest.mark.parametrize("data, line, column, byte, before", [
    (b"God is love.\nJesus wept.\nThe Lord.\n\xff bad\nok\n", 4, 1, 36,
     ["God is love.", "Jesus wept.", "The Lord."]),
    (b"\xef\xbb\xbfab\nok \xff\n", 2, 4, 10, ["ab"]),  # the byte-order mark among the bytes
    (b"\xef\xbb\xbf\xff", 1, 4, 4, []),
])
def test_stdin_text_that_is_not_utf8_names_its_line_and_byte(data, line, column, byte, before):
    """Read whole, nothing comes out; line by line, the lines before the bad one do."""
    said = (rf"stdin, line {line}: not UTF-8 text \(invalid start byte: byte {column} of the "
            rf"line, {byte} of the input\)")
    with pytest.raises(AiaynError, match=said):
        text_lines(data, "stdin")
    read = []
    with pytest.raises(AiaynError, match=said):
        read.extend(stream_lines(io.BytesIO(data), "stdin"))
    assert read == before


def test_reading_from_a_chunk_boundary_gives_the_rest(tmp_path):
    path = tmp_path / "in.txt"
    path.write_bytes(b"\xef\xbb\xbfa\r\nb\nc\n\nd\ne")
    ends: dict[int, int] = {}
    assert list(read_lines(path, boundaries=ends, chunk=2)) == ["a", "b", "c", "", "d", "e"]
    assert sorted(ends) == [2, 4, 6] and ends[6] == path.stat().st_size
    assert list(read_lines(path, start=ends[2], first_line=2)) == ["c", "", "d", "e"]


def test_text_that_is_not_utf8_names_its_line_before_anything_is_read(tmp_path):
    path = tmp_path / "in.txt"
    path.write_bytes(b"one\ntwo\nthr\xffee\nfour\n")
    with pytest.raises(AiaynError, match=r"in.txt, line 3: not UTF-8 text \(invalid start "
                                         r"byte: byte 4 of the line, 12 of the input\)"):
        scan_input(path)


# ---------------------------------------------------------------- writing and resuming
def lines_file(tmp_path: Path, n: int = 23) -> Path:
    path = tmp_path / "in.txt"
    path.write_text("".join(f"line {i}\n" if i % 7 else "\n" for i in range(n)),
                    encoding="utf-8")
    return path


BEAM2 = Search(beam=2)


def job(source, out, search=BEAM2, chunk=5, **kwargs) -> Job:
    return Job(source, out, search, run=kwargs.pop("run", RUN), chunk=chunk, **kwargs)


def expected(source: Path, chunk: int = 5) -> str:
    translator = Upper()
    return "".join(translator.translate_lines(read_lines(source), chunk=chunk))


def test_the_output_appears_whole_and_nothing_else_is_left(tmp_path):
    source = lines_file(tmp_path)
    out = tmp_path / "out.txt"
    translator = Upper()
    job(source, out, modes={"alignments": False}).run(translator, progress=False)
    assert out.read_text(encoding="utf-8") == expected(source)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.txt"]
    assert translator.calls == [{"search": Search(beam=2), "chunk": 5, "alignments": False}]


def test_each_chunk_is_on_disk_with_its_record_while_the_next_is_decoded(tmp_path):
    source, out = lines_file(tmp_path), tmp_path / "out.txt"
    seen = []

    def look(chunks_done):
        record = json.loads((tmp_path / "out.txt.partial.json").read_text(encoding="utf-8"))
        partial = (tmp_path / "out.txt.partial").read_bytes()
        seen.append((record["done"]["lines"], len(partial) == record["done"]["output_bytes"]))

    job(source, out).run(Upper(during=look), progress=False)
    assert seen == [(0, True), (5, True), (10, True), (15, True), (20, True)]


def interrupt(source: Path, out: Path, chunks: int, **kwargs) -> None:
    with pytest.raises(KeyboardInterrupt):
        job(source, out, **kwargs).run(Upper(stop_after=chunks), progress=False)


def test_resume_after_an_interruption_gives_the_same_bytes_and_decodes_the_rest_only(
        tmp_path, capsys):
    source, out = lines_file(tmp_path), tmp_path / "out.txt"
    interrupt(source, out, chunks=2)
    assert "out.txt.partial keeps the first 10 of 23 lines" in capsys.readouterr().err
    partial = tmp_path / "out.txt.partial"
    assert partial.read_text(encoding="utf-8") == expected(source)[:len(partial.read_bytes())]
    with open(partial, "ab") as fh:  # a kill in the middle of the next chunk's write
        fh.write(b"HALF A CHU")
    translator = Upper()
    job(source, out, resume=True).run(translator, progress=False)
    assert out.read_text(encoding="utf-8") == expected(source)
    assert translator.read == 23 - 10  # the lines done are not decoded again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.txt"]


def test_a_random_sampling_seed_comes_from_the_record(tmp_path):
    source, out = lines_file(tmp_path), tmp_path / "out.txt"
    sampled = Search(beam=2, nbest=2, sampling=Sampling(temperature=0.5, seed=1234))
    interrupt(source, out, chunks=1, search=sampled)
    drawn = Search(beam=2, nbest=2, sampling=Sampling(temperature=0.5, seed=99))
    resumed = job(source, out, search=drawn, resume=True, seed_given=False)
    assert resumed.search.sampling.seed == 1234
    with pytest.raises(AiaynError, match=r"the search differs .*sampling.seed 1234 then, 99 "
                                         r"now"):
        job(source, out, search=drawn, resume=True, seed_given=True)


def refused(tmp_path: Path, match: str, **kwargs) -> None:
    """The Job is refused with ``match`` and no file under tmp_path changes."""
    before = snapshot(tmp_path)
    with pytest.raises(AiaynError, match=match):
        job(kwargs.pop("source", tmp_path / "in.txt"), tmp_path / "out.txt", **kwargs).run(
            Upper(), progress=False)
    assert snapshot(tmp_path) == before


def test_the_bad_requests_of_a_resume_are_one_line_and_change_nothing(tmp_path):
    source = lines_file(tmp_path)
    refused(tmp_path, r"--resume: nothing to resume for -o .*out.txt \(no .*out.txt.partial\)",
            resume=True)
    interrupt(source, tmp_path / "out.txt", chunks=3)
    refused(tmp_path, r"out.txt.partial is left by an interrupted translate \(15 of 23 lines "
                      r"done\); --resume continues it, or delete it")
    refused(tmp_path, r"the search differs .*\(beam 2 then, 4 now\)", resume=True,
            search=Search(beam=4))
    refused(tmp_path, r"--chunk-lines differs .*\(value 5 then, 6 now\)", resume=True, chunk=6)
    refused(tmp_path, r"the model differs .*\(weights best then, last now\)", resume=True,
            run={**RUN, "weights": "last"})
    refused(tmp_path, r"the output's options differ from .*\(alignments none then, true now\)",
            resume=True, modes={"alignments": True})
    other = tmp_path / "other.txt"
    other.write_bytes(source.read_bytes())
    refused(tmp_path, r"the input differs from the interrupted run's \(path .*in.txt then, "
                      r".*other.txt now\)", resume=True, source=other)
    source.write_text(source.read_text(encoding="utf-8").replace("line 20", "line 2X"),
                      encoding="utf-8")
    refused(tmp_path, r"the input differs from the interrupted run's \(sha256 ", resume=True)
    (tmp_path / "out.txt.partial.json").write_text("{", encoding="utf-8")
    refused(tmp_path, r"out.txt.partial.json is missing or unreadable", resume=True)


def test_an_output_being_written_is_refused_to_a_second_translate(tmp_path):
    source, out = lines_file(tmp_path), tmp_path / "out.txt"
    refusals = []

    def second(chunks_done):
        if chunks_done == 2:
            before = snapshot(tmp_path)
            for resume in (False, True):
                with pytest.raises(AiaynError) as caught:
                    job(source, out, resume=resume).run(Upper(), progress=False)
                refusals.append(str(caught.value))
            assert snapshot(tmp_path) == before

    job(source, out).run(Upper(during=second), progress=False)
    assert refusals == [f"-o {out} is in use by pid {os.getpid()} (aiayn translate), writing "
                        f"{out}.partial; wait for it to finish (or stop it) and try again"] * 2
    assert out.read_text(encoding="utf-8") == expected(source)


@pytest.mark.parametrize("change", ["append", "shorten"])
def test_an_input_written_to_while_it_is_translated_stops_the_run_in_one_line(
        tmp_path, capsys, change):
    """The lines read are the lines scanned (counted, hashed): a file another program
    lengthens or cuts meanwhile is refused, the whole chunks read before kept (20 lines:
    the change is in the last chunk's lines) with how to go on."""
    source, out = lines_file(tmp_path), tmp_path / "out.txt"
    data, whole = source.read_bytes(), expected(source)

    def write(chunks_done):
        if chunks_done == 1:
            source.write_bytes(data + b"more\n" if change == "append" else data[:-20])

    with pytest.raises(AiaynError, match=r"in.txt: the file changed while it was translated "
                                         rf"\({len(data)} bytes when the command began, "):
        job(source, out).run(Upper(during=write), progress=False)
    assert "out.txt.partial keeps the first 20 of 23 lines; the same command with --resume " \
           "continues it once the cause below is fixed (after a change to -i, delete it and " \
           "out.txt.partial.json to start again)" in capsys.readouterr().err
    kept = (tmp_path / "out.txt.partial").read_text(encoding="utf-8")
    assert kept == "".join(whole.splitlines(keepends=True)[:20])
    source.write_bytes(data)  # written whole again: resumed, the run ends as one alone
    job(source, out, resume=True).run(Upper(), progress=False)
    assert out.read_text(encoding="utf-8") == whole
    with pytest.raises(AiaynError, match=r"in.txt: the file changed while it was translated"):
        for _ in files.translate_file(Upper(during=write), source, BEAM2, chunk=5,
                                      progress=False):
            pass


def test_an_input_removed_once_it_is_open_is_read_to_its_end(tmp_path):
    """A file removed (or renamed) while it is read is still read whole through the open
    handle: its lines come, as the scan found them, with no error."""
    source = lines_file(tmp_path, 3)
    found, lines = scan_input(source), []
    for line in read_lines(source, end=found.size):
        lines.append(line)
        source.unlink(missing_ok=True)
    assert lines == ["", "line 1", "line 2"]
    assert found.lines == 3


def test_an_input_that_is_a_pipe_is_refused_before_it_is_read(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(AiaynError, match=r"fifo: not a regular file; -i is read twice .* send "
                                         r"it on stdin instead"):
        scan_input(fifo)


def test_the_alignment_layer_is_part_of_what_a_resume_must_match(tmp_path):
    source = lines_file(tmp_path)
    with_layer = files.run_identity(tmp_path, "best", "aiayn", "cpu", None, alignment_layer=0)
    assert with_layer["alignment_layer"] == 0
    assert "alignment_layer" not in files.run_identity(tmp_path, "best", "aiayn", "cpu", None)
    interrupt(source, tmp_path / "out.txt", chunks=1, run={**RUN, "alignment_layer": 0})
    refused(tmp_path, r"the model differs .*\(alignment_layer 0 then, -1 now\)", resume=True,
            run={**RUN, "alignment_layer": -1})
    # The command records the layer only where alignments are written and it is not the
    # default, so that a record from before it was recorded resumes as it was.
    from dataclasses import replace

    from aiayn.cli import _alignment_layer
    from aiayn.config import DecodeConfig

    default, other = DecodeConfig(), replace(DecodeConfig(), alignment_layer=-1)
    assert (_alignment_layer(default, True), _alignment_layer(other, True),
            _alignment_layer(other, False)) == (None, -1, None)


def test_an_error_before_the_first_chunk_leaves_nothing(tmp_path):
    source, out = lines_file(tmp_path), tmp_path / "out.txt"
    interrupt(source, out, chunks=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


def test_a_full_disk_keeps_the_whole_chunks_and_says_how_to_go_on(tmp_path, monkeypatch):
    import errno

    source, out = lines_file(tmp_path), tmp_path / "out.txt"
    real_write = files._write_all
    writes = []

    def full(fd, data):
        writes.append(data)
        if len(writes) == 3:
            real_write(fd, data[:4])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write(fd, data)

    monkeypatch.setattr(files, "_write_all", full)
    with pytest.raises(files.DiskError) as caught:
        job(source, out).run(Upper(), progress=False)
    assert caught.value.line("-o") == (
        f"no space left on {out}: writing the translations; {out}.partial keeps the first 10 "
        "of 23 lines: free space, then the same command with --resume continues it")
    partial = (tmp_path / "out.txt.partial").read_text(encoding="utf-8")
    assert partial == expected(source)[:len(partial)] and partial.count("\n") == 10
    monkeypatch.undo()
    job(source, out, resume=True).run(Upper(), progress=False)
    assert out.read_text(encoding="utf-8") == expected(source)


# ---------------------------------------------------------------- the command, on a real run
def big_input(tmp_path: Path, n: int) -> Path:
    import random

    rng = random.Random(3)
    path = tmp_path / "in.txt"
    path.write_text("".join(random_sentence(rng) + "\n" for _ in range(n)), encoding="utf-8")
    return path


# `aiayn` whose every decoded chunk takes a second more: a run long enough for a second
# command to start beside it, and to be killed in the middle, on a tiny model.
SLOW_AIAYN = ("import sys, time\n"
              "from aiayn import cli\n"
              "from aiayn.inference.translator import Translator\n"
              "real = Translator.prepare\n"
              "def slow(self, *args, **kwargs):\n"
              "    time.sleep(1)\n"
              "    return real(self, *args, **kwargs)\n"
              "Translator.prepare = slow\n"
              "sys.exit(cli.main(sys.argv[1:]))\n")


def aiayn(*args, slow: bool = False) -> subprocess.Popen:
    command = ["-c", SLOW_AIAYN] if slow else ["-m", "aiayn"]
    return subprocess.Popen([sys.executable, *command, *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def wait_for_lines(sidecar: Path, proc: subprocess.Popen, lines: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if json.loads(sidecar.read_text(encoding="utf-8"))["done"]["lines"] >= lines:
                return
        except (OSError, ValueError):
            pass
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    raise AssertionError("the translate wrote no chunk in time")


def test_a_kill_9_then_resume_ends_byte_identical_to_an_uninterrupted_run(run_dir, tmp_path):
    source = big_input(tmp_path, 300)
    common = ["translate", run_dir, "-i", source, "--beam", "2", "--chunk-lines", "10"]
    whole = tmp_path / "whole.txt"
    done = aiayn(*common, "-o", whole)
    assert done.wait(timeout=300) == 0, done.communicate()
    out = tmp_path / "out.txt"
    proc = aiayn(*common, "-o", out, slow=True)
    wait_for_lines(tmp_path / "out.txt.partial.json", proc, 30)
    # A second translate to the same output, meanwhile, is refused and changes nothing.
    before = snapshot(tmp_path)
    second = aiayn(*common, "-o", out)
    _, err = second.communicate(timeout=120)
    assert second.returncode == 2
    assert f"-o {out} is in use by pid {proc.pid} (aiayn translate)" in \
        error_line(err.decode())
    after = snapshot(tmp_path)
    # (the first one goes on writing meanwhile: only its own two files may change)
    assert {k: v for k, v in after.items() if not k.startswith("out.txt")} == \
        {k: v for k, v in before.items() if not k.startswith("out.txt")}
    assert proc.poll() is None  # it still runs: killed in the middle
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists() and (tmp_path / "out.txt.partial").exists()
    resumed = aiayn(*common, "-o", out, "--resume")  # the kernel let go of the lock
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err.decode()
    assert out.read_bytes() == whole.read_bytes()
    assert not (tmp_path / "out.txt.partial").exists()
    assert not (tmp_path / "out.txt.partial.json").exists()


def test_the_command_resumes_without_decoding_the_lines_done_again(
        run_dir, tmp_path, capsys, monkeypatch):
    from aiayn.inference.translator import Translator

    source, out = big_input(tmp_path, 47), tmp_path / "out.txt"
    argv = ["translate", str(run_dir), "-i", str(source), "-o", str(out), "--beam", "2",
            "--chunk-lines", "10", "--nbest", "2"]  # n-best rows number their lines
    real = Translator.prepare  # once per chunk, with its sentences
    decoded, stop = [], [True]

    def counting(self, sentences, prefixes=None, first=0):
        if len(decoded) == 2 and stop[0]:
            raise KeyboardInterrupt  # Ctrl-C while the third chunk is decoded
        decoded.append(len(sentences))
        return real(self, sentences, prefixes, first)

    monkeypatch.setattr(Translator, "prepare", counting)
    code, _, err = run_cli(argv, capsys)
    assert code == 130 and "keeps the first 20 of 47 lines" in err
    stop[0] = False
    code, _, err = run_cli([*argv, "--resume"], capsys)
    assert code == 0, err
    assert decoded == [10, 10, 10, 10, 7]  # 20 lines, interrupted; then the 27 left
    monkeypatch.setattr(Translator, "prepare", real)
    code, stdout, _ = run_cli(argv[:4] + argv[6:], capsys)
    assert code == 0 and out.read_text(encoding="utf-8") == stdout


def test_resume_without_output_or_input_is_one_line(run_dir, tmp_path, capsys):
    source = big_input(tmp_path, 3)
    before = snapshot(tmp_path)
    code, _, err = run_cli(["translate", str(run_dir), "-i", str(source), "--resume"], capsys)
    assert code == 2 and "--resume continues an interrupted `-i IN -o OUT` run" in \
        error_line(err)
    code, _, err = run_cli(["translate", str(run_dir), "-o", str(tmp_path / "o"), "--resume"],
                           capsys)
    assert code == 2 and "(stdin cannot be read again)" in error_line(err)
    assert snapshot(tmp_path) == before


def test_a_translate_lines_that_reports_batches_moves_the_bar_with_them(tmp_path):
    source, out = lines_file(tmp_path), tmp_path / "out.txt"
    given = []

    class Reporting(Upper):
        def translate_lines(self, lines, search=None, chunk=2000, progress=None, **modes):
            given.append(progress)
            return super().translate_lines(lines, search, chunk, **modes)

    job(source, out).run(Reporting(), progress=False)
    assert len(given) == 1 and callable(given[0])
    job(source, tmp_path / "plain.txt").run(Upper(), progress=False)  # none given to others
    assert out.read_bytes() == (tmp_path / "plain.txt").read_bytes()
