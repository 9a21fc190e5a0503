"""Boolean knobs read from the environment, with one spelling of true and false for all."""
import os


def flag(name, default=True):
    """The value of the switch `name` (1/0, true/false, yes/no, on/off; empty: `default`)."""
    raw = os.environ.get(name, "").strip().lower()
    if raw == "":
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 0 or 1; got {raw!r}")
