"""What a server must share with its run: the flags that make the run's config record, and what
differs between the record and this server's own (a server started with other flags refuses to join
and names each)."""

from __future__ import annotations

# the run's flags every server must share, as the config record names them -> the flag that sets it
SHARED_FLAGS = {
    "model": "--model",
    "arch": "--init-from",
    "seed": "--seed",
    "steps": "--steps",
    "batch_size": "--batch-size",
    "micro_batches": "--micro-batches",
    "lr": "--lr",
    "recipe": "--lr-schedule/--warmup-steps/--min-lr/--decay-steps/--betas/--eps/--weight-decay",
    "compress": "--compress",
    "precision": "--precision",
    "data": "--data",
    "eval_every": "--eval-every",
    "announce_period": "--announce-period",
    "layout": "--stages/--frontal-per-stage/--backward-per-stage or --plan",
}


def differing_flags(ours: dict, theirs: dict) -> list[str]:
    """What the run's config (`theirs`, from the DHT) and this server's (`ours`) disagree on, as
    `--flag theirs (here: ours)`; the layout only while the run is at its first layout epoch (a
    failover changes it)."""
    out = []
    for key, flag in SHARED_FLAGS.items():
        if key == "layout" and theirs.get("epoch", 0) != 0:
            continue
        if key in theirs and theirs.get(key) != ours.get(key):
            if key == "data":  # (known only to a server that reads the data, and only compared there)
                if ours.get("data") is not None and theirs.get("data") is not None:
                    out.append(f"--data: the run's corpus has fingerprint {theirs['data']} (here: {ours['data']})")
            elif key == "recipe":
                out += _recipe_differences(ours, theirs)
            elif key in ("layout", "arch"):
                out.append(f"{flag} (the run's {key} differs)")
            else:
                out.append(f"{flag} {theirs[key]} (here: {ours[key]})")
    return out


def _recipe_differences(ours: dict, theirs: dict) -> list[str]:
    from core.protocol.recipe import Recipe

    try:
        run = Recipe.from_record(theirs.get("lr", 0.0), theirs.get("recipe"))
    except (TypeError, ValueError):
        return [f"{SHARED_FLAGS['recipe']} (the run's recipe is unreadable)"]
    return Recipe.from_record(ours.get("lr", 0.0), ours.get("recipe")).differences(run)
