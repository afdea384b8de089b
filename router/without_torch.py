"""Keeping torch out of the gateway's processes.

The gateway needs a tokenizer and a chat template from transformers, never a model. But
transformers 5 imports torch whenever it is installed: AutoTokenizer's module imports the
configuration classes, whose generation config imports its logits processors, which
import torch at module level, and transformers no longer honours USE_TORCH=0. Where the
gateway shares an environment with vLLM (this repository's setup, CI, any image built
from vLLM's), every gateway worker and indexer then loads torch: measured here
(2 cores, torch 2.13.0+cpu, transformers 5.19) `from transformers import AutoTokenizer`
took 5.2 s and the process held 454 MB after loading the tiny model's tokenizer; with
torch kept out, 1.4 s and 76 MB. The ids and rendered chats are the same: tokenizers
and the Jinja renderer are torch-free, and the tests that compare the gateway's ids with
vLLM's run the gateway through this entry point.

How: a `None` entry in sys.modules is Python's documented way to make an import fail
(the import system raises ModuleNotFoundError for a name whose entry is None), and
`importlib.util.find_spec` answers None for it, so transformers' own availability check
(`is_torch_available`) reports torch absent and takes its torch-free paths. Only the
`python -m router` entry point does this, before importing anything: a program that
imports the router package as a library (tests beside vLLM, a notebook) keeps its torch.

transformers then logs "PyTorch was not found. Models won't be available ..." once at
import. That is true and harmless for a process that loads no model, but it reads like a
fault in a gateway's log, so that one record is dropped.
"""

from __future__ import annotations

import logging
import sys

_ADVICE = "PyTorch was not found."


class _NoTorchAdvice(logging.Filter):
    """Drops transformers' one-off notice that it found no torch (see above)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_ADVICE)


def keep_torch_out() -> bool:
    """Make `import torch` fail in this process, unless torch is imported already;
    whether it now is kept out."""
    if sys.modules.get("torch") is not None:
        return False
    sys.modules["torch"] = None  # type: ignore[assignment]
    # transformers logs through its own logger, "transformers", with a handler of its
    # own; a filter there sees the record before any handler does.
    logging.getLogger("transformers").addFilter(_NoTorchAdvice())
    return True
