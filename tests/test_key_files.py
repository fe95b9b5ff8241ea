"""Secret certificates on disk: readable by their owner only (real files, real umask)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from dafka.cli.services import secure_mesh
from dafka.config import TowerAddress
from dafka.nodes import security


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_new_keys_leave_a_0600_secret_and_nothing_else(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        public, secret = security.new_keys("n", "store", tmp_path)
    finally:
        os.umask(old)
    assert mode(secret) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["n.key", "n.key_secret"]
    assert security.read_certificate(public).role == "store"
    assert security.read_certificate(secret).secret is not None


def test_dafka_up_secure_makes_a_loosened_secret_private_again(tmp_path: Path) -> None:
    """`dafka up --secure` reuses the key pairs under DATA/keys; a secret made world-readable
    since (copied, restored from a backup, chmod by hand) was used as it was."""
    secure_mesh(tmp_path, TowerAddress())
    secret = tmp_path / "keys" / "store.key_secret"
    assert mode(secret) == 0o600
    os.chmod(secret, 0o644)
    secure_mesh(tmp_path, TowerAddress())
    assert mode(secret) == 0o600
