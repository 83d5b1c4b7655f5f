"""`sluice redis-acl`: the Redis users per role (sluice.redis_acl) for an operator's own Redis.

Writes each role's password to `<password-dir>/<role>.password` (mode 0600; an existing file is kept, so
running it again prints the same users) and prints one `ACL SETUSER` per role, passwords hashed, ready for
`redis-cli`: `sluice redis-acl --namespace prod --password-dir /etc/sluice/redis | redis-cli -u $ADMIN_URL`.
Each service then runs with `SLUICE_REDIS_URL=redis://<role>@host:6379/0` and
`SLUICE_REDIS_PASSWORD_FILE=<password-dir>/<role>.password` (sluice.bus.redis_client).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
from pathlib import Path

from sluice.redis_acl import Role, acl_setuser_commands, rules


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", required=True, help="the services' bus namespace (--namespace)")
    parser.add_argument("--owner", default=None,
                        help="admission's --owner: its user may read that token stream only (default: every "
                             "tokens:* stream, for several admission processes sharing the user)")
    parser.add_argument("--cluster", action="store_true", help="also allow what a Redis Cluster client needs")
    parser.add_argument("--password-dir", required=True, help="where each role's password file is (or goes)")


def _password(path: Path) -> str:
    """Return the password in `path`, writing a new random one there (mode 0600) when the file is missing."""
    if path.exists():
        return path.read_text(encoding="utf-8").removesuffix("\n")
    password = secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(password + "\n")
    return password


def run(args: argparse.Namespace) -> int:
    """Print the ACL SETUSER commands (passwords hashed); returns 0."""
    directory = Path(args.password_dir)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    passwords = {role: _password(directory / f"{role.value}.password") for role in Role}
    role_rules = rules(args.namespace, admission_owner=args.owner, cluster=args.cluster)
    for command in acl_setuser_commands(role_rules, passwords):
        print(shlex.join(command))
    return 0
