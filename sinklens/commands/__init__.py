"""Sub-commands of the ``sinklens`` CLI, one module each."""

from __future__ import annotations

import argparse
import contextlib
import functools
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sinklens.errors import InvalidArgumentError
from sinklens.options import BATCH_SIZE, PREPEND_BOS, SEQ_LEN

if TYPE_CHECKING:
    from sinklens.inputs import TokenBatch


#: Random-token sequences a model without a tokenizer (a run on a synthetic task) is run on unasked.
DEFAULT_RANDOM_SEQUENCES = 16


def add_command(subparsers: Any, name: str, doc: str | None, *, help: str) -> argparse.ArgumentParser:
    """The parser of the sub-command ``name``, its module's docstring ``doc`` as the description."""
    width = min(shutil.get_terminal_size().columns, 100) - 2
    formatter = functools.partial(argparse.RawDescriptionHelpFormatter, width=width, max_help_position=26)
    return subparsers.add_parser(name, help=help, description=doc, formatter_class=formatter)


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, metavar="N", help="sequences per forward pass (default: %(default)s)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N, mps (default: cuda if available)")
    parser.add_argument("--dtype", default=None, help="float32 (default), float64, bfloat16, float16")


def add_bos_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bos", action=argparse.BooleanOptionalAction, default=PREPEND_BOS,
                        help="BOS first or not (default: as the model's tokenizer does)")


def add_json_flag(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--json", metavar="FILE", default=None,
                        help=f"write {what} as strict JSON to FILE (-: stdout)")


def json_target(path: str | None, *, overwrite: bool) -> Path | str | None:
    """The ``--json`` target, checked before any work: None, ``"-"`` (stdout) or a writable file outside a
    training run, holding no finished result unless ``overwrite``."""
    from sinklens.validate import no_finished_output, writable_file

    if path is None or path == "-":
        return path
    file = writable_file(path, what="--json")
    outside_run_internals(file, what="--json", file=True)
    no_finished_output([file], overwrite=overwrite, flag="--json")
    return file


def write_json_target(target: Path | str | None, data: Any, *, overwrite: bool, text: str | None = None) -> None:
    """Write ``data`` to the ``--json`` target at full precision (strict JSON) and print ``text``, the file first (a
    reader that closes stdout, ``| head``, must not cost it); with ``--json -`` the text goes to stderr."""
    from sinklens.export import dumps, write_json

    if target not in (None, "-"):
        write_json(target, data, digits=None, replace=overwrite)
    if text is not None:
        print(text, file=sys.stderr if target == "-" else sys.stdout)
    if target == "-":
        print(dumps(data, digits=None, indent=1))


def int_list(text: str | None, flag: str) -> list[int] | None:
    """``text`` as distinct integers separated by commas or spaces (None stays None)."""
    if text is None:
        return None
    try:
        values = [int(v) for v in text.replace(",", " ").split()]
    except ValueError:
        raise InvalidArgumentError(f"{flag} expects integers separated by commas, got {text!r}.") from None
    if not values:
        raise InvalidArgumentError(f"{flag} is empty; give at least one integer (e.g. {flag} 0,1).")
    # the Python API keeps the first of each (validate.index_list); on the command line it is a typo
    if repeated := [v for i, v in enumerate(values) if v in values[:i]]:
        raise InvalidArgumentError(f"{flag} {text!r} gives {repeated[0]} more than once; give each value once.")
    return values


def check_model_flags(args: argparse.Namespace) -> None:
    from sinklens.validate import device, dtype, positive_int

    positive_int(args.batch_size, what="--batch-size")
    if args.device is not None:
        device(args.device, what="--device")
    if args.dtype is not None:
        dtype(args.dtype, what="--dtype")


def add_overwrite_flag(parser: argparse.ArgumentParser, finished: str) -> None:
    parser.add_argument("--overwrite", action="store_true", help=f"replace {finished}")


