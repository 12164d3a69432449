"""`peer keygen`: make a run key (the RSA key a run's servers share; see core/protocol/trust.py)."""

from __future__ import annotations

import os

from peer.errors import UsageError


def add_arguments(p) -> None:
    p.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="PATH",
        help="where to write the key (PEM, readable by its owner only); never overwritten",
    )
    p.add_argument(
        "--run-id", default=None, metavar="NAME", help="print the --run-id NAME@FINGERPRINT to give volunteers"
    )


def run(args) -> int:
    from core.protocol.trust import SigningKey, split_run_id

    if os.path.exists(args.output):
        raise UsageError(
            f"--output {args.output} exists: a run key is never overwritten (its fingerprint is what volunteers trust)"
        )
    folder = os.path.dirname(os.path.abspath(args.output))
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise UsageError(f"--output {args.output}: {folder} is not a folder")
    if args.run_id is not None:
        try:
            name, fp = split_run_id(args.run_id)
        except ValueError as e:
            raise UsageError(f"--run-id: {e}") from None
        if fp is not None:
            raise UsageError("--run-id: give the name alone (the fingerprint is the new key's)")
    key = SigningKey.generate()
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)  # the folder is made (readable by its owner only)
        key.save(args.output)
    except OSError as e:
        raise UsageError(f"--output {args.output}: {e.strerror or e}") from None
    print(f"fingerprint={key.fingerprint}")
    if args.run_id is not None:
        print(f"run={args.run_id}@{key.fingerprint}")
    return 0
