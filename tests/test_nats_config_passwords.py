"""``lig nats-config`` passwords: never starting with ``-`` (argparse would read the value of
``--nats-password VALUE`` as a flag), as strong as before."""

from __future__ import annotations

import argparse
import secrets
from pathlib import Path

import pytest

from lig import nats_config
from lig.nats_permissions import SERVICES
from shared.nats_connection import add_nats_arguments, settings_from_args
from shared.subjects import Subjects

SUBJECTS = Subjects("lig")
REPLAY = Subjects("lig-replay")


def _parsed_password(password: str) -> str | None:
    """The password as a service reads it from ``--nats-password VALUE`` (two argv words)."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_nats_arguments(parser)
    return settings_from_args(parser.parse_args(["--nats-password", password])).password


def test_a_drawn_password_starting_with_a_dash_is_drawn_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # secrets draws a leading "-" once in 64 passwords; make the first draws do so.
    real = secrets.token_urlsafe
    forced = ["-" + real(32)[1:], "-" + real(32)[1:]]

    def token_urlsafe(nbytes: int) -> str:
        return forced.pop(0) if forced else real(nbytes)

    monkeypatch.setattr(nats_config.secrets, "token_urlsafe", token_urlsafe)
    users = nats_config.write_config(tmp_path, SUBJECTS, REPLAY)
    assert len(users) == len(SERVICES)
    for user in users:
        assert not user.password.startswith("-"), user
        assert _parsed_password(user.password) == user.password


def test_generated_passwords_parse_as_a_flag_value_and_keep_their_strength(
    tmp_path: Path,
) -> None:
    # 100 configurations = 600 passwords: with the old generator one at least starts with "-"
    # with probability 1 - (63/64)**600 > 99.99%.
    passwords = [
        user.password
        for round_ in range(100)
        for user in nats_config.write_config(tmp_path / str(round_), SUBJECTS, REPLAY)
    ]
    assert len(set(passwords)) == len(passwords)
    for password in passwords:
        assert not password.startswith("-"), password
        assert len(password) == 43  # 32 random bytes in URL-safe base64, as before
    assert all(_parsed_password(password) == password for password in passwords[:50])