@contextlib.contextmanager
def result_folder(out: Path, finished: Sequence[str], *, overwrite: bool, existed: bool = True) -> Iterator[None]:
    """Lock ``out`` (rank 0 only) while this command writes a result there, checking the ``finished`` files
    again under the lock; on failure an ``out`` that did not exist before and is left empty is removed."""
    from sinklens.distributed import writes_outputs
    from sinklens.folder_lock import OUTPUT_LOCK, FolderLock
    from sinklens.validate import no_finished_output

    try:
        with FolderLock(out, OUTPUT_LOCK) if writes_outputs() else contextlib.nullcontext():
            no_finished_output([out / name for name in finished], overwrite=overwrite, flag="--out")
            yield
    except BaseException:
        if not existed and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise


def outside_run_internals(path: Path, *, what: str, file: bool) -> None:
    """Refuse an output ``path`` (a folder, or a ``file``) under a run's ``checkpoints/`` or ``tokenizer/``, or one
    of a run's top-level files."""
    from sinklens.errors import OutputNotWritableError
    from sinklens.sinklm.checkpoint import CHECKPOINTS, RUN_ENTRIES, TOKENIZER, is_run_dir

    target = path.expanduser().absolute()
    folder = target.parent if file else target
    for run in filter(is_run_dir, (folder, *folder.parents)):
        inside = target.relative_to(run).parts
        if inside and inside[0] in (CHECKPOINTS, TOKENIZER):
            raise OutputNotWritableError(
                f"{what} {str(path)!r} is inside the {inside[0]}/ folder of the training run {str(run)!r}, which the "
                "trainer manages (it deletes old step folders with everything in them); choose a folder outside it.")
        if file and len(inside) == 1 and inside[0] in RUN_ENTRIES:
            raise OutputNotWritableError(
                f"{what} {str(path)!r} is the file {inside[0]} of the training run {str(run)!r}; replacing it would "
                "break the run. Choose another file name.")


def random_token_inputs(model: Any, args: argparse.Namespace, *, command: str,
                        text_flag: str | None) -> list[TokenBatch] | None:
    """The random-token batches a command runs on, or None when it runs on text: ``args.random_tokens``
    sequences of ``args.seq_len`` tokens (default ``min(SEQ_LEN, n_ctx)``); a model without a tokenizer runs on
    :data:`DEFAULT_RANDOM_SEQUENCES` of them. They start with BOS when ``args.bos`` and the model has one."""
    from sinklens import distributed
    from sinklens.hooks import model_dims
    from sinklens.inputs import random_token_batches, resolved_bos
    from sinklens.sinklm.config import SYNTHETIC_SOURCES
    from sinklens.validate import seq_len_within_context

    has_tokenizer = getattr(model, "tokenizer", None) is not None
    n_ctx = model_dims(model).n_ctx
    seq_len_within_context(args.seq_len, n_ctx)
    data = getattr(getattr(model, "train_config", None), "data", None)  # a synthetic task starts with BOS id 0
    bos = resolved_bos(model, args.bos) and (has_tokenizer or getattr(data, "source", None) in SYNTHETIC_SOURCES)
    seq_len, n_sequences = args.seq_len or min(SEQ_LEN, n_ctx), args.random_tokens
    if n_sequences is None and has_tokenizer:
        if args.seq_len is not None:
            cut = " (cut them with --max-length)" if hasattr(args, "max_length") else ""
            raise InvalidArgumentError(f"--seq-len {args.seq_len} sets the length of --random-tokens sequences, and "
                                       f"this {command} runs on text prompts{cut}.")
        return None
    if n_sequences is None:
        if text_flag is not None:
            raise InvalidArgumentError(f"{text_flag} needs a tokenizer, and the model {str(args.model)!r} has none "
                                       "(trained on synthetic data?); use --random-tokens N.")
        n_sequences = DEFAULT_RANDOM_SEQUENCES
        if distributed.is_main():
            start = ", each starting with the task's BOS token 0 as in training" if bos else ""
            print(f"sinklens {command}: {str(args.model)!r} has no tokenizer (trained on synthetic data?); running on "
                  f"{n_sequences} random-token sequences of {seq_len} tokens{start} instead", file=sys.stderr)
    return random_token_batches(model, n_sequences=n_sequences, seq_len=seq_len, batch_size=args.batch_size,
                                prepend_bos=bos)

