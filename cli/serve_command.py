"""What ``bardflow serve`` needs of the command line beside its options: the API key from
where the user keeps it, the bar its compiling shows, and the model a key names, checked."""

from __future__ import annotations

import argparse
import os
import sys

from .arguments import UsageError

API_KEY_VARIABLE = "BARDFLOW_API_KEY"  # bardflow serve's key, kept out of ps
MIN_API_KEY = 16  # characters: a key a client can guess is no key


def requested_api_key(args: argparse.Namespace) -> str | None:
    """The key requests must send: --api-key-file's first line, else BARDFLOW_API_KEY, else
    --api-key; None where none is given."""
    if args.api_key_file is not None:
        try:
            lines = args.api_key_file.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise UsageError(
                f"--api-key-file {args.api_key_file}: {getattr(error, 'strerror', None) or error}"
            ) from None
        key = lines[0].strip() if lines else ""
    else:
        key = os.environ.get(API_KEY_VARIABLE) or args.api_key
        if key is None:
            return None
        key = key.strip()
    if len(key) < MIN_API_KEY or not key.isprintable() or " " in key:
        raise UsageError(
            f"the API key must be at least {MIN_API_KEY} printable characters without spaces; make one with "
            "`python3 -c 'import secrets; print(secrets.token_urlsafe(32))'`"
        )
    return key


def compiling(total: int):
    """A bar for the server's programs on a terminal; one line in a log, where a bar is not drawn."""
    from ..flows.ui import Progress

    if not sys.stderr.isatty():
        print(f"bardflow: compiling the {total} programs that serve any request", file=sys.stderr, flush=True)
    return Progress("serve", total, "compiling the programs that serve any request")


def served_model(root: str, prefix: str):
    """The model of the checkpoint (else trained) version whose key starts with ``prefix``,
    its tokenizer (None for a byte model's) and its name."""
    from ..artifacts.store import Store
    from ..cli.runs import RunsError, readable_store
    from ..model.training.checkpoint import load_model
    from ..tasks.checkpoint import MODEL
    from ..tasks.train import trained_model

    store = readable_store(root)
    for stages in (("checkpoint",), ("train_parallel", "train_single")):
        found = [v for stage in stages for v in store.versions(stage) if v.key.startswith(prefix)]
        if len(found) > 1:
            raise RunsError(f"{len(found)} {found[0].stage} versions have a key starting {prefix!r}; give more of it")
        if found:
            version = found[0]
            damaged = Store.damage(version.path, version.manifest["files"])
            if damaged:  # the seal says what was written; the files' checksums say what is there now
                raise RunsError(
                    f"the {version.stage} version {version.key[:12]} is damaged: {', '.join(sorted(damaged)[:3])} "
                    "no longer match the checksums its manifest holds; rerun the run that made it to rebuild it, "
                    "or serve another key"
                )
            model = load_model(version.file(MODEL)) if version.stage == "checkpoint" else trained_model(version)[0]
            tokenizer = model_tokenizer(store, version, model.lm_head.kernel.shape[-1])
            return model, tokenizer, f"bardflow-{version.key[:12]}"
    known = ", ".join(v.key[:12] for v in store.versions("checkpoint")[:6]) or "none"
    raise RunsError(
        f"no checkpoint or trained version in {root} has a key starting {prefix!r}; `bardflow artifacts checkpoint` "
        f"lists them (checkpoints: {known})"
    )


def model_tokenizer(store, version, vocab_size: int):
    """The tokenizer ``version``'s model was trained with, found through its manifests' inputs
    (checkpoint -> train -> encode -> tokenize): the tokenize version they name, by key and
    fingerprint, with its files as its manifest sealed them. None for a byte model. RunsError
    (one line) where it is gone, changed, or not the model's."""
    from ..cli.runs import RunsError
    from ..config.vocabulary import BYTE_VALUES
    from ..tasks.registry import TOKENIZE
    from ..tasks.tokenize import for_model

    named, seen, queue = None, set(), [version]
    while queue and named is None:
        current = queue.pop()
        for up in current.manifest.get("inputs", {}).values():
            if up["stage"] == TOKENIZE.name:
                named = up
                break
            if (up["stage"], up["key"]) not in seen and (found := store.lookup(up["stage"], up["key"])) is not None:
                seen.add((up["stage"], up["key"]))
                queue.append(found)
    if named is None:
        if vocab_size != BYTE_VALUES:
            raise RunsError(
                f"the {version.stage} version {version.key[:12]} predicts {vocab_size} ids, but no tokenize version "
                "is among its inputs; serve a checkpoint of a run that trained its tokenizer as a stage"
            )
        return None
    tokenize = store.lookup(TOKENIZE.name, named["key"])  # None where its files no longer match its manifest
    what = f"the tokenizer {named['key'][:12]} that {version.stage} {version.key[:12]} was trained with"
    if tokenize is None or tokenize.fingerprint != named["fingerprint"]:
        raise RunsError(
            f"{what} is gone or has changed since (missing, or its files or fingerprint differ); rerun that run "
            "to rebuild it"
        )
    return for_model(tokenize, vocab_size)
