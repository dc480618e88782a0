"""Which runs may start: the run directory's admission policy for `aiayn train`.

``check_run_request`` refuses contradictory options before anything is loaded;
``run_dir_held`` holds the run directory (one writer) for the whole run; ``RunStart``
decides what a run starts from (new, ``--resume``, ``--init-from``) and with which
config; ``run_size`` is the disk space a run will need, checked before the first step.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from torch import nn

from aiayn.config import Config
from aiayn.data.prepared import prepared_corpus
from aiayn.errors import AiaynError
from aiayn.runs.checkpoint import (
    tensors_size,
    unique_state_dict,
)
from aiayn.runs.directory import (
    check_new_run_dir,
    create_run_dir,
    load_run_config,
    not_a_run_error,
    read_data_dir,
    read_export_info,
    record_config,
    resume_point,
)
from aiayn.training.transfer import InitFrom
from aiayn.util.io import as_disk_error, missing_dirs, remove_empty_dirs, remove_temp_files
from aiayn.util.lock import PID_FILE, locked
from aiayn.util.progress import log


@contextmanager
def run_dir_held(run_dir: Path, resume: bool, force: bool):
    """Check that ``run_dir`` can take this command (before anything is written), create
    it if new, hold its lock for the block, and clean temporary files a crash left. A new
    directory is removed again if the command fails before writing the run into it, or if
    a full disk stops it before its first save."""
    if resume:
        if not run_dir.is_dir():
            raise AiaynError(f"--resume {run_dir}: run directory not found")
        exported = read_export_info(run_dir)  # a CTranslate2 export has a config.yaml too
        if exported is not None:
            raise not_a_run_error(run_dir, exported)
    else:
        check_new_run_dir(run_dir, force)
    created = missing_dirs(run_dir)  # the run directory and the parents made for it (runs/)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        with locked(run_dir, "aiayn train"):
            removed = remove_temp_files(run_dir)
            if removed:
                log(f"removed {len(removed)} temporary file(s) an interrupted save left "
                    f"in {run_dir}")
            yield
    except BaseException as exc:
        # A new directory goes again if nothing was written into it, or if the disk
        # refused the run before its first save (no train state: nothing to resume).
        half_made = as_disk_error(exc) is not None and not (run_dir / "train_state.pt").exists()
        if created and (half_made or not (run_dir / "config.yaml").exists()):
            shutil.rmtree(run_dir, ignore_errors=True)
            remove_empty_dirs(created[1:])
        raise


def check_run_request(resume: bool, init_from: str | Path | None, config_given: bool,
                      data_dir: str | Path | None, out: str | Path | None,
                      force: bool = False) -> None:
    """The three ways to start `aiayn train`, each with what it needs: a new run (--config,
    --data, --out), a resume (--resume RUN_DIR: its own config and directory), a new run
    from another run's weights (--init-from RUN_DIR, --data, --out). The CLI and ``train``
    both check here, so a wrong combination gets the same one line from either."""
    if init_from is not None:
        if resume or data_dir is None or out is None:
            raise AiaynError("--init-from RUN_DIR starts a new run: give --data PREPARED_DIR "
                             "(prepared with `aiayn prepare --tokenizer-from RUN_DIR`) --out "
                             "NEW_RUN_DIR (and no --resume)")
    elif resume:
        if config_given or out is not None or force:
            raise AiaynError("--resume RUN_DIR continues a run with its own config and "
                             "directory; drop --config/--out/--force (change train.* or decode.* "
                             "settings with --set)")
    elif not config_given or data_dir is None or out is None:
        raise AiaynError("a new run needs --config FILE --data PREPARED_DIR --out RUN_DIR "
                         "(or --resume RUN_DIR)")


def check_holds_a_run(run_dir: Path) -> None:
    """--resume needs the run's config.yaml, the file `aiayn train` writes last when it
    creates a run: a directory without it was left by a start stopped before that (a kill in
    its first seconds), and the way on is that start's own command again."""
    if (run_dir / "config.yaml").is_file():
        return
    leftovers = [p.name for p in run_dir.iterdir() if p.name != PID_FILE]
    raise AiaynError(
        f"{run_dir}: holds no run to resume (no config.yaml: `aiayn train` stopped before it "
        f"wrote one); start the run again with the command that began it, `aiayn train "
        f"--config FILE --data DIR --out {run_dir}" + (" --force`, which replaces what the "
        f"stopped start left ({', '.join(sorted(leftovers)[:4])})" if leftovers else "`"))


@dataclass
class RunStart:
    """Where a Trainer starts: the settings before the data is seen, the data, and whether
    it continues a saved run (a resume), begins one (new, or ``init`` from another run's
    weights), or begins again a resumed run that had saved nothing (``restart``)."""

    config: Config
    data_dir: Path
    resume: bool = False
    restart: bool = False
    init: InitFrom | None = None

    @property
    def continues(self) -> bool:
        return self.resume and not self.restart

    @classmethod
    def choose(cls, config: Config | None, data_dir: str | Path | None, run_dir: Path,
               resume: bool, overrides: list[str], init_from: str | Path | None,
               log: Callable[[str], object]) -> RunStart:
        if resume:
            check_holds_a_run(run_dir)
            # A run that crashed before its first save (or in it, before train_state.pt)
            # has nothing to resume from: it starts again at step 0 with its own config
            # (which is what it would have done).
            first_save = load_run_config(run_dir, []).train.save_every
            restart = resume_point(run_dir, first_save) is None
            if restart:
                log(f"{run_dir}: no checkpoint was saved yet; starting it at step 0 with its "
                    "config.yaml")
            return cls(load_run_config(run_dir, overrides),
                       Path(data_dir) if data_dir else read_data_dir(run_dir), True, restart)
        assert data_dir is not None  # check_run_request
        if init_from is None:
            assert config is not None  # check_run_request
            # The run records the corpus its data was prepared from, not the config's (a
            # preset names the Bible; own data was prepared from its own file).
            corpus = prepared_corpus(data_dir) or config.data.corpus
            return cls(replace(config, data=replace(config.data, corpus=corpus)), Path(data_dir))
        init = InitFrom.parse(init_from)  # fine-tuning: that run's shape and tokenizers
        init.check_data(Path(data_dir))
        return cls(init.config_for_new_run(config, overrides, Path(data_dir)), Path(data_dir),
                   init=init)

    def record(self, run_dir: Path, stored: Config, overrides: list[str], step: int,
               force: bool) -> None:
        """Write the run into ``run_dir`` (rank 0, once everything is checked and loaded):
        a new run's files; on resume the new train.*/decode.* settings and a line saying so in
        config_history.jsonl."""
        if not self.continues:
            create_run_dir(run_dir, stored, self.data_dir, force or self.restart)
            if self.init is not None:
                self.init.record(run_dir)
        if self.resume:
            record_config(run_dir, stored, overrides, step)


def run_size(model: nn.Module, keep_checkpoints: int, continues: bool, kept: int = 0) -> int:
    """About the bytes a run still writes at its fullest (aiayn.runs.checkpoint.tensors_size):
    a new one its step checkpoints (one more before the oldest is pruned), last and best,
    and train_state.pt (the weights and Adam's two moments) with its temporary copy beside
    the old one; a resumed one, whose files are there, one new step file and that copy.
    ``kept``: the train.keep_steps still ahead, a weights file each."""
    weights = tensors_size(unique_state_dict(model))
    state = 3 * weights
    if continues:
        return (1 + kept) * weights + state
    return (keep_checkpoints + 1 + 2 + kept) * weights + 2 * state
