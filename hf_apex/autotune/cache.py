"""The autotuner's disk cache: each decision keyed by what it was measured on and by the GPU and software that
ran it, so that the next run with the same setup starts with the answer instead of timing again."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from .. import distributed
from ..kernels.apex.availability import environment

logger = logging.getLogger("hf_apex")

STATE_FILE = "hf_apex_autotune.json"  # in each checkpoint: the decisions a resumed run must keep


def save_decisions(folder: str, decisions: dict) -> None:
    """Write a run's decisions into a checkpoint folder (or any folder a model is saved to)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, STATE_FILE), "w") as f:
        json.dump(decisions, f, indent=1)


def checkpoint_decisions(checkpoint: str | None) -> dict | None:
    """The decisions saved with ``checkpoint``, which a run resumed from it must keep (None: no checkpoint, or one
    saved without autotune, which is said)."""
    if not checkpoint:
        return None
    path = os.path.join(checkpoint, STATE_FILE)
    if not os.path.isfile(path):
        logger.warning(
            "hf_apex: %s has no %s (it was saved without autotune): if autotune now picks another optimizer than the "
            "one whose state it holds, loading that state fails.",
            checkpoint,
            STATE_FILE,
        )
        return None
    with open(path) as f:
        return json.load(f)


def default_cache_path() -> Path:
    return Path(os.environ.get("HF_APEX_CACHE") or Path.home() / ".cache" / "hf_apex" / "autotune.json")


def environment_key() -> dict:
    """What makes a timing valid elsewhere: the GPU and the software that runs the kernels."""
    env = environment()
    return {k: env[k] for k in ("gpu", "torch", "cuda", "hf_apex")} | {"apex": env["apex"].get("commit")}


class DecisionCache:
    """A JSON file of decisions; a corrupt or unusable file is ignored with a warning, never a crash."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path else default_cache_path()
        self._entries: dict[str, dict] | None = None

    @staticmethod
    def key(parts: dict) -> str:
        return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()

    def _load(self) -> dict[str, dict]:
        if self._entries is None:
            self._entries = {}
            if self.path.is_dir():
                logger.warning("hf_apex: autotune cache %s is a directory; decisions will not be cached.", self.path)
            elif self.path.is_file():
                try:
                    data = json.loads(self.path.read_text())
                    if not isinstance(data, dict):
                        raise ValueError("not a JSON object")
                    self._entries = data
                except (OSError, ValueError) as exc:
                    logger.warning(
                        "hf_apex: ignoring unreadable autotune cache %s (%s); it will be rewritten.", self.path, exc
                    )
        return self._entries

    def get(self, parts: dict) -> dict | None:
        return self._load().get(self.key(parts))

    def put(self, parts: dict, value: dict) -> None:
        entries = self._load()
        entries[self.key(parts)] = {**value, "key": parts}
        if distributed.rank() != 0 or self.path.is_dir():  # one writer per job; every rank keeps it in memory
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(entries, indent=1, default=str))
            os.replace(tmp, self.path)
        except OSError as exc:
            logger.warning("hf_apex: could not write the autotune cache %s (%s).", self.path, exc)
