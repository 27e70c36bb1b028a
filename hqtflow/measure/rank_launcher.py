"""torchrun for `measure --tp N`: `torch.distributed.run` itself, less its report of a failed rank. Each rank prints its
own error (one sentence for a user error), so torchrun's traceback and "Root Cause" block are left out, and the exit
code is the failed rank's (the kind of its error, `hqtflow.errors`), not torchrun's 1."""

from __future__ import annotations

import logging
import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(get_args_parser().parse_args(argv))
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        return next((c for c in codes if c > 0), 1)  # (a rank killed by a signal has a negative one)
    return 0


if __name__ == "__main__":
    sys.exit(main())
