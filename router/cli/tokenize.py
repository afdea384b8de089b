"""`python -m router tokenize --model DIR REQUEST.json`: the prompt token ids a body renders to."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def load_request(path: Path) -> dict[str, Any]:
    """A request body from a JSON file, or ValueError naming the file and the problem."""
    try:
        body = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read {str(path)!r}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{str(path)!r} is not JSON: {exc.msg} at line {exc.lineno}") from exc
    if not isinstance(body, dict):
        raise ValueError(f"{str(path)!r} must hold a JSON object, got {type(body).__name__}")
    return body


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, required=True, help="model directory (tokenizer)")
    parser.add_argument("request", type=Path,
                        help="chat (has 'messages') or completion (has 'prompt') request JSON")


def run(args: argparse.Namespace) -> int:
    from router.request import ClientError
    from router.tokenize import PromptTokenizer, endpoint_of

    try:
        body = load_request(args.request)
        endpoint = endpoint_of(body)
        tokenizer = PromptTokenizer.from_dir(args.model)
        ids = tokenizer.request_tokens(body, endpoint)
    except ClientError as exc:
        where = f" ({exc.param})" if exc.param else ""
        print(f"error: bad request in {str(args.request)!r}{where}: {exc.message}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(ids))
    return 0
